"""Integer quantization of activations, pure torch: the specification the Triton kernels match.

ActNN sec. 4.1's quantizer with one scale (and zero point) per group of `group_size`
consecutive elements of the flattened tensor (the last group padded), or per slice along
one axis (`*_axis_*`: x viewed as [rows, C], statistics of column c over each chunk of
`AXIS_CHUNK` = 256 rows, so that the kernel reads x once: see `int_quant_axis_encode_ref`).

- asymmetric: zero = min, scale = (max - min) / (2^b - 1) (stored halved, see below),
  codes in [0, 2^b - 1];
- symmetric: scale = amax / (2^(b-1) - 1), q in [-(2^(b-1) - 1), 2^(b-1) - 1], stored as
  q + 2^(b-1), so stored code 0 is never used by a finite value.

Rounding: nearest is floor(v + 0.5) (ties go up, the same in the kernels); stochastic is
floor(v + u) with u ~ U[0, 1) passed in as `noise`, which is unbiased.

Finite in, finite out: a range max - min can exceed the float32 maximum, so the asymmetric
path works on x / 2 (exact for normal numbers, so results are unchanged wherever nothing
overflows): the stored scale is the step of x / 2, (max/2 - min/2) / (2^b - 1), and decode
is 2 (code * scale + zero / 2), clamped to +-float32 max like the symmetric decode (the
clamp comes before the doubling, so no Inf is ever formed).

Non-finite inputs decode to NaN without a host sync: symmetric groups store them as the
spare code 0; an asymmetric group that holds one is flagged by the sign bit of its stored
scale, its finite values use 2^b - 1 levels and the top code means "non-finite" (with one
bit, its finite values all decode to the middle of their range). Statistics are taken over
finite values only. Codes are packed with `packing_ref` (8 // bits codes per byte).

Every division is tensor by tensor: torch computes it correctly rounded on CPU and CUDA
alike, as the kernels' `tl.math.div_rn` does (torch's CUDA division by a Python scalar
multiplies by the reciprocal instead, so no divisor here is a Python number).
"""
from __future__ import annotations

import torch

from llm_act.kernels.nonfinite_ref import record_side_list
from llm_act.kernels.packing_ref import pack_bits, unpack_bits

INT_BITS = (1, 2, 4, 8)
FMAX = torch.finfo(torch.float32).max


def clamp_finite(y: torch.Tensor, lim: float = FMAX) -> torch.Tensor:
    """Clamp float32 `y` to +-`lim` (float32 max), NaN kept: a decoded value may round one
    ulp past the largest finite input."""
    return torch.where(y > lim, lim, torch.where(y < -lim, -lim, y))


def check_bits(bits: int, symmetric: bool) -> None:
    if bits not in INT_BITS:
        raise ValueError(f"bits must be one of {INT_BITS}, got {bits!r}")
    if symmetric and bits < 2:
        raise ValueError(f"symmetric quantization needs bits >= 2, got bits={bits}")


