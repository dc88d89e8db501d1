"""Outlier-separated INT4 (Adacc sec. 3.2) in Triton; the spec is `outlier_ref`.

Three kernels, each one pass over x:
- `outlier_colsum`: per-channel sum of |x| (a column reduction; row splits write float32
  partials that torch adds, so the result is deterministic, no atomics);
- `outlier_encode`: one program per tile of GROUPS groups: loads x contiguously, reads
  each element's channel slot (int32 [C], -1 for inliers), writes outlier values to
  their [rows, n] slot, takes the finite-inlier min/max of each group, quantizes with
  the noise (passed in, drawn by Philox from a seed tensor, or none: nearest) and packs
  two codes per byte;
- `outlier_decode`: unpacks, dequantizes and takes outlier positions from the stored
  values, writing x's dtype contiguously.
The z-score and top-k over C channels stay in torch (`outlier_ref.select_outliers`).

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): scale, codes
and values come from `int_quant_triton`'s `_params` / `_codes` / `_values` (divisions are
`tl.math.div_rn`), and launches pass `EXACT_LAUNCH` (no FMA contraction). The one
order-dependent float result is `outlier_colsum` (a tree sum on a GPU, torch's order in
the reference): it only feeds the z-score selection, and tests compare it within 1e-5.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.int_quant_triton import _codes, _params, _values
from llm_act.kernels.outlier_ref import outlier_positions
from llm_act.kernels.packing_ref import packed_numel

_TARGET_PROGRAMS = 512  # enough column x row-split programs to fill a GPU


@triton.jit
def _colsum_kernel(x_ptr, part_ptr, rows, C, rows_per_split,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    r_start = pid_s * rows_per_split
    r_end = tl.minimum(r_start + rows_per_split, rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        m = (r < r_end)[:, None] & cmask[None, :]
        v = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + cols[None, :], mask=m, other=0.0)
        a = tl.abs(v.to(tl.float32))
        acc += tl.where(a < float("inf"), a, 0.0)
    tl.store(part_ptr + pid_s.to(tl.int64) * C + cols, tl.sum(acc, axis=0), mask=cmask)


def outlier_colsum(x2: torch.Tensor) -> torch.Tensor:
    """Per-channel sum of |x| over rows, float32 [C]; non-finite entries count as 0."""
    x2 = x2.contiguous()
    rows, C = x2.shape
    if rows == 0 or C == 0:
        return torch.zeros(C, dtype=torch.float32, device=x2.device)
    BLOCK_C = min(128, triton.next_power_of_2(C))
    BLOCK_R = 32
    col_blocks = triton.cdiv(C, BLOCK_C)
    row_blocks = triton.cdiv(rows, BLOCK_R)
    splits = max(1, min(row_blocks, _TARGET_PROGRAMS // col_blocks))
    rows_per_split = triton.cdiv(row_blocks, splits) * BLOCK_R
    splits = triton.cdiv(rows, rows_per_split)
    part = torch.empty((splits, C), dtype=torch.float32, device=x2.device)
    _colsum_kernel[(col_blocks, splits)](x2, part, rows, C, rows_per_split,
                                         BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, **EXACT_LAUNCH)
    return part.sum(dim=0)


@triton.jit
def _row_col(g, group_size, C, BLOCK: tl.constexpr):
    """Row (int64) and channel (int32) of every element of the groups `g`: one int64
    division per group, int32 ones per element."""
    start = g * group_size
    row0 = start // C
    t = (start - row0 * C).to(tl.int32)[:, None] + tl.arange(0, BLOCK)[None, :]
    return row0[:, None] + (t // C), t % C


@triton.jit
def _encode_kernel(x_ptr, pos_ptr, noise_ptr, seed_ptr, packed_ptr, scale_ptr, zero_ptr,
                   val_ptr, n, C, n_out, G, group_size,
                   MODE: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: nearest, 1: noise tensor, 2: Philox from the seed tensor
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK)
    gmask = g < G
    e = g[:, None] * group_size + j[None, :]
    m = gmask[:, None] & (j[None, :] < group_size) & (e < n)
    x = tl.load(x_ptr + e, mask=m, other=0.0)
    row, col = _row_col(g, group_size, C, BLOCK)
    slot = tl.load(pos_ptr + col, mask=m, other=-1)
    xf = x.to(tl.float32)
    finite = tl.abs(xf) < float("inf")
    outl = m & (slot >= 0)
    inl = m & (slot < 0)
    use = inl & finite
    bad = inl & (finite == 0)
    # exact outlier values (non-finite -> NaN) into their [rows, n_out] slot
    nan_x = tl.where(finite, x, float("nan")).to(val_ptr.dtype.element_ty)
    tl.store(val_ptr + row * n_out + slot, nan_x, mask=outl)
    # finite-inlier range and the non-finite flag of each group
    lo = tl.min(tl.where(use, xf, float("inf")), axis=1)
    hi = tl.max(tl.where(use, xf, -float("inf")), axis=1)
    has = tl.max(use.to(tl.int32), axis=1) > 0
    flag = tl.max(bad.to(tl.int32), axis=1) > 0
    lo = tl.where(has, lo, 0.0)
    hi = tl.where(has, hi, 0.0)
    scale, zero = _params(lo, hi, flag, 4, False)
    if MODE == 1:
        u = tl.load(noise_ptr + e, mask=m, other=0.0).to(tl.float32)
    elif MODE == 2:
        u = tl.rand(tl.load(seed_ptr), e.to(tl.int32))
    else:
        u = 0.5
    # IntQuant's asymmetric INT4; outliers and padding take code 0
    code = _codes(xf, finite, scale[:, None], zero[:, None], u, 4, False)
    code = tl.where(use | bad, code, 0).to(tl.uint8)
    lo_c, hi_c = tl.split(tl.reshape(code, [GROUPS, BLOCK // 2, 2]))
    byte = lo_c | (hi_c << 4)
    k = tl.arange(0, BLOCK // 2)
    b = g[:, None] * (group_size // 2) + k[None, :]
    bmask = gmask[:, None] & (2 * k[None, :] < group_size) & (2 * b < n)
    tl.store(packed_ptr + b, byte, mask=bmask)
    tl.store(scale_ptr + g, scale, mask=gmask)
    tl.store(zero_ptr + g, zero, mask=gmask)


def _tile(group_size: int) -> tuple[int, int]:
    block = triton.next_power_of_2(group_size)
    return max(1, 1024 // block), block


def outlier_encode(
    x2: torch.Tensor,
    idx: torch.Tensor,
    group_size: int,
    noise: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `outlier_encode_ref`; with `seed` the noise is Philox's."""
    x2 = x2.contiguous()
    rows, C = x2.shape
    n = rows * C
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even integer >= 2, got {group_size!r}")
    G = triton.cdiv(n, group_size)
    dev = x2.device
    n_out = idx.numel()
    packed = torch.empty(packed_numel(n, 4), dtype=torch.uint8, device=dev)
    scale = torch.empty(G, dtype=torch.float32, device=dev)
    zero = torch.empty(G, dtype=torch.float32, device=dev)
    values = torch.zeros((rows, n_out), dtype=x2.dtype, device=dev)  # unused slots stay 0
    if n == 0:
        return packed, scale, zero, values
    pos = outlier_positions(idx, C)
    if noise is not None:
        mode, noise = 1, noise.reshape(-1).contiguous()
    elif seed is not None:
        mode = 2
    else:
        mode = 0
    dummy = scale
    groups, block = _tile(group_size)
    _encode_kernel[(triton.cdiv(G, groups),)](
        x2, pos, noise if noise is not None else dummy,
        seed if seed is not None else pos, packed, scale, zero, values,
        n, C, n_out, G, group_size, MODE=mode, GROUPS=groups, BLOCK=block, **EXACT_LAUNCH)
    return packed, scale, zero, values


