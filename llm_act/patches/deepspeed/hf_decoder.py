"""A small Hugging Face decoder built from a config (no weights, no download).

The DeepSpeed door's example of a model that is not megatron-core: a decoder of one of the
families the generic door knows site by site (`hf_families`: Llama, Qwen2, Qwen3, Mistral,
GPT-2), randomly initialised from the seed, in float32 with SDPA attention; or the decoder a
model's own `config.json` describes (`from_config_file`, read as plain JSON: nothing is
downloaded, no remote code runs). `transformers` is the `hf` extra.
"""
from __future__ import annotations

import os
from typing import Any, Union

import torch

from llm_act._imports import require

#: the families `build` makes (each has a site table, `hf_families.FAMILIES`)
KINDS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


def _sizes(kind: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
           num_kv_heads: int, ffn_hidden_size: int, max_positions: int) -> dict[str, Any]:
    """The config fields of a `kind` decoder of these sizes (no dropout: the loss of a run is
    the same whatever compresses it)."""
    common = dict(vocab_size=vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    if kind == "gpt2":
        return dict(common, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_inner=ffn_hidden_size,
                    n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return dict(common, hidden_size=hidden_size, intermediate_size=ffn_hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=hidden_size // num_heads, max_position_embeddings=max_positions)


def build(kind: str = "llama", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
          num_heads: int = 4, num_kv_heads: int = 2, ffn_hidden_size: int = 176,
          max_positions: int = 128, seed: int = 1234) -> torch.nn.Module:
    """A randomly initialised decoder of `kind` (one of `KINDS`), in float32, train mode."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    transformers = require("transformers", "llm_act.patches.deepspeed.hf_decoder")
    fields = _sizes(kind, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, ffn_hidden_size,
                    max_positions)
    cfg = transformers.AutoConfig.for_model(kind, **fields, attn_implementation="sdpa")
    return _initialised(transformers, cfg, seed)


def from_config_file(path: Union[str, os.PathLike], seed: int = 1234, **changes: Any) -> torch.nn.Module:
    """A randomly initialised decoder as `path` (a model's config.json) describes it, with
    `changes` (config keys, e.g. num_hidden_layers=2) applied, in float32, train mode.
    `hf_config.HFConfigError` (one line) where the file cannot be read, or names a model_type
    or a key the planner does not plan."""
    from llm_act.planner.hf_config import HFConfigError, load_hf_config, shape_from_hf_config

    transformers = require("transformers", "llm_act.patches.deepspeed.hf_decoder")
    fields = {**load_hf_config(path), **changes}
    shape_from_hf_config(fields)  # refuses what cannot be planned, before anything is built
    kind = fields.pop("model_type")
    for key in ("architectures", "auto_map", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(key, None)
    fields.setdefault("attn_implementation", "sdpa")
    try:
        cfg = transformers.AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError) as err:
        raise HFConfigError(f"transformers cannot build a {kind} config from it ({err})") from None
    return _initialised(transformers, cfg, seed)


def _initialised(transformers: Any, cfg: Any, seed: int) -> torch.nn.Module:
    """`AutoModelForCausalLM` of `cfg` with weights drawn from `seed` (the global RNG is put
    back), float32, train mode."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    finally:
        torch.random.set_rng_state(state)
    return model.train()


def lm_loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; `labels` are the already shifted targets of `tokens`."""
    logits = model(input_ids=tokens, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
