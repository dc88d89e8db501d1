"""Bit-packed dropout masks, Triton kernels; the spec is `bitmask_ref`.

Each program packs BLOCK bytes from a [BLOCK, 8] tile of the mask (a contiguous run of
8 * BLOCK elements, so loads coalesce) and unpacks the same tile shape. Integer
operations only; launches pass `EXACT_LAUNCH` like every llm_act kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.bitmask_ref import mask_nbytes

BLOCK = 512  # bytes per program


@triton.jit
def _pack_mask_kernel(
    x_ptr,  # [n] mask, bool (as uint8) or float
    out_ptr,  # [ceil(n / 8)] uint8
    n, nbytes,
    BLOCK: tl.constexpr,
):
    """byte k = sum_j (x[8k + j] != 0) << j."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    offs = k[:, None].to(tl.int64) * 8 + j[None, :]
    x = tl.load(x_ptr + offs, mask=offs < n, other=0)
    bits = (x != 0).to(tl.int32) << j[None, :]
    tl.store(out_ptr + k, tl.sum(bits, axis=1).to(tl.uint8), mask=k < nbytes)


@triton.jit
def _unpack_mask_kernel(
    packed_ptr,  # [ceil(n / 8)] uint8
    out_ptr,  # [n] output dtype (bool as uint8)
    n, nbytes,
    BLOCK: tl.constexpr,
):
    """out[8k + j] = (byte k >> j) & 1."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    b = tl.load(packed_ptr + k, mask=k < nbytes, other=0).to(tl.int32)
    bit = (b[:, None] >> j[None, :]) & 1
    offs = k[:, None].to(tl.int64) * 8 + j[None, :]
    if out_ptr.dtype.element_ty != tl.uint8:
        bit = bit.to(tl.float32)  # 0/1 are exact in every float dtype
    tl.store(out_ptr + offs, bit.to(out_ptr.dtype.element_ty), mask=offs < n)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Same contract as `bitmask_ref.pack_mask_ref`."""
    flat = mask.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    nb = mask_nbytes(n)
    out = torch.empty(nb, dtype=torch.uint8, device=mask.device)
    if nb:
        _pack_mask_kernel[(triton.cdiv(nb, BLOCK),)](flat, out, n, nb, BLOCK=BLOCK, **EXACT_LAUNCH)
    return out


def unpack_mask(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `bitmask_ref.unpack_mask_ref`."""
    out = torch.empty(n, dtype=dtype, device=packed.device)
    nb = mask_nbytes(n)
    if nb:
        view = out.view(torch.uint8) if dtype == torch.bool else out
        _unpack_mask_kernel[(triton.cdiv(nb, BLOCK),)](packed, view, n, nb, BLOCK=BLOCK,
                                                       **EXACT_LAUNCH)
    return out
