"""Triton kernels for integer quantization; `int_quant_ref` is the specification.

Per-group encode is one fused pass: a program loads GPP whole groups as a [GPP, BLOCK_G]
tile, reduces min/max (or amax) and the non-finite flag per row, computes scale and zero,
rounds, packs 8 // bits codes per byte in registers and stores bytes and scales. Per-axis
encode is one pass too: its scales are per column and chunk of `AXIS_CHUNK` rows, and a
program holds one chunk's rows for BLOCK_C columns ([256, 16] for 4096 elements), so the
column statistics are a register reduction, and x is read once (whole-column statistics
would need a second read of x). Decode tiles the output 2-D, [groups, elements of a group]
(per group) or [rows, channels] (per axis), so each element's parameter is its tile row (or
column): no per-element division. Per-group decode finds an element's byte and bit offset
with a shift and a mask (8 // bits is a power of two); per-axis decode loads its tile's
bytes once, as a vector, and splits them with shifts (rows are padded to whole bytes).

Stochastic rounding takes either `noise` (u ~ U[0,1), one per element, as in the
reference) or `seed` (a 1-element int64 tensor on the device: `tl.rand(seed, index)`,
which avoids writing and reading a noise tensor but cannot match torch's stream).

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): divisions are
`tl.math.div_rn` with the reference's operands and order (a GPU's `/` is approximate);
launches pass `EXACT_LAUNCH` (no FMA contraction: `c * |scale| + 0.5 * zero` rounds twice,
as in torch); float reductions are min/max only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.int_quant_ref import (AXIS_CHUNK, axis_chunks, axis_row_bytes, check_bits,
                                           noise_args, num_groups)
from llm_act.kernels.nonfinite_ref import nonfinite_args
from llm_act.kernels.nonfinite_triton import keep_nonfinite, stream_seed
from llm_act.kernels.packing_ref import packed_numel
from llm_act.kernels.random_triton import uniform8

_TILE = 4096  # elements per program
FMAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # float32 max
HALF_FMAX: tl.constexpr = tl.constexpr(1.7014117331926443e38)


@triton.jit
def clamp_finite(y, lim):
    """Clamp float32 `y` to +-`lim`, NaN kept; matches `int_quant_ref.clamp_finite`."""
    return tl.where(y > lim, lim, tl.where(y < -lim, -lim, y))


@triton.jit
def stored_params(lo, hi, bad, BITS: tl.constexpr, SYM: tl.constexpr):
    """Stored (scale, zero) from finite min/max and the flag; matches `quant_params`."""
    if SYM:
        amax = tl.maximum(tl.abs(lo), tl.abs(hi))
        scale = tl.math.div_rn(amax, 2 ** (BITS - 1) - 1.0)
        zero = scale * 0.0
    else:
        full = 2**BITS - 1.0
        bins = tl.where(bad, full - 1.0, full)
        half_rng = 0.5 * hi - 0.5 * lo
        scale = tl.where(bins > 0, tl.math.div_rn(half_rng, tl.maximum(bins, 1.0)), 0.0)
        zero = tl.where(bins > 0, lo, 2.0 * (0.5 * lo + 0.5 * half_rng))
        scale = tl.where(bad, -scale, scale)
    return scale, zero


@triton.jit
def quant_codes(x, finite, scale, zero, u, BITS: tl.constexpr, SYM: tl.constexpr):
    """int32 codes of float32 x given broadcast stored scale/zero; matches `quantize`."""
    mag = tl.abs(scale)
    safe = tl.where(mag > 0, mag, 1.0)
    if SYM:
        top = 2 ** (BITS - 1) - 1.0
        v = tl.where(mag > 0, tl.math.div_rn(x, safe), 0.0)
        q = tl.floor(v + u)
        q = tl.minimum(tl.maximum(q, -top), top) + 2 ** (BITS - 1)
        q = tl.where(finite, q, 0.0)
    else:
        flagged = scale.to(tl.int32, bitcast=True) < 0
        hi_code = tl.where(flagged, 2**BITS - 2.0, 2**BITS - 1.0)
        v = tl.where(mag > 0, tl.math.div_rn(0.5 * x - 0.5 * zero, safe), 0.0)
        q = tl.floor(v + u)
        q = tl.minimum(tl.maximum(q, 0.0), hi_code)
        q = tl.where(finite, q, 2**BITS - 1.0)
    return q.to(tl.int32)


@triton.jit
def dequant_values(codes, scale, zero, BITS: tl.constexpr, SYM: tl.constexpr):
    """float32 values of int32 codes given broadcast stored scale/zero; matches `dequantize`."""
    c = codes.to(tl.float32)
    if SYM:
        val = clamp_finite((c - 2 ** (BITS - 1)) * scale, FMAX)
        val = tl.where(codes == 0, float("nan"), val)
    else:
        flagged = scale.to(tl.int32, bitcast=True) < 0
        val = 2.0 * clamp_finite(c * tl.abs(scale) + 0.5 * zero, HALF_FMAX)
        val = tl.where(flagged & (codes == 2**BITS - 1), float("nan"), val)
    return val


@triton.jit
def rounding_noise(noise_ptr, seed, state_ptr, idx, valid, pid, R: tl.constexpr, C: tl.constexpr,
           NOISE: tl.constexpr, SIDE: tl.constexpr):
    """0.5 (nearest), the passed-in noise, or 8 random bits per element from Philox keyed
    by `seed` (and the codec's call count when a state is passed)."""
    if NOISE == 1:
        u = tl.load(noise_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    elif NOISE == 2:
        if SIDE:
            seed = stream_seed(state_ptr, seed)
        u = uniform8(seed, pid, R, C)
    else:
        u = tl.full(idx.shape, 0.5, tl.float32)
    return u


@triton.jit
def _finite_range(x, valid, AXIS: tl.constexpr):
    """The finite mask and, per row (AXIS 1) or column (AXIS 0), the finite min and max (0
    where none is finite) and whether any element is not finite: what `stored_params` takes."""
    finite = valid & (tl.abs(x) < float("inf"))
    lo = tl.min(tl.where(finite, x, float("inf")), axis=AXIS)
    hi = tl.max(tl.where(finite, x, float("-inf")), axis=AXIS)
    some = tl.max(finite.to(tl.int32), axis=AXIS) > 0
    bad = tl.max((valid & ~finite).to(tl.int32), axis=AXIS) > 0
    return finite, tl.where(some, lo, 0.0), tl.where(some, hi, 0.0), bad


@triton.jit
def _pack(codes, R: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """[R, COLS] int32 codes -> [R, COLS // PER] bytes (code j of a byte at bits j*BITS)."""
    PER: tl.constexpr = 8 // BITS
    c3 = tl.reshape(codes, (R, COLS // PER, PER))
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(c3 << shifts[None, None, :], axis=2)


@triton.jit
def _encode_groups_kernel(x_ptr, noise_ptr, seed, out_ptr, scale_ptr, zero_ptr,
                          state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr,
                          n, n_groups, n_bytes, cap,
                          GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                          BITS: tl.constexpr, SYM: tl.constexpr, NOISE: tl.constexpr,
                          SIDE: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    g = pid * GPP + tl.arange(0, GPP)
    e = tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    idx = g.to(tl.int64)[:, None] * GS + e[None, :]
    valid = gmask[:, None] & (e[None, :] < GS) & (idx < n)
    raw = tl.load(x_ptr + idx, mask=valid, other=0.0)
    x = raw.to(tl.float32)
    finite, lo, hi, bad = _finite_range(x, valid, 1)
    scale, zero = stored_params(lo, hi, bad, BITS, SYM)
    tl.store(scale_ptr + g, scale, mask=gmask)
    if not SYM:
        tl.store(zero_ptr + g, zero, mask=gmask)
    u = rounding_noise(noise_ptr, seed, state_ptr, idx, valid, pid, GPP, BLOCK_G, NOISE, SIDE)
    codes = quant_codes(x, finite, scale[:, None], zero[:, None], u, BITS, SYM)
    codes = tl.where(valid, codes, 0)
    packed = _pack(codes, GPP, BLOCK_G, BITS)
    j = tl.arange(0, BLOCK_G // PER)
    bidx = g.to(tl.int64)[:, None] * (GS // PER) + j[None, :]
    bmask = gmask[:, None] & (j[None, :] < GS // PER) & (bidx < n_bytes)
    tl.store(out_ptr + bidx, packed.to(tl.uint8), mask=bmask)
    keep_nonfinite(raw, idx, valid, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap, SIDE)


@triton.jit
def _encode_axis_kernel(x_ptr, noise_ptr, seed, out_ptr, scale_ptr, zero_ptr,
                        state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, rows, C,
                        stride_r, RB, cap,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                        SYM: tl.constexpr, NOISE: tl.constexpr, SIDE: tl.constexpr):
    """One pass over a [BLOCK_R, BLOCK_C] tile of x[rows, C] that is one row chunk
    (`int_quant_ref.AXIS_CHUNK` rows, or all rows when fewer): the chunk's per-column
    finite min/max and flag, scale and zero, codes, and the packed row bytes. Rows are
    `stride_r` elements apart, so a view such as `attn.v` (every third slice of the QKV
    buffer) is read in place; positions (`idx`) stay those of the logical [rows, C]."""
    PER: tl.constexpr = 8 // BITS
    pid_r = tl.program_id(0)
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    idx = r[:, None] * C + c[None, :]
    valid = (r < rows)[:, None] & cmask[None, :]
    raw = tl.load(x_ptr + r[:, None] * stride_r + c[None, :], mask=valid, other=0.0)
    x = raw.to(tl.float32)
    finite, lo, hi, bad = _finite_range(x, valid, 0)
    scale, zero = stored_params(lo, hi, bad, BITS, SYM)
    poffs = pid_r.to(tl.int64) * C + c
    tl.store(scale_ptr + poffs, scale, mask=cmask)
    if not SYM:
        tl.store(zero_ptr + poffs, zero, mask=cmask)
    pid = pid_r * tl.num_programs(1) + tl.program_id(1)
    u = rounding_noise(noise_ptr, seed, state_ptr, idx, valid, pid, BLOCK_R, BLOCK_C, NOISE, SIDE)
    codes = tl.where(valid, quant_codes(x, finite, scale[None, :], zero[None, :], u, BITS, SYM), 0)
    packed = _pack(codes, BLOCK_R, BLOCK_C, BITS)
    j = tl.program_id(1) * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    bmask = (r < rows)[:, None] & (j < RB)[None, :]
    tl.store(out_ptr + r[:, None] * RB + j[None, :], packed.to(tl.uint8), mask=bmask)
    keep_nonfinite(raw, idx, valid, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap, SIDE)


@triton.jit
def _store_values(out_ptr, idx, val, valid, BF16_BITS: tl.constexpr):
    if BF16_BITS:  # round to nearest even by hand: the interpreter's cast truncates
        u = val.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(out_ptr + idx, u.to(tl.uint16).to(tl.int16, bitcast=True), mask=valid)
    else:
        tl.store(out_ptr + idx, val.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _scale_zero(scale_ptr, zero_ptr, offs, mask, SYM: tl.constexpr):
    """The scale and zero point of the groups (or channels) at `offs`; zero 0 if symmetric."""
    scale = tl.load(scale_ptr + offs, mask=mask, other=0.0)
    if SYM:
        zero = scale * 0.0
    else:
        zero = tl.load(zero_ptr + offs, mask=mask, other=0.0)
    return scale, zero


@triton.jit
def _decode_groups_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, n, n_groups, n_bytes,
                          GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                          BITS: tl.constexpr, SYM: tl.constexpr, BF16_BITS: tl.constexpr):
    """A [GPP, BLOCK_G] tile of whole groups: row = group, so one parameter per row; the
    group's bytes are loaded once, as a vector, and split by shifts (`_unpack`)."""
    g = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    e = tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    idx = g[:, None] * GS + e[None, :]
    valid = gmask[:, None] & (e[None, :] < GS) & (idx < n)
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, BLOCK_G // PER)
    bidx = g[:, None] * (GS // PER) + j[None, :]
    bmask = gmask[:, None] & (j[None, :] < GS // PER) & (bidx < n_bytes)
    codes = _unpack(tl.load(packed_ptr + bidx, mask=bmask, other=0), GPP, BLOCK_G, BITS)
    scale, zero = _scale_zero(scale_ptr, zero_ptr, g, gmask, SYM)
    val = dequant_values(codes, scale[:, None], zero[:, None], BITS, SYM)
    _store_values(out_ptr, idx, val, valid, BF16_BITS)


@triton.jit
def _unpack(packed, R: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """[R, COLS // PER] bytes -> [R, COLS] int32 codes (the inverse of `_pack`): each byte
    is loaded once, as a vector, and split by shifts."""
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    c3 = (packed.to(tl.int32)[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(c3, (R, COLS))


@triton.jit
def _decode_axis_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, rows, C, RB,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                        SYM: tl.constexpr, BF16_BITS: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] tile of x[rows, C] within one row chunk: the chunk's
    parameters once per column, the row bytes loaded as a vector and unpacked."""
    PER: tl.constexpr = 8 // BITS
    pid_r = tl.program_id(0)
    r = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    j = tl.program_id(1) * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    bmask = (r < rows)[:, None] & (j < RB)[None, :]
    packed = tl.load(packed_ptr + r[:, None] * RB + j[None, :], mask=bmask, other=0)
    codes = _unpack(packed, BLOCK_R, BLOCK_C, BITS)
    scale, zero = _scale_zero(scale_ptr, zero_ptr, pid_r.to(tl.int64) * C + c, cmask, SYM)
    val = dequant_values(codes, scale[None, :], zero[None, :], BITS, SYM)
    valid = (r < rows)[:, None] & cmask[None, :]
    _store_values(out_ptr, r[:, None] * C + c[None, :], val, valid, BF16_BITS)


# ---- launchers (signatures of the reference functions) -----------------------------------
def _check_group(bits, group_size):
    per = 8 // bits
    if group_size <= 0 or group_size % per:
        raise ValueError(
            f"group_size must be a positive multiple of {per} for {bits}-bit codes, "
            f"got {group_size}")


def int_quant_encode(x, bits, group_size, symmetric, noise=None, seed=None, state=None,
                     nf_index=None, nf_value=None, nf_count=None):
    """Per-group encode; see `int_quant_encode_ref`. `seed`: Philox stochastic rounding."""
    check_bits(bits, symmetric)
    _check_group(bits, group_size)
    x = x.reshape(-1).contiguous()
    n = x.numel()
    G = num_groups(n, group_size)
    n_bytes = packed_numel(n, bits)
    out = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(G, dtype=torch.float32, device=x.device)
    zero = torch.empty(0 if symmetric else G, dtype=torch.float32, device=x.device)
    if n == 0:
        return out, scale, zero
    mode, noise_t, seed_i = noise_args(x, noise, seed)
    side, *side_t = nonfinite_args(x, state, nf_index, nf_value, nf_count)
    block_g = triton.next_power_of_2(group_size)
    gpp = max(1, _TILE // block_g)
    _encode_groups_kernel[(triton.cdiv(G, gpp),)](
        x, noise_t, seed_i, out, scale, zero if not symmetric else scale, *side_t[:4], n, G, n_bytes, side_t[4],
        GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, SYM=symmetric, NOISE=mode,
        SIDE=side, **EXACT_LAUNCH)
    return out, scale, zero




def _out(numel, dtype, device):
    out = torch.empty(numel, dtype=dtype, device=device)
    bf16 = dtype == torch.bfloat16
    return out, (out.view(torch.int16) if bf16 else out), bf16


def int_quant_decode(packed, scale, zero, bits, group_size, symmetric, numel, dtype):
    """Per-group decode; see `int_quant_decode_ref`."""
    check_bits(bits, symmetric)
    out, out_arg, bf16 = _out(numel, dtype, packed.device)
    if numel == 0:
        return out
    G = num_groups(numel, group_size)
    block_g = triton.next_power_of_2(group_size)
    gpp = max(1, _TILE // block_g)
    _decode_groups_kernel[(triton.cdiv(G, gpp),)](
        packed, scale, zero if not symmetric else scale, out_arg, numel, G, packed.numel(),
        GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, SYM=symmetric, BF16_BITS=bf16,
        **EXACT_LAUNCH)
    return out


#: warps of the one-pass per-axis encode (and outlier / dual encode): a 4096-element tile
#: with its statistics and codes needs about 250 registers a thread with 4 warps, 120 with 8
#: (ptxas for sm_90, tests/kernels/test_sm90_compile.py), so twice the warps fit on an SM
ENCODE_WARPS = 8


def _axis_tile(rows, C, bits):
    """(BLOCK_R, BLOCK_C) of the per-axis kernels: a tile's rows are one row chunk (all rows
    when there are fewer), its columns fill about _TILE elements (at least 16: whole bytes,
    and 16 elements per Philox call)."""
    block_r = min(AXIS_CHUNK, triton.next_power_of_2(rows))
    block_c = max(16, min(_TILE // block_r, triton.next_power_of_2(C)))
    return block_r, block_c


def int_quant_axis_encode(x, bits, symmetric, noise=None, seed=None, state=None,
                          nf_index=None, nf_value=None, nf_count=None):
    """Per-column encode of x [rows, C], scales per chunk of AXIS_CHUNK rows, in one pass
    (one launch); see `int_quant_axis_encode_ref`. Rows may be strided (no copy)."""
    check_bits(bits, symmetric)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, C], got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, C = x.shape
    dev = x.device
    rb = axis_row_bytes(C, bits)
    K = axis_chunks(rows)
    out = torch.empty(rows * rb, dtype=torch.uint8, device=dev)
    scale = torch.empty(K, C, dtype=torch.float32, device=dev)
    zero = torch.empty(0 if symmetric else K, C, dtype=torch.float32, device=dev)
    if x.numel() == 0:
        return out, scale, zero
    mode, noise_t, seed_i = noise_args(x, noise, seed)
    side, *side_t = nonfinite_args(x, state, nf_index, nf_value, nf_count)
    block_r, block_c = _axis_tile(rows, C, bits)
    _encode_axis_kernel[(K, triton.cdiv(C, block_c))](
        x, noise_t, seed_i, out, scale, zero if not symmetric else scale, *side_t[:4],
        rows, C, x.stride(0), rb, side_t[4], BLOCK_R=block_r, BLOCK_C=block_c, BITS=bits,
        SYM=symmetric, NOISE=mode, SIDE=side, num_warps=ENCODE_WARPS, **EXACT_LAUNCH)
    return out, scale, zero


def int_quant_axis_decode(packed, scale, zero, bits, symmetric, numel, dtype):
    """Per-column decode (scales per row chunk); see `int_quant_axis_decode_ref`."""
    check_bits(bits, symmetric)
    out, out_arg, bf16 = _out(numel, dtype, packed.device)
    if numel == 0:
        return out
    C = scale.shape[-1]
    if C == 0 or numel % C:
        raise ValueError(f"numel={numel} is not a whole number of rows of {C} channels")
    rows = numel // C
    block_r, block_c = _axis_tile(rows, C, bits)
    _decode_axis_kernel[(axis_chunks(rows), triton.cdiv(C, block_c))](
        packed, scale, zero if not symmetric else scale, out_arg, rows, C,
        axis_row_bytes(C, bits), BLOCK_R=block_r, BLOCK_C=block_c, BITS=bits,
        SYM=symmetric, BF16_BITS=bf16, **EXACT_LAUNCH)
    return out
