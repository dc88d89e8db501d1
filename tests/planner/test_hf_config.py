"""`shape_from_hf_config`: published config.json files become the presets' `ModelShape`s
(Llama-3-8B is the llama-8b preset, GPT-2 medium the gpt2-medium one with GPT-2's tanh GELU,
Mistral-7B Llama-3-8B's layers with its own vocabulary), Qwen2's q/k/v biases and Qwen3's q/k
norms are kept, and what the planner cannot model is refused naming the config's key."""
from __future__ import annotations

import pytest

from llm_act.planner.hf_config import UNPLANNABLE, HFConfigError, shape_from_hf_config
from llm_act.planner.presets import MODELS
from tests.cli.hf_configs import (GPT2, GPT2_MEDIUM, LLAMA3_8B, MISTRAL_7B, MIXTRAL, QWEN2_05B, QWEN3_06B,
                                  QWEN3_8B, write)


def test_llama3_8b_is_the_llama_8b_preset():
    assert shape_from_hf_config(LLAMA3_8B) == MODELS["llama-8b"]


def test_gpt2_medium_is_the_preset_with_the_tanh_gelu():
    assert shape_from_hf_config(GPT2_MEDIUM) == MODELS["gpt2-medium"].with_(activation="gelu_tanh")
    small = shape_from_hf_config(GPT2)
    assert (small.num_layers, small.hidden_size, small.num_attention_heads, small.num_query_groups,
            small.ffn_hidden_size, small.seq_length, small.vocab_size) == (12, 768, 12, 12, 3072, 1024, 50257)
    assert (small.normalization, small.position_embedding, small.tie_embeddings, small.bias,
            small.dropout, small.dtype) == ("LayerNorm", "learned_absolute", True, True, 0.1, "bf16")


def test_mistral_7b_is_llama_3_8b_layers_within_its_window():
    shape = shape_from_hf_config(MISTRAL_7B, seq_length=4096)
    assert shape == MODELS["llama-8b"].with_(vocab_size=32000, seq_length=4096)
    with pytest.raises(HFConfigError, match=r"^sliding_window=4096 is shorter than the 32768-token .*"
                                            r"--seq-length 4096 or less$"):
        shape_from_hf_config(MISTRAL_7B)  # its context, 32768 tokens
    assert shape_from_hf_config({**MISTRAL_7B, "sliding_window": None}).seq_length == 32768


def test_qwen2_keeps_its_qkv_biases_and_ignores_a_window_that_is_off():
    shape = shape_from_hf_config(QWEN2_05B)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads, shape.num_query_groups,
            shape.ffn_hidden_size, shape.seq_length, shape.vocab_size) == (24, 896, 14, 2, 4864, 131072, 151936)
    assert shape.bias and shape.tie_embeddings and shape.gated_linear_unit and not shape.qk_layernorm
    windowed = {**QWEN2_05B, "use_sliding_window": True, "sliding_window": 4096}
    assert shape_from_hf_config(windowed, seq_length=4096).seq_length == 4096
    with pytest.raises(HFConfigError, match="^sliding_window=4096"):
        shape_from_hf_config(windowed, seq_length=8192)
    full = {**windowed, "layer_types": ["full_attention"] * 24}  # the layers say where a window is
    assert shape_from_hf_config(full, seq_length=8192).seq_length == 8192
    with pytest.raises(HFConfigError, match="^layer_types names chunked_attention: "):
        shape_from_hf_config({**QWEN2_05B, "layer_types": ["full_attention", "chunked_attention"] * 12})


def test_qwen3_has_qk_norms_and_a_head_dim_other_than_hidden_over_heads_is_refused():
    shape = shape_from_hf_config(QWEN3_8B)
    assert shape.qk_layernorm and not shape.bias and shape.head_dim == 128
    assert (shape.num_layers, shape.num_query_groups, shape.ffn_hidden_size, shape.seq_length) == (36, 8, 12288, 40960)
    assert shape_from_hf_config({**QWEN3_8B, "attention_bias": True}).bias
    with pytest.raises(HFConfigError, match=r"^head_dim=128 is not hidden_size / num_attention_heads = "
                                            r"1024 / 16 = 64: "):
        shape_from_hf_config(QWEN3_06B)


def test_a_path_and_changes(tmp_path):
    path = write(tmp_path, LLAMA3_8B)
    assert shape_from_hf_config(path, tp=8, seq_length=4096) == MODELS["llama-8b"].with_(tp=8, seq_length=4096)
    assert shape_from_hf_config({**GPT2, "resid_pdrop": 0.0, "embd_pdrop": 0.0}).dropout == 0.1  # the largest
    assert shape_from_hf_config(GPT2, dropout=0.0).dropout == 0.0
    assert shape_from_hf_config({**LLAMA3_8B, "torch_dtype": "float32"}).dtype == "fp32"
    assert shape_from_hf_config({**LLAMA3_8B, "some_new_key": 3, "num_experts": 0}) == MODELS["llama-8b"]
    with pytest.raises(ValueError, match="^tp=3 does not divide") as err:  # a change, not the config
        shape_from_hf_config(LLAMA3_8B, tp=3)
    assert not isinstance(err.value, HFConfigError)


@pytest.mark.parametrize("config, message", [
    (MIXTRAL, "model_type 'mixtral' is not planned from a config.json; supported: gpt2, llama, mistral, "
              "qwen2, qwen3 (mixture-of-experts models: the presets --model mixtral-8x7b / deepseek-v3-like)"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not planned"),
    ({"hidden_size": 4096}, "no model_type"),
    ({**LLAMA3_8B, "num_local_experts": 8}, "num_local_experts is set: a mixture of experts"),
    ({**LLAMA3_8B, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping is set: "),
    ({**LLAMA3_8B, "quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config is set: "),
    ({**LLAMA3_8B, "hidden_act": "quick_gelu"}, 'hidden_act="quick_gelu": the planner models gelu, '),
    ({**GPT2, "activation_function": "relu6"}, 'activation_function="relu6": '),
    ({**LLAMA3_8B, "torch_dtype": "float8_e4m3fn"}, 'torch_dtype="float8_e4m3fn": the planner models bfloat16'),
    ({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}, "no num_hidden_layers: "),
    ({**LLAMA3_8B, "hidden_size": "4096"}, "hidden_size: expected a positive integer, got '4096'"),
    ({**LLAMA3_8B, "tie_word_embeddings": "no"}, 'tie_word_embeddings: expected true or false, got "no"'),
    ({**LLAMA3_8B, "attention_dropout": 1.5}, "attention_dropout: expected a probability"),
    ({**LLAMA3_8B, "num_key_value_heads": 5}, "num_key_value_heads=5 does not divide num_attention_heads=32"),
    ({**GPT2, "n_embd": 770}, "n_embd=770 is not a multiple of n_head=12"),
])
def test_what_cannot_be_planned_is_refused_naming_the_key(config, message):
    with pytest.raises(HFConfigError) as err:
        shape_from_hf_config(config)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_every_unplannable_key_is_refused_when_set_and_ignored_when_null():
    for key in UNPLANNABLE:
        assert shape_from_hf_config({**LLAMA3_8B, key: None}) == MODELS["llama-8b"]
        with pytest.raises(HFConfigError, match=f"^{key} is set: "):
            shape_from_hf_config({**LLAMA3_8B, key: 2})
