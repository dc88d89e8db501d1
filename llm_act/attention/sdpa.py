"""torch's fused attention (SDPA) in megatron's [s, b, heads, d] layout.

SDPA's flash / memory-efficient kernels save q, k, v, out and the logsumexp, never an
s x s tensor, provided no explicit mask is passed (a causal mask goes in as
`is_causal=True`). GQA uses `enable_gqa=True` (torch >= 2.5), so K/V are expanded only
inside the kernel and the un-expanded K/V are what is saved. On CPU the flash path takes
only dropout_p = 0; with dropout SDPA falls back to the math path (two s x s tensors),
which is why `core.attention` picks the chunked path there.

SDPA draws its dropout from the device's default generator; when a `generator` is given
it is swapped in for the call (the default generator's state is restored after it, and
the given generator advanced), so the global RNG is left untouched. Its fused kernels draw
their own mask, not stock dropout's: with attention dropout, "sdpa" is another dropout
realization than stock attention's (the chunked and unfused paths draw stock's).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from llm_act.attention import _common as C
from llm_act.codecs.regen import generator_as_default


def sdpa_call(q, k, v, causal: bool, p: float, scale: float) -> torch.Tensor:
    """SDPA on [s, b, heads, d] / [s_k, b, groups, d] views; returns [s, b, heads, d] (a view)."""
    gqa = q.shape[2] != k.shape[2]
    o = F.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
        dropout_p=p, is_causal=causal, scale=scale, enable_gqa=gqa)
    return o.permute(2, 0, 1, 3)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   dropout_p: float = 0.0, scale: Optional[float] = None,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Attention through torch SDPA: q [s, b, heads, d], k/v [s_k, b, groups, d] -> [s, b, heads, d]."""
    C.check_qkv(q, k, v)
    p = C.check_dropout(dropout_p)
    scale = C.check_scale(scale, q.shape[-1])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if p > 0.0:
        with generator_as_default(generator, q.device):
            return sdpa_call(q, k, v, causal, p, scale)
    return sdpa_call(q, k, v, causal, p, scale)
