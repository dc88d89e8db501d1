"""Outlier-separated INT4 (Adacc sec. 3.2) in Triton; the spec is `outlier_ref`.

- `outlier_encode`: one launch, one pass over x. A program owns one tile of
  `rows_per_chunk` rows by `channels_per_tile` channels (`outlier_ref.tile_layout`: 8 x 512
  at group_size 128), held in registers as [rows, groups, group elements]. It sums |x| per
  channel over its rows (float64), picks its tile's outlier slots by z-score (a few
  max/min reductions, `slots` of them), stores the slots' channels and exact values (bit
  patterns: integer sums of one term), takes the finite-inlier min/max of each group,
  quantizes with the noise (passed in, Philox bits from `random_triton.uniform8` keyed by
  the codec's seed and call count, or none: nearest), packs two codes per byte, and notes
  non-finite values in the side list (`nonfinite_triton`);
- `outlier_decode`: one launch over the same tiles: the tile's bytes loaded once as a
  vector and split into nibbles, each group's scale and zero once, each slot's channel
  and its column of values once; writes x's dtype as bit patterns.

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): scale, codes
and values come from `int_quant_triton`'s `stored_params` / `quant_codes` / `dequant_values` (divisions are
`tl.math.div_rn`), and launches pass `EXACT_LAUNCH` (no FMA contraction). The order-
dependent float results are the z-scores that pick outlier channels (compared without a
division, see `outlier_ref.select_tiles_ref`): the column sums are float64 sums of at most
`rows_per_chunk` float32 magnitudes (exact unless they span more than 2^25), and the
tile's sum and sum of squares float64 sums over at most 512 channels, so kernel and
reference could pick differently only for z-scores equal to within ~1e-15.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.int_quant_ref import noise_args
from llm_act.kernels.int_quant_triton import (ENCODE_WARPS, dequant_values, quant_codes, rounding_noise,
                                              stored_params)
from llm_act.kernels.nonfinite_ref import nonfinite_args
from llm_act.kernels.nonfinite_triton import keep_nonfinite
from llm_act.kernels.outlier_ref import index_dtype, record_layout


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of `dtype`'s width: values travel as bit patterns."""
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


#: output kinds of the decode kernel (how float32 values become the dtype's bits)
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


@triton.jit
def _tile_coords(C, TC, GS: tl.constexpr, GS_P: tl.constexpr, NG_P: tl.constexpr):
    """This program's tile: local channels [NG_P, GS_P] (group, element), global channels,
    and which of them exist (inside the group, the tile and C)."""
    g = tl.arange(0, NG_P)
    e = tl.arange(0, GS_P)
    lc = g[:, None] * GS + e[None, :]
    ch = tl.program_id(1) * TC + lc
    cval = (e[None, :] < GS) & (lc < TC) & (ch < C)
    return g, lc, ch, cval


