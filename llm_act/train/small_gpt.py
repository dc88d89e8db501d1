"""Small megatron-core GPTs built on CPU from the local (non-Transformer-Engine) spec: the
models of `llm-act demo`, the benches and the DeepSpeed example, and of the tests."""
from __future__ import annotations

from typing import Any, Optional

import torch


def small_config(
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    **overrides: Any,
):
    """A small TransformerConfig built on CPU; `dropout` sets hidden and attention dropout.

    bf16/fp16 set the matching flags and `params_dtype`. `bias_dropout_fusion` defaults to
    False here: megatron's fused bias-dropout-add is a `torch.compile` function, which
    costs about a minute of Inductor compilation on CPU. Everything else is
    megatron-core's default unless overridden.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    kw: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        bias_dropout_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def local_layer_spec(**kwargs: Any):
    """megatron-core's GPT layer spec without Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(**kwargs)


def gpt_model(config, vocab_size: int = 128, max_sequence_length: int = 64, spec=None, **kwargs: Any):
    """A GPTModel (RoPE by default) from the local spec, on CPU, in `config.params_dtype`."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs.setdefault("position_embedding_type", "rope")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec if spec is not None else local_layer_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        **kwargs,
    )


def transformer_layer(config, layer_number: int = 1, spec=None):
    """One stock TransformerLayer (local spec); megatron's `layer_number` is 1-based."""
    from megatron.core.transformer.spec_utils import build_module

    spec = spec if spec is not None else local_layer_spec()
    return build_module(spec, config=config, layer_number=layer_number)


def gpt_batch(batch: int, seq: int, vocab_size: int = 128, generator: Optional[torch.Generator] = None):
    """(input_ids, position_ids, labels) for a GPTModel forward; labels are the ids shifted."""
    ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return ids[:, :-1].contiguous(), pos, ids[:, 1:].contiguous()
