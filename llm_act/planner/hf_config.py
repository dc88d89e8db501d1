"""A Hugging Face `config.json` as the planner's `ModelShape`, for `llm-act plan --hf-config`.

The file is read as plain JSON: no `transformers` import, no download. It is one job because a
user who trains a published model holds its `config.json`, not a megatron preset; translating
the keys once, here, lets `llm-act plan` size that model on paper like a preset.

Families (`FAMILIES`, by `model_type`): the dense decoders transformers ships that users train,
gpt2, llama, mistral, qwen2 and qwen3. Anything else, MoE types included (mixtral, qwen2_moe,
qwen3_moe, deepseek_v3, ...), is refused naming the type and the supported ones.

The rule for keys (a config is never refused for a key this module does not know):
1. read: the keys of the family's table (below) become `ModelShape` fields; a missing
   required one or a value of the wrong kind is refused naming the key.
2. refused: the keys of `UNPLANNABLE` change the shapes or the stored tensors in a way
   `ModelShape` cannot represent (experts, latent attention, logit soft-capping, quantized
   weights, cross-attention); one set to anything but null/false/0 is refused naming it. So
   are three checked values: a `head_dim` other than hidden / heads (`ModelShape` derives the
   head width; the attention projections would have another size), a sliding window shorter
   than the planned sequence, and `layer_types` other than full or sliding attention.
3. ignored: every other key. Token ids, initializers, `use_cache`, norm epsilons (numerics),
   and what changes only positions (`rope_theta`, `rope_scaling`, `partial_rotary_factor`:
   the rotary tables' size does not depend on them, and a smaller rotary part only shrinks
   what is planned) do not change memory. New transformers releases add keys every month; a
   key known to change shapes is added to `UNPLANNABLE` rather than refusing the unknown.

The table (llama-style = llama, mistral, qwen2, qwen3):

| ModelShape field    | gpt2                              | llama-style                       |
| ------------------- | --------------------------------- | --------------------------------- |
| num_layers          | n_layer                           | num_hidden_layers                 |
| hidden_size         | n_embd                            | hidden_size                       |
| num_attention_heads | n_head                            | num_attention_heads               |
| num_query_groups    | (= heads)                         | num_key_value_heads (absent: = heads) |
| ffn_hidden_size     | n_inner (null: 4 x hidden)        | intermediate_size                 |
| seq_length          | n_positions (--seq-length wins)   | max_position_embeddings (ditto)   |
| vocab_size          | vocab_size                        | vocab_size                        |
| activation          | activation_function (gelu_new)    | hidden_act (silu)                 |
| gated_linear_unit   | False                             | True (gate, up and down proj)     |
| dropout             | max(resid_, attn_, embd_pdrop)    | attention_dropout                 |
| bias                | True                              | see below                         |
| normalization       | LayerNorm                         | RMSNorm                           |
| position_embedding  | learned_absolute                  | rope                              |
| tie_embeddings      | tie_word_embeddings (True)        | tie_word_embeddings (False)       |
| qk_layernorm        | False                             | qwen3 True, else False            |
| dtype               | torch_dtype or dtype (absent: bf16) | torch_dtype or dtype (ditto)  |

Decisions where a config says more than `ModelShape` holds:
- dropout: `ModelShape` has one probability for the hidden and the attention dropout; the
  largest of the config's is planned (as `patches.megatron.model_shape` does), which stores
  every mask the larger one would: never less memory than the run needs. --dropout overrides.
- bias: `ModelShape.bias` is one flag for every linear. It is True when any linear has a
  bias: llama's attention_bias or mlp_bias, qwen3's attention_bias, qwen2's biases on q, k
  and v only (transformers builds them whatever the config says), mistral none. For qwen2
  this counts the output projection's and the MLP's biases too, 2 x hidden + 2 x ffn
  parameters a layer that the model lacks: an overestimate of static memory (about 16
  bytes each with Adam), never an underestimate. Biases change no stored activation.
- sliding window (mistral's `sliding_window`; qwen's when `use_sliding_window` or
  `layer_types` names sliding layers): llm_act's attention paths have no window, so a
  window at least as long as the sequence is planned as the full causal attention it is,
  and a shorter one is refused with the fix (a --seq-length no longer than the window).
- head_dim: Qwen3-0.6B (1024 / 16 = 64, head_dim 128) and Qwen3-4B (2560 / 32 = 80, 128)
  are refused; Qwen3-8B (4096 / 32 = 128) plans. A separate head width would touch every
  formula of the analytic model that reads `ModelShape.head_dim`.
"""
from __future__ import annotations

import json
import numbers
import os
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Union

from llm_act.planner.model_shape import ModelShape, positive_int
from llm_act.planner.presets import MODELS


class HFConfigError(ValueError):
    """A config.json the planner cannot read or plan, in one line that names the key."""