@triton.jit
def _to_bf16_rne(f):
    """float32 -> bfloat16, round to nearest even, by integer ops (the interpreter's own
    cast truncates; on a GPU this equals the hardware cast). NaN stays NaN."""
    bits = f.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = tl.where(f != f, 0x7FC00000, bits)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, zero_ptr, pos_ptr, val_ptr, out_ptr,
                   n, C, n_out, G, group_size, OUT_BF16: tl.constexpr,
                   GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    g = pid.to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < G
    k = tl.arange(0, BLOCK // 2)
    b = g[:, None] * (group_size // 2) + k[None, :]
    bmask = gmask[:, None] & (2 * k[None, :] < group_size) & (2 * b < n)
    byte = tl.load(packed_ptr + b, mask=bmask, other=0)
    code = tl.interleave(byte & 15, byte >> 4).to(tl.int32)
    s = tl.load(scale_ptr + g, mask=gmask, other=0.0)
    z = tl.load(zero_ptr + g, mask=gmask, other=0.0)
    val = _values(code, s[:, None], z[:, None], 4, False)
    j = tl.arange(0, BLOCK)
    e = g[:, None] * group_size + j[None, :]
    m = gmask[:, None] & (j[None, :] < group_size) & (e < n)
    row, col = _row_col(g, group_size, C, BLOCK)
    slot = tl.load(pos_ptr + col, mask=m, other=-1)
    outl = m & (slot >= 0)
    exact = tl.load(val_ptr + row * n_out + slot, mask=outl, other=0.0)
    if OUT_BF16:
        val = _to_bf16_rne(val)
    res = tl.where(outl, exact, val.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + e, res, mask=m)


def outlier_decode(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    idx: torch.Tensor,
    values: torch.Tensor,
    group_size: int,
    rows: int,
    C: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Same contract as `outlier_decode_ref`: a [rows, C] tensor of `dtype`."""
    n = rows * C
    out = torch.empty((rows, C), dtype=dtype, device=packed.device)
    if n == 0:
        return out
    G = triton.cdiv(n, group_size)
    pos = outlier_positions(idx, C)
    values = values.to(dtype).contiguous()
    groups, block = _tile(group_size)
    _decode_kernel[(triton.cdiv(G, groups),)](
        packed, scale, zero, pos, values, out, n, C, idx.numel(), G, group_size,
        OUT_BF16=dtype == torch.bfloat16, GROUPS=groups, BLOCK=block, **EXACT_LAUNCH)
    return out
