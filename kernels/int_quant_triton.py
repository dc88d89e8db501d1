"""Triton kernels for integer quantization; `int_quant_ref` is the specification.

Per-group encode is one fused pass: a program loads GPP whole groups as a [GPP, BLOCK_G]
tile, reduces min/max (or amax) and the non-finite flag per row, computes scale and zero,
rounds, packs 8 // bits codes per byte in registers and stores bytes and scales. Decode
tiles the output 2-D, [groups, elements of a group] (per group) or [rows, channels] (per
axis), so each element's parameter is its tile row (or column): no per-element division;
an element's byte and bit offset are a shift and a mask (8 // bits is a power of two).
Per-axis encode needs a column reduction over all rows before any code can be formed, so
it runs a stats kernel (partial min/max per row chunk), a tiny torch reduction over the
chunks (no host sync) and a quantize-and-pack kernel over [rows, channels] tiles (a flat
one, with a per-element `% C`, only when C is not a multiple of 8 // bits).

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
from llm_act.kernels.int_quant_ref import check_bits, num_groups, quant_params
from llm_act.kernels.packing_ref import packed_numel

_TILE = 4096  # elements per program
FMAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)  # float32 max
HALF_FMAX: tl.constexpr = tl.constexpr(1.7014117331926443e38)


@triton.jit
def clamp_finite(y, lim):
    """Clamp float32 `y` to +-`lim`, NaN kept; matches `int_quant_ref.clamp_finite`."""
    return tl.where(y > lim, lim, tl.where(y < -lim, -lim, y))


@triton.jit
def _params(lo, hi, bad, BITS: tl.constexpr, SYM: tl.constexpr):
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
def _codes(x, finite, scale, zero, u, BITS: tl.constexpr, SYM: tl.constexpr):
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
def _values(codes, scale, zero, BITS: tl.constexpr, SYM: tl.constexpr):
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
def _noise(noise_ptr, seed_ptr, idx, valid, NOISE: tl.constexpr):
    """0.5 (nearest), the passed-in noise, or tl.rand from the seed."""
    if NOISE == 1:
        u = tl.load(noise_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    elif NOISE == 2:
        seed = tl.load(seed_ptr)
        u = tl.rand(seed, idx.to(tl.int32))
    else:
        u = tl.full(idx.shape, 0.5, tl.float32)
    return u


@triton.jit
def _pack(codes, R: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """[R, COLS] int32 codes -> [R, COLS // PER] bytes (code j of a byte at bits j*BITS)."""
    PER: tl.constexpr = 8 // BITS
    c3 = tl.reshape(codes, (R, COLS // PER, PER))
    shifts = tl.arange(0, PER) * BITS
    return tl.sum(c3 << shifts[None, None, :], axis=2)


@triton.jit
def _encode_groups_kernel(x_ptr, noise_ptr, seed_ptr, out_ptr, scale_ptr, zero_ptr,
                          n, n_groups, n_bytes,
                          GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                          BITS: tl.constexpr, SYM: tl.constexpr, NOISE: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    g = pid * GPP + tl.arange(0, GPP)
    e = tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    idx = g.to(tl.int64)[:, None] * GS + e[None, :]
    valid = gmask[:, None] & (e[None, :] < GS) & (idx < n)
    x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    finite = valid & (tl.abs(x) < float("inf"))
    lo = tl.min(tl.where(finite, x, float("inf")), axis=1)
    hi = tl.max(tl.where(finite, x, float("-inf")), axis=1)
    some = tl.max(finite.to(tl.int32), axis=1) > 0
    bad = tl.max((valid & ~finite).to(tl.int32), axis=1) > 0
    lo = tl.where(some, lo, 0.0)
    hi = tl.where(some, hi, 0.0)
    scale, zero = _params(lo, hi, bad, BITS, SYM)
    tl.store(scale_ptr + g, scale, mask=gmask)
    if not SYM:
        tl.store(zero_ptr + g, zero, mask=gmask)
    u = _noise(noise_ptr, seed_ptr, idx, valid, NOISE)
    codes = _codes(x, finite, scale[:, None], zero[:, None], u, BITS, SYM)
    codes = tl.where(valid, codes, 0)
    packed = _pack(codes, GPP, BLOCK_G, BITS)
    j = tl.arange(0, BLOCK_G // PER)
    bidx = g.to(tl.int64)[:, None] * (GS // PER) + j[None, :]
    bmask = gmask[:, None] & (j[None, :] < GS // PER) & (bidx < n_bytes)
    tl.store(out_ptr + bidx, packed.to(tl.uint8), mask=bmask)


@triton.jit
def _axis_stats_kernel(x_ptr, lo_ptr, hi_ptr, bad_ptr, rows, C, rows_per_chunk,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Partial finite min/max and non-finite flag of each column over one chunk of rows."""
    pc = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    lo = tl.full((BLOCK_C,), float("inf"), tl.float32)
    hi = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    bad = tl.zeros((BLOCK_C,), tl.int32)
    r0 = chunk * rows_per_chunk
    for start in range(0, rows_per_chunk, BLOCK_R):
        r = r0 + start + tl.arange(0, BLOCK_R)
        valid = ((r < rows) & (r < r0 + rows_per_chunk))[:, None] & cmask[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + cols[None, :], mask=valid,
                    other=0.0).to(tl.float32)
        finite = valid & (tl.abs(x) < float("inf"))
        lo = tl.minimum(lo, tl.min(tl.where(finite, x, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(finite, x, float("-inf")), axis=0))
        bad = tl.maximum(bad, tl.max((valid & ~finite).to(tl.int32), axis=0))
    out = chunk.to(tl.int64) * C + cols
    tl.store(lo_ptr + out, lo, mask=cmask)
    tl.store(hi_ptr + out, hi, mask=cmask)
    tl.store(bad_ptr + out, bad, mask=cmask)


@triton.jit
def _quantize_flat_kernel(x_ptr, noise_ptr, seed_ptr, out_ptr, scale_ptr, zero_ptr, n, C,
                          BLOCK_B: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr,
                          NOISE: tl.constexpr):
    """Codes of x[rows, C] with one stored scale/zero per column, packed; flat layout (only
    where C is not a multiple of 8 // BITS, so a byte may straddle two rows)."""
    PER: tl.constexpr = 8 // BITS
    b = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    idx = b[:, None] * PER + tl.arange(0, PER)[None, :]
    valid = idx < n
    x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    finite = valid & (tl.abs(x) < float("inf"))
    col = idx % C
    scale = tl.load(scale_ptr + col, mask=valid, other=0.0)
    if SYM:
        zero = scale * 0.0
    else:
        zero = tl.load(zero_ptr + col, mask=valid, other=0.0)
    u = _noise(noise_ptr, seed_ptr, idx, valid, NOISE)
    codes = tl.where(valid, _codes(x, finite, scale, zero, u, BITS, SYM), 0)
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(codes << shifts[None, :], axis=1)
    tl.store(out_ptr + b, packed.to(tl.uint8), mask=b * PER < n)


@triton.jit
def _quantize_axis_kernel(x_ptr, noise_ptr, seed_ptr, out_ptr, scale_ptr, zero_ptr, rows, C,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                          SYM: tl.constexpr, NOISE: tl.constexpr):
    """Codes of a [BLOCK_R, BLOCK_C] tile of x[rows, C] (C a multiple of 8 // BITS, so no
    byte straddles two rows): column = parameter index, no per-element division."""
    PER: tl.constexpr = 8 // BITS
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    idx = r[:, None] * C + c[None, :]
    valid = (r < rows)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + idx, mask=valid, other=0.0).to(tl.float32)
    finite = valid & (tl.abs(x) < float("inf"))
    scale = tl.load(scale_ptr + c, mask=cmask, other=0.0)
    if SYM:
        zero = scale * 0.0
    else:
        zero = tl.load(zero_ptr + c, mask=cmask, other=0.0)
    u = _noise(noise_ptr, seed_ptr, idx, valid, NOISE)
    codes = tl.where(valid, _codes(x, finite, scale[None, :], zero[None, :], u, BITS, SYM), 0)
    packed = _pack(codes, BLOCK_R, BLOCK_C, BITS)
    j = tl.program_id(1) * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    RB = C // PER  # bytes per row (a scalar division per program)
    bmask = (r < rows)[:, None] & (j < RB)[None, :]
    tl.store(out_ptr + r[:, None] * RB + j[None, :], packed.to(tl.uint8), mask=bmask)


@triton.jit
def _code_at(packed_ptr, idx, valid, BITS: tl.constexpr, LOG_PER: tl.constexpr):
    """int32 code of element `idx` (int64): byte idx >> log2(8 // BITS), bits at
    (idx & (8 // BITS - 1)) * BITS (the `packing_ref` layout); shifts, no division."""
    byte = tl.load(packed_ptr + (idx >> LOG_PER), mask=valid, other=0).to(tl.int32)
    sh = ((idx & ((1 << LOG_PER) - 1)) * BITS).to(tl.int32)
    return (byte >> sh) & ((1 << BITS) - 1)


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
def _decode_groups_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, n, n_groups,
                          GS: tl.constexpr, BLOCK_G: tl.constexpr, GPP: tl.constexpr,
                          BITS: tl.constexpr, LOG_PER: tl.constexpr, SYM: tl.constexpr,
                          BF16_BITS: tl.constexpr):
    """A [GPP, BLOCK_G] tile of whole groups: row = group, so one parameter per row."""
    g = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    e = tl.arange(0, BLOCK_G)
    gmask = g < n_groups
    idx = g[:, None] * GS + e[None, :]
    valid = gmask[:, None] & (e[None, :] < GS) & (idx < n)
    codes = _code_at(packed_ptr, idx, valid, BITS, LOG_PER)
    scale, zero = _scale_zero(scale_ptr, zero_ptr, g, gmask, SYM)
    val = _values(codes, scale[:, None], zero[:, None], BITS, SYM)
    _store_values(out_ptr, idx, val, valid, BF16_BITS)


@triton.jit
def _decode_axis_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, rows, C,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                        LOG_PER: tl.constexpr, SYM: tl.constexpr, BF16_BITS: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] tile of x[rows, C]: column = parameter index."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    idx = r[:, None] * C + c[None, :]
    valid = (r < rows)[:, None] & cmask[None, :]
    codes = _code_at(packed_ptr, idx, valid, BITS, LOG_PER)
    scale, zero = _scale_zero(scale_ptr, zero_ptr, c, cmask, SYM)
    val = _values(codes, scale[None, :], zero[None, :], BITS, SYM)
    _store_values(out_ptr, idx, val, valid, BF16_BITS)


# ---- launchers (signatures of the reference functions, plus `seed`) ----------------------
def _noise_args(x, noise, seed):
    if noise is not None:
        return 1, noise.reshape(-1).contiguous(), x
    if seed is not None:
        if not torch.is_tensor(seed):
            seed = torch.tensor([int(seed)], dtype=torch.int64, device=x.device)
        return 2, x, seed
    return 0, x, x


def _check_group(bits, group_size):
    per = 8 // bits
    if group_size <= 0 or group_size % per:
        raise ValueError(
            f"group_size must be a positive multiple of {per} for {bits}-bit codes, "
            f"got {group_size}")


def int_quant_encode(x, bits, group_size, symmetric, noise=None, seed=None):
    """Per-group encode; see `int_quant_encode_ref`. `seed`: tl.rand stochastic rounding."""
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
    mode, noise_t, seed_t = _noise_args(x, noise, seed)
    block_g = triton.next_power_of_2(group_size)
    gpp = max(1, _TILE // block_g)
    _encode_groups_kernel[(triton.cdiv(G, gpp),)](
        x, noise_t, seed_t, out, scale, zero if not symmetric else scale, n, G, n_bytes,
        GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, SYM=symmetric, NOISE=mode,
        **EXACT_LAUNCH)
    return out, scale, zero


_LOG_PER = {1: 3, 2: 2, 4: 1, 8: 0}  # log2(8 // bits)


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
        packed, scale, zero if not symmetric else scale, out_arg, numel, G,
        GS=group_size, BLOCK_G=block_g, GPP=gpp, BITS=bits, LOG_PER=_LOG_PER[bits],
        SYM=symmetric, BF16_BITS=bf16, **EXACT_LAUNCH)
    return out


def int_quant_axis_decode(packed, scale, zero, bits, symmetric, numel, dtype):
    """Per-column decode; see `int_quant_axis_decode_ref`."""
    check_bits(bits, symmetric)
    out, out_arg, bf16 = _out(numel, dtype, packed.device)
    if numel == 0:
        return out
    C = scale.numel()
    if C == 0 or numel % C:
        raise ValueError(f"numel={numel} is not a whole number of rows of {C} channels")
    rows = numel // C
    block_c = min(128, triton.next_power_of_2(C))
    block_r = max(1, min(_TILE // block_c, triton.next_power_of_2(rows)))
    _decode_axis_kernel[(triton.cdiv(rows, block_r), triton.cdiv(C, block_c))](
        packed, scale, zero if not symmetric else scale, out_arg, rows, C,
        BLOCK_R=block_r, BLOCK_C=block_c, BITS=bits, LOG_PER=_LOG_PER[bits],
        SYM=symmetric, BF16_BITS=bf16, **EXACT_LAUNCH)
    return out


def int_quant_axis_encode(x, bits, symmetric, noise=None, seed=None):
    """Per-column encode of x [rows, C]; see `int_quant_axis_encode_ref`."""
    check_bits(bits, symmetric)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, C], got shape {tuple(x.shape)}")
    x = x.contiguous()
    rows, C = x.shape
    n = x.numel()
    dev = x.device
    out = torch.empty(packed_numel(n, bits), dtype=torch.uint8, device=dev)
    if n == 0:
        zeros = torch.zeros(C, dtype=torch.float32, device=dev)
        return out, zeros, (zeros.new_empty(0) if symmetric else zeros.clone())
    block_c = min(64, triton.next_power_of_2(C))
    block_r = max(1, min(_TILE // block_c, triton.next_power_of_2(rows)))
    chunks = min(triton.cdiv(rows, block_r), 64)
    rows_per_chunk = triton.cdiv(triton.cdiv(rows, chunks), block_r) * block_r
    chunks = triton.cdiv(rows, rows_per_chunk)
    lo = torch.empty(chunks, C, dtype=torch.float32, device=dev)
    hi = torch.empty_like(lo)
    bad = torch.empty(chunks, C, dtype=torch.int32, device=dev)
    _axis_stats_kernel[(triton.cdiv(C, block_c), chunks)](
        x, lo, hi, bad, rows, C, rows_per_chunk, BLOCK_R=block_r, BLOCK_C=block_c,
        **EXACT_LAUNCH)
    lo, hi, bad = lo.amin(0), hi.amax(0), bad.amax(0) > 0
    none = lo > hi  # no finite value in the column
    lo = torch.where(none, 0.0, lo)
    hi = torch.where(none, 0.0, hi)
    # the parameters come from the reference's own function (torch's `/` is correctly
    # rounded on every device)
    scale, zero = quant_params(lo, hi, torch.maximum(lo.abs(), hi.abs()), bad, bits, symmetric)
    mode, noise_t, seed_t = _noise_args(x, noise, seed)
    if C % (8 // bits) == 0:  # whole bytes per row: 2-D tiles, the column is the parameter
        block_c = min(128, triton.next_power_of_2(C))
        block_r = max(1, min(_TILE // block_c, triton.next_power_of_2(rows)))
        _quantize_axis_kernel[(triton.cdiv(rows, block_r), triton.cdiv(C, block_c))](
            x, noise_t, seed_t, out, scale, zero if not symmetric else scale, rows, C,
            BLOCK_R=block_r, BLOCK_C=block_c, BITS=bits, SYM=symmetric, NOISE=mode,
            **EXACT_LAUNCH)
        return out, scale, zero
    block_b = _TILE // (8 // bits)
    _quantize_flat_kernel[(triton.cdiv(out.numel(), block_b),)](
        x, noise_t, seed_t, out, scale, zero if not symmetric else scale, n, C,
        BLOCK_B=block_b, BITS=bits, SYM=symmetric, NOISE=mode, **EXACT_LAUNCH)
    return out, scale, zero