@dataclass(frozen=True)
class Family:
    """How one `model_type`'s keys become `ModelShape` fields (the table in the module doc)."""

    sizes: tuple[tuple[str, str], ...]
    """(ModelShape field, config key): required positive integers"""
    optional_sizes: tuple[tuple[str, str], ...]
    """(ModelShape field, config key): absent or null = ModelShape's default"""
    activation: tuple[str, str]
    """the activation's key and transformers' default for it"""
    dropouts: tuple[tuple[str, float], ...]
    """the dropout keys and transformers' defaults; the largest is planned"""
    bias: Union[bool, tuple[str, ...]]
    """fixed by the architecture, or True when any of these keys is"""
    tie_default: bool
    fixed: Mapping[str, Any]
    """ModelShape fields the architecture fixes"""
    window: Union[bool, str]
    """whether `sliding_window` applies: never (False), whenever set (True), or when this
    key is true (`layer_types` naming sliding layers decides where it is given)"""

    def renamed(self, text: str) -> str:
        """`text` (a ModelShape error) with its field names written as this family's keys."""
        keys = dict(self.sizes + self.optional_sizes)
        keys.update(dropout="/".join(k for k, _ in self.dropouts), activation=self.activation[0],
                    tie_embeddings="tie_word_embeddings")
        return re.sub(r"\b(" + "|".join(keys) + r")\b", lambda m: keys[m.group(1)], text)


_GPT2 = Family(
    sizes=(("num_layers", "n_layer"), ("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
           ("seq_length", "n_positions"), ("vocab_size", "vocab_size")),
    optional_sizes=(("ffn_hidden_size", "n_inner"),),
    activation=("activation_function", "gelu_new"),
    dropouts=(("resid_pdrop", 0.1), ("attn_pdrop", 0.1), ("embd_pdrop", 0.1)),
    bias=True, tie_default=True, window=False,
    fixed=MappingProxyType(dict(gated_linear_unit=False, normalization="LayerNorm",
                                position_embedding="learned_absolute", qk_layernorm=False)))


def _llama_style(bias: Union[bool, tuple[str, ...]], window: Union[bool, str],
                 qk_layernorm: bool = False) -> Family:
    """Llama's layout (gated MLP, RMSNorm, rotary, GQA, untied by default) with its variations."""
    return Family(
        sizes=(("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
               ("num_attention_heads", "num_attention_heads"), ("ffn_hidden_size", "intermediate_size"),
               ("seq_length", "max_position_embeddings"), ("vocab_size", "vocab_size")),
        optional_sizes=(("num_query_groups", "num_key_value_heads"),),
        activation=("hidden_act", "silu"), dropouts=(("attention_dropout", 0.0),),
        bias=bias, tie_default=False, window=window,
        fixed=MappingProxyType(dict(gated_linear_unit=True, normalization="RMSNorm",
                                    position_embedding="rope", qk_layernorm=qk_layernorm)))


#: model_type -> how its config.json is read
FAMILIES: Mapping[str, Family] = MappingProxyType({
    "gpt2": _GPT2,
    "llama": _llama_style(bias=("attention_bias", "mlp_bias"), window=False),
    "mistral": _llama_style(bias=False, window=True),
    "qwen2": _llama_style(bias=True, window="use_sliding_window"),  # q, k and v only
    "qwen3": _llama_style(bias=("attention_bias",), window="use_sliding_window", qk_layernorm=True),
})

#: keys that change the shapes or the stored tensors beyond what ModelShape represents
UNPLANNABLE: Mapping[str, str] = MappingProxyType({
    "num_experts": "a mixture of experts",
    "num_local_experts": "a mixture of experts",
    "n_routed_experts": "a mixture of experts",
    "num_experts_per_tok": "a mixture of experts",
    "q_lora_rank": "multi-head latent attention",
    "kv_lora_rank": "multi-head latent attention",
    "attn_logit_softcapping": "soft-capped attention scores (a stored tanh)",
    "final_logit_softcapping": "soft-capped logits (a stored tanh)",
    "quantization_config": "quantized weights (static memory counts weights in the model dtype)",
    "add_cross_attention": "cross-attention layers",
})

#: transformers' activation names (ACT2FN) -> ModelShape's (`codecs.fewbit_fit.ACTIVATIONS`)
HF_ACTIVATIONS: Mapping[str, str] = MappingProxyType({
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh", "silu": "silu", "swish": "silu", "relu": "relu",
    "sigmoid": "sigmoid", "tanh": "tanh",
})

#: torch_dtype / dtype -> ModelShape.dtype
HF_DTYPES: Mapping[str, str] = MappingProxyType({"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"})

#: the `layer_types` the planner reads: full attention, and sliding (full within its window)
_LAYER_TYPES = ("full_attention", "sliding_attention")


def load_hf_config(path: Union[str, os.PathLike]) -> dict:
    """The JSON object in `path`; HFConfigError when it cannot be read or is not one."""
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as err:
        raise HFConfigError(f"cannot read it ({err.strerror}); name a config.json file") from None
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise HFConfigError(f"not a JSON file ({err}); name a model's config.json") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"not a config.json (a JSON {type(config).__name__}, not an object)")
    return config


def family_of(config: Mapping[str, Any]) -> Family:
    """The family of `config`'s model_type; HFConfigError for one the planner does not read."""
    kind = config.get("model_type")
    if kind is None:
        raise HFConfigError("no model_type: not a transformers config.json (or an old one; add the "
                            f"model's type, one of {', '.join(FAMILIES)})")
    if isinstance(kind, str) and kind in FAMILIES:
        return FAMILIES[kind]
    moe = [name for name, shape in MODELS.items() if shape.is_moe]
    raise HFConfigError(
        f"model_type {kind!r} is not planned from a config.json; supported: {', '.join(FAMILIES)} "
        f"(mixture-of-experts models: the presets --model {' / '.join(moe)})")


def shape_from_hf_config(config: Union[Mapping[str, Any], str, os.PathLike], **changes) -> ModelShape:
    """The `ModelShape` of a config.json (a path or its parsed object), with `changes` (e.g.
    seq_length, tp, dropout) applied. HFConfigError names the key the planner cannot plan;
    a ValueError without it comes from `changes` (e.g. a tp that does not divide the heads)."""
    cfg = config if isinstance(config, Mapping) else load_hf_config(config)
    fam = family_of(cfg)
    for key, why in UNPLANNABLE.items():
        if cfg.get(key) not in (None, False, 0, "", [], {}):
            raise HFConfigError(f"{key} is set: {why}, which the planner does not model")
    fields = dict(fam.fixed)
    for field, key in fam.sizes:
        if cfg.get(key) is None:
            raise HFConfigError(f"no {key}: a {cfg['model_type']} config.json names it")
        fields[field] = _positive(cfg[key], key)
    for field, key in fam.optional_sizes:
        if cfg.get(key) is not None:
            fields[field] = _positive(cfg[key], key)
    fields.update(activation=_activation(cfg, fam), dropout=_dropout(cfg, fam), bias=_bias(cfg, fam),
                  dtype=_dtype(cfg), tie_embeddings=_flag(cfg, "tie_word_embeddings", fam.tie_default))
    _check_head_dim(cfg, fields)
    try:
        shape = ModelShape(micro_batch_size=1, **fields)
    except ValueError as err:
        raise HFConfigError(fam.renamed(str(err))) from None
    _check_window(cfg, fam, changes.get("seq_length", shape.seq_length))
    return shape.with_(**changes)


def _positive(value: Any, key: str) -> int:
    try:
        return positive_int(value, key)
    except ValueError as err:
        raise HFConfigError(str(err)) from None


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"{key}: expected true or false, got {json.dumps(value)}")
    return value