@triton.jit
def _byte_coords(rmask, C, TC, GS: tl.constexpr, GS_P: tl.constexpr, NG_P: tl.constexpr):
    """Byte columns [NG_P, GS_P // 2] of the tile's rows and which bytes exist."""
    g = tl.arange(0, NG_P)
    k = tl.arange(0, GS_P // 2)
    c0 = tl.program_id(1) * TC + g * GS  # even: groups have an even size
    lc2 = g[:, None] * GS + 2 * k[None, :]
    bcol = (c0 >> 1)[:, None] + k[None, :]
    bval = (2 * k[None, :] < GS) & (lc2 < TC) & (c0[:, None] + 2 * k[None, :] < C)
    return bcol, rmask[:, None, None] & bval[None, :, :]


@triton.jit
def _encode_kernel(x_ptr, noise_ptr, seed, packed_ptr, scale_ptr, zero_ptr, val_ptr, index_ptr,
                   state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr,
                   rows, C, TC, RB, G, S, z_threshold, cap,
                   GS: tl.constexpr, GS_P: tl.constexpr, NG_P: tl.constexpr, CR: tl.constexpr,
                   K: tl.constexpr, NOISE: tl.constexpr, SIDE: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.program_id(1)
    r = chunk.to(tl.int64) * CR + tl.arange(0, CR)
    rmask = r < rows
    g, lc, ch, cval = _tile_coords(C, TC, GS, GS_P, NG_P)
    valid = rmask[:, None, None] & cval[None, :, :]
    offs = r[:, None, None] * C + ch[None, :, :]
    raw = tl.load(x_ptr + offs, mask=valid, other=0.0)
    x = raw.to(tl.float32)
    finite = valid & (tl.abs(x) < float("inf"))
    is_out = lc < 0  # none
    if K > 0:
        # z-scores of the tile's channels (`outlier_ref.select_tiles_ref`), float64 and
        # without a division: with d = n S - sum(S) and q = sum(d^2) over the n channels,
        # z = d / sqrt(q / n), so z > thr is d sqrt(n) > thr sqrt(q) and z orders as d
        colsum = tl.sum(tl.where(finite, tl.abs(x), 0.0).to(tl.float64), axis=0)
        n_c = tl.sum(tl.sum(cval.to(tl.int32), axis=1), axis=0).to(tl.float64)
        d = n_c * colsum - tl.sum(tl.sum(tl.where(cval, colsum, 0.0), axis=1), axis=0)
        q = tl.sum(tl.sum(tl.where(cval, d * d, 0.0), axis=1), axis=0)
        above = tl.where(q > 0, d * tl.sqrt(n_c) > z_threshold * tl.sqrt(q),
                         d * 0.0 > z_threshold)  # sd 0: z = 0
        key = tl.where(cval, d, float("-inf"))
        chosen = lc < 0
        for _ in range(K):  # the largest z first, the lowest channel among equals
            m = tl.max(tl.max(key, axis=1), axis=0)
            j = tl.min(tl.min(tl.where(key == m, lc, 1 << 30), axis=1), axis=0)
            hit = (lc == j) & cval  # padding lanes repeat local channels
            chosen = chosen | (hit & above)
            key = tl.where(hit, float("-inf"), key)
        is_out = chosen
    # IntQuant's asymmetric INT4 over each group's finite inliers
    inl = valid & ~is_out[None, :, :]
    use = inl & finite
    bad = inl & ~finite
    lo = tl.min(tl.where(use, x, float("inf")), axis=2)
    hi = tl.max(tl.where(use, x, float("-inf")), axis=2)
    has = tl.max(use.to(tl.int32), axis=2) > 0
    flag = tl.max(bad.to(tl.int32), axis=2) > 0
    lo = tl.where(has, lo, 0.0)
    hi = tl.where(has, hi, 0.0)
    scale, zero = stored_params(lo, hi, flag, 4, False)
    gcol = t * (TC // GS) + g
    gmask = rmask[:, None] & ((g * GS < TC) & (t * TC + g * GS < C))[None, :]
    poffs = r[:, None] * G + gcol[None, :]
    tl.store(scale_ptr + poffs, scale, mask=gmask)
    tl.store(zero_ptr + poffs, zero, mask=gmask)
    pid = chunk * tl.num_programs(1) + t
    u = rounding_noise(noise_ptr, seed, state_ptr, offs, valid, pid, CR, NG_P * GS_P, NOISE, SIDE)
    u = tl.reshape(u, (CR, NG_P, GS_P))
    code = quant_codes(x, finite, scale[:, :, None], zero[:, :, None], u, 4, False)
    code = tl.where(use | bad, code, 0)  # outliers and padding: 0
    lo_c, hi_c = tl.split(tl.reshape(code, (CR, NG_P, GS_P // 2, 2)))
    bcol, bmask = _byte_coords(rmask, C, TC, GS, GS_P, NG_P)
    tl.store(packed_ptr + r[:, None, None] * RB + bcol[None, :, :],
             (lo_c | (hi_c << 4)).to(tl.uint8), mask=bmask)
    if K > 0:  # (after the codes: fewer values live at once, no register spills)
        # slots in ascending channel order; exact values as bit patterns (one term sums)
        NP: tl.constexpr = NG_P * GS_P
        rank = tl.reshape(tl.cumsum(tl.reshape(is_out.to(tl.int32), (NP,)), axis=0),
                          (NG_P, GS_P)) - 1
        kept = tl.where(finite | ~valid, raw, float("nan")).to(val_ptr.dtype.element_ty,
                                                              bitcast=True)
        for k in range(K):
            idx_k = tl.min(tl.min(tl.where(is_out & (rank == k), ch, C), axis=1), axis=0)
            tl.store(index_ptr + chunk.to(tl.int64) * S + t * K + k,
                     idx_k.to(index_ptr.dtype.element_ty))
            pick = tl.where((ch == idx_k)[None, :, :], kept, 0)
            v = tl.sum(tl.sum(pick, axis=2), axis=1)
            tl.store(val_ptr + r * S + t * K + k, v.to(val_ptr.dtype.element_ty), mask=rmask)
    keep_nonfinite(raw, offs, valid, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap, SIDE)


def _launch_shape(rows, C, group_size, slots):
    lay = record_layout(rows, C, group_size, slots)
    gs_p = triton.next_power_of_2(group_size)
    ng_p = triton.next_power_of_2(triton.cdiv(lay["channels_per_tile"], group_size))
    return lay, dict(GS=group_size, GS_P=gs_p, NG_P=ng_p, CR=lay["rows_per_chunk"])


def outlier_encode(x2, group_size, z_threshold, slots, noise=None, seed=None, state=None,
                   nf_index=None, nf_value=None, nf_count=None):
    """Same contract as `outlier_encode_ref`, one launch; with `seed` the noise is Philox's."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even integer >= 2, got {group_size!r}")
    x2 = x2.contiguous()
    rows, C = x2.shape
    lay, const = _launch_shape(rows, C, group_size, slots)
    dev = x2.device
    S = lay["slots_per_row"]
    packed = torch.empty(rows, lay["row_bytes"], dtype=torch.uint8, device=dev)
    scale = torch.empty(rows, lay["groups"], dtype=torch.float32, device=dev)
    zero = torch.empty(rows, lay["groups"], dtype=torch.float32, device=dev)
    values = torch.empty(rows, S, dtype=x2.dtype, device=dev)
    index = torch.empty(lay["chunks"], S, dtype=index_dtype(C), device=dev)
    if rows * C == 0:
        return packed, scale, zero, values, index
    mode, noise_t, seed_i = noise_args(x2, noise, seed)
    side, *side_t = nonfinite_args(x2, state, nf_index, nf_value, nf_count)
    _encode_kernel[(lay["chunks"], lay["tiles"])](
        x2, noise_t, seed_i, packed, scale, zero, values.view(_bits_dtype(x2.dtype)), index,
        *side_t[:4], rows, C, lay["channels_per_tile"], lay["row_bytes"], lay["groups"], S,
        float(z_threshold), side_t[4], K=slots if S else 0, NOISE=mode, SIDE=side, **const,
        num_warps=ENCODE_WARPS, **EXACT_LAUNCH)
    return packed, scale, zero, values, index


@triton.jit
def _to_bits(val, KIND: tl.constexpr):
    """float32 values -> bit patterns of the output dtype (0 bfloat16, rounded to nearest
    even by integer ops: the interpreter's cast truncates; 1 float16; 2 float32; 3 float64)."""
    if KIND == 0:
        u = val.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # NaN (0x7FC00000) stays NaN
        bits = u.to(tl.uint16).to(tl.int16, bitcast=True)
    elif KIND == 1:
        bits = val.to(tl.float16).to(tl.int16, bitcast=True)
    elif KIND == 2:
        bits = val.to(tl.int32, bitcast=True)
    else:
        bits = val.to(tl.float64).to(tl.int64, bitcast=True)
    return bits


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, zero_ptr, val_ptr, index_ptr, out_ptr,
                   rows, C, TC, RB, G, S,
                   GS: tl.constexpr, GS_P: tl.constexpr, NG_P: tl.constexpr, CR: tl.constexpr,
                   K: tl.constexpr, KIND: tl.constexpr):
    chunk = tl.program_id(0)
    t = tl.program_id(1)
    r = chunk.to(tl.int64) * CR + tl.arange(0, CR)
    rmask = r < rows
    g, lc, ch, cval = _tile_coords(C, TC, GS, GS_P, NG_P)
    bcol, bmask = _byte_coords(rmask, C, TC, GS, GS_P, NG_P)
    byte = tl.load(packed_ptr + r[:, None, None] * RB + bcol[None, :, :], mask=bmask,
                   other=0).to(tl.int32)
    code = tl.interleave(byte & 15, byte >> 4)
    gcol = t * (TC // GS) + g
    gmask = rmask[:, None] & ((g * GS < TC) & (t * TC + g * GS < C))[None, :]
    poffs = r[:, None] * G + gcol[None, :]
    s = tl.load(scale_ptr + poffs, mask=gmask, other=0.0)
    z = tl.load(zero_ptr + poffs, mask=gmask, other=0.0)
    bits = _to_bits(dequant_values(code, s[:, :, None], z[:, :, None], 4, False), KIND)
    for k in range(K):  # each slot: its channel, then its column of exact values
        idx_k = tl.load(index_ptr + chunk.to(tl.int64) * S + t * K + k).to(tl.int32)
        v = tl.load(val_ptr + r * S + t * K + k, mask=rmask, other=0)
        bits = tl.where((ch == idx_k)[None, :, :], v[:, None, None], bits)
    valid = rmask[:, None, None] & cval[None, :, :]
    tl.store(out_ptr + r[:, None, None] * C + ch[None, :, :], bits, mask=valid)


def outlier_decode(packed, scale, zero, values, index, group_size, rows, C, dtype):
    """Same contract as `outlier_decode_ref`: a [rows, C] tensor of `dtype`, one launch."""
    out = torch.empty((rows, C), dtype=dtype, device=packed.device)
    if rows * C == 0:
        return out
    S = index.shape[1]
    lay, const = _launch_shape(rows, C, group_size, 0)
    slots = S // lay["tiles"]
    if values.dtype != dtype:  # (a codec's record holds x's dtype: no op)
        values = values.to(dtype)
    bits = _bits_dtype(dtype)
    _decode_kernel[(lay["chunks"], lay["tiles"])](
        packed, scale, zero, values.view(bits), index, out.view(bits), rows, C,
        lay["channels_per_tile"], lay["row_bytes"], lay["groups"], S, K=slots,
        KIND=_KIND[dtype], **const, **EXACT_LAUNCH)
    return out
