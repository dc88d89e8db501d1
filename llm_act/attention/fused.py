"""torch's fused attention kernels called directly, for the logsumexp they return.

`F.scaled_dot_product_attention` keeps its logsumexp to itself; the backward-only path for
lossy Q/K/V (`core._BackwardFromStored`) needs it from the forward and hands it, with the
stored output, to the fused backward, so backward never runs the attention forward again:

- CPU: `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), the kernel SDPA
  itself picks on CPU without dropout (same output bit for bit; GQA natively). No dropout:
  with dropout SDPA runs its math path on CPU, and `core` uses the chunked path there.
- CUDA: `aten._scaled_dot_product_efficient_attention` (+ `_backward`), where
  `torch.backends.cuda.can_use_efficient_attention` admits the inputs. Its dropout mask is
  drawn from the default CUDA generator (swapped for the caller's, as `sdpa` does) and
  replayed in backward from the philox seed and offset the forward returns; K/V are
  expanded over GQA groups for the call and their gradients summed back. Not the kernel
  F.sdpa picks for bf16 (flash), so the forward is the same attention, not the same bits.

Layout as everywhere here: q [s, b, heads, d], k/v [s_k, b, groups, d]; the kernels see the
[b, heads, s, d] views.
"""
from __future__ import annotations

from typing import Optional

import torch

CPU_FLASH = "cpu_flash"
CUDA_EFFICIENT = "cuda_efficient"
_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)


def _expand(x: torch.Tensor, r: int) -> torch.Tensor:
    """[s, b, groups, d] -> [b, groups * r, s, d] (query head i reads group i // r)."""
    return _bhsd(x if r == 1 else x.repeat_interleave(r, dim=2))


def fused_kind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, p: float
               ) -> Optional[str]:
    """Which fused kernel pair serves these inputs (`CPU_FLASH`, `CUDA_EFFICIENT`), or None."""
    if q.device.type == "cpu":
        return CPU_FLASH if p == 0.0 and q.dtype in _CPU_DTYPES else None
    if q.device.type != "cuda":
        return None
    r = q.shape[2] // k.shape[2]
    try:
        params = torch.backends.cuda.SDPAParams(_bhsd(q), _expand(k, r), _expand(v, r), None, p,
                                                causal, False)
        return CUDA_EFFICIENT if torch.backends.cuda.can_use_efficient_attention(params) else None
    except (AttributeError, RuntimeError, TypeError):  # an older torch without the query API
        return None


def fused_forward(kind: str, q, k, v, causal: bool, p: float, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(out [s, b, heads, d], contiguous; logsumexp; rng): `rng` holds what backward needs to
    replay the dropout mask (CUDA: philox seed and offset; empty otherwise). Draws from the
    default generator: the caller swaps in its own (`generator_as_default`)."""
    if kind == CPU_FLASH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale)
        return out.permute(2, 0, 1, 3), lse, ()
    if kind == CUDA_EFFICIENT:
        r = q.shape[2] // k.shape[2]
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _expand(k, r), _expand(v, r), None, True, p, causal, scale=scale)
        # [s, b, heads, d] memory (the kernel writes [b, s, heads, d]): the caller's reshape
        # to [s, b, hidden] is then a view, so the stored output is the projection's input
        return out.permute(2, 0, 1, 3).contiguous(), lse, (seed, offset)
    raise ValueError(f"unknown fused attention kind {kind!r}")


def fused_backward(kind: str, dout, q, k, v, out, lse, rng: tuple, causal: bool, p: float,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the layouts of q, k, v ([s, b, ...]) from the stored out and lse."""
    if kind == CPU_FLASH:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal,
            scale=scale)
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)
    if kind == CUDA_EFFICIENT:
        g = k.shape[2]
        r = q.shape[2] // g
        seed, offset = rng
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout), _bhsd(q), _expand(k, r), _expand(v, r), None, _bhsd(out), lse, seed,
            offset, p, [True, True, True, False], causal, scale=scale)
        if r > 1:  # each group's gradient is the sum over its r query heads
            dk, dv = dk.unflatten(1, (g, r)).sum(2), dv.unflatten(1, (g, r)).sum(2)
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)
    raise ValueError(f"unknown fused attention kind {kind!r}")