def _activation(cfg: Mapping[str, Any], fam: Family) -> str:
    key, default = fam.activation
    value = cfg.get(key) or default
    if not isinstance(value, str) or value not in HF_ACTIVATIONS:
        raise HFConfigError(f"{key}={json.dumps(value)}: the planner models {', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[value]


def _dropout(cfg: Mapping[str, Any], fam: Family) -> float:
    values = []
    for key, default in fam.dropouts:
        value = cfg.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
            raise HFConfigError(f"{key}: expected a probability in [0, 1), got {json.dumps(value)}")
        values.append(float(value))
    return max(values)


def _bias(cfg: Mapping[str, Any], fam: Family) -> bool:
    if isinstance(fam.bias, bool):
        return fam.bias
    return any([_flag(cfg, key, False) for key in fam.bias])


def _dtype(cfg: Mapping[str, Any]) -> str:
    key = "torch_dtype" if "torch_dtype" in cfg else "dtype"
    value = cfg.get(key)
    if value is None:
        return "bf16"
    if not isinstance(value, str) or value not in HF_DTYPES:
        raise HFConfigError(f"{key}={json.dumps(value)}: the planner models {', '.join(HF_DTYPES)}")
    return HF_DTYPES[value]


def _check_head_dim(cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        return
    h, a = fields["hidden_size"], fields["num_attention_heads"]
    if _positive(head_dim, "head_dim") * a != h:
        raise HFConfigError(
            f"head_dim={head_dim} is not hidden_size / num_attention_heads = {h} / {a} = {h / a:g}: the "
            f"planner derives the head width from those two, so this model's attention cannot be planned")


def _check_window(cfg: Mapping[str, Any], fam: Family, seq_length: int) -> None:
    """Refuse a sliding window shorter than the sequence (llm_act's attention has none)."""
    kinds = cfg.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            raise HFConfigError(f"layer_types: expected a list of layer kinds, got {json.dumps(kinds)}")
        unknown = sorted(set(kinds) - set(_LAYER_TYPES))
        if unknown:
            raise HFConfigError(f"layer_types names {', '.join(unknown)}: the planner models "
                                f"{' and '.join(_LAYER_TYPES)} layers only")
    window = cfg.get("sliding_window")
    if fam.window is False or window is None:
        return
    if kinds is not None:
        windowed = "sliding_attention" in kinds
    else:
        windowed = fam.window is True or _flag(cfg, fam.window, False)
    if windowed and _positive(window, "sliding_window") < seq_length:
        raise HFConfigError(
            f"sliding_window={window} is shorter than the {seq_length}-token sequence and llm_act's "
            f"attention has no window; plan it with --seq-length {window} or less")