def num_groups(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


# ---- shared pieces (per-parameter statistics -> scale/zero; codes <-> values) -------------
def quant_params(lo, hi, amax, bad, bits: int, symmetric: bool):
    """Stored (scale, zero) from finite min/max/amax and the has-non-finite flag, float32.

    Asymmetric: the scale of x / 2 (see the module doc); flagged groups store -scale
    (sign bit set, also for a zero scale).
    """
    if symmetric:
        # divide by a tensor, not a Python number: torch's CUDA `/` by a scalar multiplies
        # by its reciprocal (not correctly rounded; the kernels use div_rn)
        scale = amax / torch.full_like(amax, float(2 ** (bits - 1) - 1))
        return scale, torch.empty(0, dtype=torch.float32, device=scale.device)
    full = float(2**bits - 1)
    bins = torch.where(bad, full - 1.0, full)
    half_rng = 0.5 * hi - 0.5 * lo
    scale = torch.where(bins > 0, half_rng / bins.clamp_min(1.0), torch.zeros_like(half_rng))
    zero = torch.where(bins > 0, lo, 2.0 * (0.5 * lo + 0.5 * half_rng))
    return torch.where(bad, -scale, scale), zero


def quantize(xf, scale, zero, bits: int, symmetric: bool, noise=None) -> torch.Tensor:
    """Codes (uint8) of float32 `xf` given per-element stored scale/zero (broadcast)."""
    finite = torch.isfinite(xf)
    mag = scale.abs()
    if symmetric:
        top = float(2 ** (bits - 1) - 1)
        v = torch.where(mag > 0, xf / torch.where(mag > 0, mag, 1.0), torch.zeros_like(xf))
        lo_code, hi_code, bad_code = -top, top, 0.0
    else:
        flagged = torch.signbit(scale)
        hi_code = torch.where(flagged, float(2**bits - 2), float(2**bits - 1))
        lo_code, bad_code = 0.0, float(2**bits - 1)
        v = torch.where(mag > 0, (0.5 * xf - 0.5 * zero) / torch.where(mag > 0, mag, 1.0),
                        torch.zeros_like(xf))
    q = torch.floor(v + (0.5 if noise is None else noise))
    q = q.clamp_min(lo_code)
    q = q.clamp_max(hi_code) if symmetric else torch.minimum(q, hi_code)
    if symmetric:
        q = q + float(2 ** (bits - 1))
    return torch.where(finite, q, bad_code).to(torch.uint8)


def dequantize(codes, scale, zero, bits: int, symmetric: bool) -> torch.Tensor:
    """float32 values of uint8 `codes` given per-element stored scale/zero (broadcast)."""
    c = codes.to(torch.float32)
    if symmetric:
        val = clamp_finite((c - float(2 ** (bits - 1))) * scale)
        return torch.where(codes == 0, float("nan"), val)
    flagged = torch.signbit(scale)
    val = 2.0 * clamp_finite(c * scale.abs() + 0.5 * zero, 0.5 * FMAX)  # no Inf on the way
    return torch.where(flagged & (codes == 2**bits - 1), float("nan"), val)


def finite_stats(xf: torch.Tensor, valid: torch.Tensor, dim: int):
    """Finite min, max, amax and has-non-finite flag along `dim` (0 for empty reductions)."""
    if xf.shape[dim] == 0:
        zeros = xf.new_zeros(xf.shape[1 - dim])
        return zeros, zeros, zeros, zeros.bool()
    finite = torch.isfinite(xf) & valid
    bad = (valid & ~finite).any(dim)
    lo = torch.where(finite, xf, float("inf")).amin(dim)
    hi = torch.where(finite, xf, float("-inf")).amax(dim)
    none = ~finite.any(dim)
    lo = torch.where(none, 0.0, lo)
    hi = torch.where(none, 0.0, hi)
    amax = torch.maximum(lo.abs(), hi.abs())
    return lo, hi, amax, bad


def seeded_noise(seed: int | None, n: int, device) -> torch.Tensor | None:
    """U[0, 1) float32 [n] from a private generator seeded with `seed` (an int), or None
    without a seed: the references' stand-in for the kernels' Philox bits (same
    distribution, another stream, and no call count: codecs pass `noise` to the
    references; torch's global generator is never touched)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device).manual_seed(int(seed))
    return torch.rand(n, generator=gen, device=device)


# ---- per group ----------------------------------------------------------------------------
def int_quant_encode_ref(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool,
    noise: torch.Tensor | None = None, seed: int | None = None,
    state: torch.Tensor | None = None, nf_index: torch.Tensor | None = None,
    nf_value: torch.Tensor | None = None, nf_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [ceil(n*bits/8)], scale float32 [G], zero float32 [G] or empty).

    `noise` (u per element) or else `seed` (`seeded_noise`) rounds stochastically; neither:
    nearest. With `state`, x's non-finite values go to the side-list buffers `nf_*`
    (`nonfinite_ref`; the kernels find them in their one pass).
    """
    check_bits(bits, symmetric)
    record_side_list(x, state, nf_index, nf_value, nf_count)
    xf = x.reshape(-1).to(torch.float32)
    n = xf.numel()
    if noise is None:
        noise = seeded_noise(seed, n, x.device)
    G = num_groups(n, group_size)
    pad = G * group_size - n
    xp = torch.cat([xf, xf.new_zeros(pad)]).view(G, group_size)
    valid = (torch.arange(G * group_size, device=x.device) < n).view(G, group_size)
    lo, hi, amax, bad = finite_stats(xp, valid, 1)
    scale, zero = quant_params(lo, hi, amax, bad, bits, symmetric)
    if noise is not None:
        noise = torch.cat([noise.reshape(-1).to(torch.float32), xf.new_zeros(pad)])
        noise = noise.view(G, group_size)
    z = zero[:, None] if zero.numel() else zero
    codes = quantize(xp, scale[:, None], z, bits, symmetric, noise)
    return pack_bits(codes.reshape(-1)[:n], bits), scale, zero


def int_quant_decode_ref(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
    symmetric: bool, numel: int, dtype: torch.dtype,
) -> torch.Tensor:
    """1-D tensor of `dtype` with `numel` values."""
    codes = unpack_bits(packed, bits, numel).to(torch.int64)
    gid = torch.arange(numel, device=packed.device) // group_size
    z = zero[gid] if zero.numel() else zero
    return dequantize(codes, scale[gid], z, bits, symmetric).to(dtype)


# ---- per slice along an axis (x viewed as [rows, C]) --------------------------------------
#: rows per chunk of the per-axis layout: each chunk of AXIS_CHUNK consecutive rows has its
#: own scale (and zero) per column, so that one program holding [AXIS_CHUNK rows, a few
#: columns] encodes in one pass (statistics of the whole column would need a second read)
AXIS_CHUNK = 256


def axis_chunks(rows: int) -> int:
    """Row chunks of the per-axis layout (scales per chunk and column)."""
    return -(-rows // AXIS_CHUNK)


def axis_row_bytes(C: int, bits: int) -> int:
    """Bytes of one row's codes: rows are padded to whole bytes (no byte spans two rows)."""
    return -(-C * bits // 8)


def _axis_chunked(t: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    """[rows, C] -> [chunks, AXIS_CHUNK, C], the last chunk padded with `fill`."""
    K = axis_chunks(rows)
    pad = K * AXIS_CHUNK - rows
    return torch.cat([t, t.new_full((pad, t.shape[1]), fill)]).view(K, AXIS_CHUNK, -1)


def axis_stats(xf: torch.Tensor):
    """Finite min, max, amax and has-non-finite flag of each (row chunk, column) of float32
    `xf` [rows, C], each [chunks, C] (0 where a chunk's column has nothing finite)."""
    rows, C = xf.shape
    xp = _axis_chunked(xf, rows)
    valid = _axis_chunked(torch.ones(rows, 1, dtype=torch.bool, device=xf.device), rows,
                          False).expand_as(xp)
    finite = torch.isfinite(xp) & valid
    bad = (valid & ~finite).any(1)
    lo = torch.where(finite, xp, float("inf")).amin(1)
    hi = torch.where(finite, xp, float("-inf")).amax(1)
    none = ~finite.any(1)
    lo = torch.where(none, 0.0, lo)
    hi = torch.where(none, 0.0, hi)
    return lo, hi, torch.maximum(lo.abs(), hi.abs()), bad


def int_quant_axis_encode_ref(
    x: torch.Tensor, bits: int, symmetric: bool,
    noise: torch.Tensor | None = None, seed: int | None = None,
    state: torch.Tensor | None = None, nf_index: torch.Tensor | None = None,
    nf_value: torch.Tensor | None = None, nf_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [rows, C] -> (packed codes uint8 [rows * axis_row_bytes(C, bits)] (row-major, each
    row padded to whole bytes with code 0), scale float32 [chunks, C], zero [chunks, C] or
    empty): one scale (and zero) per column and chunk of AXIS_CHUNK rows, from that chunk's
    finite statistics; `state` and `nf_*` as in `int_quant_encode_ref`."""
    check_bits(bits, symmetric)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, C], got shape {tuple(x.shape)}")
    record_side_list(x, state, nf_index, nf_value, nf_count)
    rows, C = x.shape
    if noise is None:
        noise = seeded_noise(seed, x.numel(), x.device)
    xf = x.to(torch.float32)
    lo, hi, amax, bad = axis_stats(xf)
    scale, zero = quant_params(lo, hi, amax, bad, bits, symmetric)
    if symmetric:
        zero = scale.new_empty(0, C)
    if noise is not None:
        noise = _axis_chunked(noise.reshape(rows, C).to(torch.float32), rows)
    z = zero[:, None, :] if zero.numel() else zero
    codes = quantize(_axis_chunked(xf, rows), scale[:, None, :], z, bits, symmetric, noise)
    codes = codes.view(-1, C)[:rows]
    per = 8 // bits
    codes = torch.cat([codes, codes.new_zeros(rows, (-C) % per)], dim=1)
    return pack_bits(codes.reshape(-1), bits), scale, zero


def int_quant_axis_decode_ref(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool,
    numel: int, dtype: torch.dtype,
) -> torch.Tensor:
    """1-D tensor of `dtype` with `numel` values (row-major [numel // C, C], C =
    scale.shape[-1], scales per chunk of AXIS_CHUNK rows)."""
    C = scale.shape[-1]
    rows = numel // C
    rb = axis_row_bytes(C, bits)
    codes = unpack_bits(packed, bits, rows * rb * (8 // bits)).view(rows, -1)[:, :C]
    chunk = torch.arange(rows, device=packed.device) // AXIS_CHUNK
    z = zero[chunk] if zero.numel() else zero
    return dequantize(codes.to(torch.int64), scale[chunk], z, bits, symmetric).reshape(-1).to(dtype)


def noise_args(x, noise, seed):
    """(NOISE mode, noise tensor, seed int) a Triton launcher passes its kernel: the noise given,
    Philox from `seed`, or round-to-nearest. Shared by every launcher that rounds stochastically."""
    if noise is not None:
        return 1, noise.reshape(-1).contiguous(), 0
    if seed is not None:
        return 2, x, int(seed)
    return 0, x, 0
