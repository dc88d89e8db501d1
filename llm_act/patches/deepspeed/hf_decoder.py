"""A small Hugging Face decoder built from a config (no weights, no download).

The DeepSpeed door's example of a model that is not megatron-core: a `LlamaForCausalLM`
(RMSNorm, RoPE, SwiGLU, grouped-query SDPA attention) or a `GPT2LMHeadModel` (LayerNorm,
learned positions, GELU), randomly initialised from the seed. `transformers` is the
`hf` extra.
"""
from __future__ import annotations

from typing import Any

import torch

from llm_act._imports import require

KINDS = ("llama", "gpt2")


def build(kind: str = "llama", vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2,
          num_heads: int = 4, num_kv_heads: int = 2, ffn_hidden_size: int = 176,
          max_positions: int = 128, seed: int = 1234) -> torch.nn.Module:
    """A randomly initialised decoder of `kind` ("llama" or "gpt2"), in float32, train mode."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    transformers = require("transformers", "llm_act.patches.deepspeed.hf_decoder")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if kind == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=ffn_hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
                tie_word_embeddings=False, attn_implementation="sdpa",
            )
            model = transformers.LlamaForCausalLM(cfg)
        else:
            cfg = transformers.GPT2Config(
                vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads,
                n_inner=ffn_hidden_size, n_positions=max_positions, bos_token_id=None,
                eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                tie_word_embeddings=False, attn_implementation="sdpa",
            )
            model = transformers.GPT2LMHeadModel(cfg)
    finally:
        torch.random.set_rng_state(state)
    return model.train()


def lm_loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; `labels` are the already shifted targets of `tokens`."""
    logits = model(input_ids=tokens, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
