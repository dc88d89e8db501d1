"""Argument checks, layouts and generators shared by the attention paths.

Layout everywhere: q [s, b, heads, d]; k, v [s_k, b, groups, d] (GQA: heads = groups x r,
query head i reads group i // r, as megatron's and torch's `repeat_interleave`). Inside,
q is viewed as [b, groups, r, s, d] and k, v as [b, groups, s_k, d], so K/V are broadcast
per group without ever being expanded.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from llm_act.codecs.regen import default_generator

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(s, s_k, b, heads, groups, d) after checking shapes and dtypes; ValueError/TypeError."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims [s, b, heads, d], got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    s, b, h, d = q.shape
    s_k, bk, g, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
                         "in batch or head dim")
    if g == 0 or h % g:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the K/V groups ({g})")
    if s_k == 0 and s > 0:
        raise ValueError("k and v must hold at least one position")
    return s, s_k, b, h, g, d


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be None or a finite number, got {scale!r}")
    return float(scale)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def resolve_generator(generator: Optional[torch.Generator], device: torch.device) -> torch.Generator:
    if generator is None:
        return default_generator(device)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device}, the tensors on {device}")
    return generator


def replay_generator(state: torch.Tensor, device: torch.device) -> torch.Generator:
    """A private generator set to a recorded state (the caller's generator is untouched)."""
    gen = torch.Generator(device=device)
    gen.set_state(state)
    return gen


def heads_view(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[s, b, heads, d] -> view [b, groups, heads // groups, s, d] (no copy)."""
    return x.permute(1, 2, 0, 3).unflatten(1, (groups, x.shape[2] // groups))


def groups_view(x: torch.Tensor) -> torch.Tensor:
    """[s, b, groups, d] -> view [b, groups, s, d] (no copy)."""
    return x.permute(1, 2, 0, 3)
