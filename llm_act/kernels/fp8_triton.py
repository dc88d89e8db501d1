"""Block-scaled FP8 (E4M3 / E5M2) Triton kernels; the spec is `fp8_ref`.

One program handles GROUPS blocks as a [GROUPS, BLOCK_P] tile (BLOCK_P = next power of two
of `block`, masked): amax, scale, divide, round and store in one pass, which also records
the non-finite side list (`nonfinite_triton`, when the codec passes its state): the encode
is one launch reading x once and writing the record once, with no torch op.

Float8 conversion: on a GPU the hardware's (`y.to(tl.float8e4nv / tl.float8e5)`, round to
nearest even; sm_90 compiles it to `cvt.rn.satfinite.e4m3x2.f32` / `e5m2x2`, and float8 to
float32 to `cvt.rn.f16x2.e4m3x2` + an exact f16 -> f32), since y is clamped to +-FMAX
first this is torch's `.to(torch.float8_*)` exactly. Under the interpreter (`HW=False`,
picked by the launcher from `TRITON_INTERPRET`, as triton's own `jit` does) it is integer
bit arithmetic: the interpreter's float8 casts round ties wrongly (tested), and
`fp8_ref.fp8_bits_ref` / `fp8_value_ref` check the bit arithmetic against torch's casts.

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): the scale
amax / FMAX and x / scale are `tl.math.div_rn` (correctly rounded, as torch's `/`; a GPU's
`/` is approximate), and launches pass `EXACT_LAUNCH` (no FMA contraction).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH, hardware_casts
from llm_act.kernels.fp8_ref import NAN_CODE, get_format, num_blocks
from llm_act.kernels.int_quant_triton import FMAX as FMAX32
from llm_act.kernels.int_quant_triton import clamp_finite
from llm_act.kernels.nonfinite_triton import keep_nonfinite
from llm_act.kernels.nonfinite_ref import nonfinite_args

GROUPS = 8  # blocks per program


@triton.jit
def _fp8_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """float32 y (finite, |y| <= FMAX) -> int32 float8 bits, round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    odd = (a >> SHIFT) & 1
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + odd) >> SHIFT) - ((127 - BIAS) << MBITS)
    # subnormals: |y| in units of 2**(1 - BIAS - MBITS); adding 2**23 rounds to an integer (RNE)
    t = tl.minimum(tl.abs(y) * (2.0 ** (BIAS - 1 + MBITS)), 2.0 ** MBITS)  # used below 2**MBITS
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    mag = tl.where(a >= ((128 - BIAS) << 23), normal, sub)
    return (sign << 7) | mag


@triton.jit
def _to_fp8(y, MBITS: tl.constexpr, BIAS: tl.constexpr, IS_E4M3: tl.constexpr,
            HW: tl.constexpr):
    """float32 y (finite, |y| <= FMAX) -> int32 float8 bits, round to nearest even: the
    hardware's conversion, or the bit arithmetic under the interpreter."""
    if HW:
        if IS_E4M3:
            f8 = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            f8 = y.to(tl.float8e5, fp_downcast_rounding="rtne")
        bits = f8.to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        bits = _fp8_bits(y, MBITS, BIAS)
    return bits


@triton.jit
def bf16_rne(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still as float32.

    Storing this to a bfloat16 pointer is exact on every backend (the interpreter's own
    float32 -> bfloat16 cast truncates instead of rounding)."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return tl.where(x == x, r.to(tl.float32, bitcast=True), x)


@triton.jit
def bf16_bits(x):
    """int16 bit pattern of `bf16_rne(x)` (float32 x, not NaN), to store through an int16
    view of a bfloat16 tensor: the interpreter's float32 <-> bfloat16 conversions also
    mangle subnormals, bit operations do not."""
    return (bf16_rne(x).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def bf16_value(b):
    """float32 value of int16 bfloat16 bit patterns (loaded through an int16 view)."""
    return (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_value(c, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
               IS_E4M3: tl.constexpr):
    """int32 float8 bits -> float32 value (NaN codes -> NaN, e5m2 infinities -> inf)."""
    sign = (c >> 7) & 1
    e = (c >> MBITS) & ((1 << EBITS) - 1)
    m = c & ((1 << MBITS) - 1)
    normal = ((sign << 31) | ((e + 127 - BIAS) << 23) | (m << (23 - MBITS))).to(
        tl.float32, bitcast=True)
    sub = m.to(tl.float32) * (2.0 ** (1 - BIAS - MBITS))
    sub = tl.where(sign == 1, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    if IS_E4M3:
        v = tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    else:
        top = e == ((1 << EBITS) - 1)
        inf = tl.where(sign == 1, float("-inf"), float("inf"))
        v = tl.where(top, tl.where(m == 0, inf, float("nan")), v)
    return v


@triton.jit
def _from_fp8(c, EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
              IS_E4M3: tl.constexpr, HW: tl.constexpr):
    """uint8 float8 bits -> float32 value (NaN codes -> NaN, e5m2 infinities -> inf)."""
    if HW:
        if IS_E4M3:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        v = _fp8_value(c.to(tl.int32), EBITS, MBITS, BIAS, IS_E4M3)
    return v


@triton.jit
def _fp8_encode_kernel(
    x_ptr,  # [n] input, any float dtype
    out_ptr,  # [n] uint8 float8 bits
    scale_ptr,  # [nblocks] float32 block scales
    state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr,  # the side list (`nonfinite_ref`)
    n, nblocks, block, cap,
    FMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, NAN_BITS: tl.constexpr,
    IS_E4M3: tl.constexpr, BLOCK_P: tl.constexpr, GROUPS: tl.constexpr, HW: tl.constexpr,
    SIDE: tl.constexpr,
):
    """scale = amax(finite |x|) / FMAX per block (0 -> 1); bits = RNE(clamp(x / scale));
    non-finite x: the NaN code, and a slot of the side list."""
    pid = tl.program_id(0)
    g = pid * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK_P)
    offs = g[:, None].to(tl.int64) * block + j[None, :]
    mask = (g[:, None] < nblocks) & (j[None, :] < block) & (offs < n)
    raw = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-inf
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
    scale = tl.math.div_rn(amax, FMAX * 1.0)
    scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.where(finite, y, 0.0)  # no NaN reaches min/max (a GPU's drop it, numpy's keep it)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    bits = _to_fp8(y, MBITS, BIAS, IS_E4M3, HW)
    bits = tl.where(finite, bits, NAN_BITS)
    tl.store(out_ptr + offs, bits.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + g, scale, mask=g < nblocks)
    keep_nonfinite(raw, offs, mask, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap,
               SIDE)


@triton.jit
def _fp8_decode_kernel(
    code_ptr,  # [n] uint8 float8 bits
    scale_ptr,  # [nblocks] float32 block scales
    out_ptr,  # [n] output dtype
    n, nblocks, block,
    EBITS: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, IS_E4M3: tl.constexpr,
    BLOCK_P: tl.constexpr, GROUPS: tl.constexpr, HW: tl.constexpr,
):
    """out = float8 value * block scale, clamped to +-float32 max (FMAX * scale may round
    one ulp past an amax near it); the NaN code decodes to NaN."""
    pid = tl.program_id(0)
    g = pid * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK_P)
    offs = g[:, None].to(tl.int64) * block + j[None, :]
    mask = (g[:, None] < nblocks) & (j[None, :] < block) & (offs < n)
    c = tl.load(code_ptr + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr + g, mask=g < nblocks, other=1.0)
    v = clamp_finite(_from_fp8(c, EBITS, MBITS, BIAS, IS_E4M3, HW) * scale[:, None], FMAX32)
    if not HW:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            v = bf16_rne(v)  # the interpreter's float32 -> bfloat16 cast truncates
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_encode(x: torch.Tensor, block: int, fmt: str, state=None, nf_index=None,
               nf_value=None, nf_count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fp8_ref.fp8_encode_ref`."""
    f = get_format(fmt)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    nb = num_blocks(n, block)
    out = torch.empty(n, dtype=torch.uint8, device=x.device)
    scale = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        side, *side_t = nonfinite_args(flat, state, nf_index, nf_value, nf_count)
        grid = (triton.cdiv(nb, GROUPS),)
        _fp8_encode_kernel[grid](
            flat, out, scale, *side_t[:4], n, nb, block, side_t[4],
            FMAX=f.fmax, MBITS=f.mbits, BIAS=f.bias, NAN_BITS=NAN_CODE,
            IS_E4M3=f.name == "e4m3", BLOCK_P=triton.next_power_of_2(block), GROUPS=GROUPS,
            HW=hardware_casts(), SIDE=side, **EXACT_LAUNCH)
    return out, scale


def fp8_decode(payload: torch.Tensor, scale: torch.Tensor, block: int, fmt: str,
               dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `fp8_ref.fp8_decode_ref`."""
    f = get_format(fmt)
    n = payload.numel()
    nb = num_blocks(n, block)
    out = torch.empty(n, dtype=dtype, device=payload.device)
    if n:
        grid = (triton.cdiv(nb, GROUPS),)
        _fp8_decode_kernel[grid](
            payload, scale, out, n, nb, block,
            EBITS=f.ebits, MBITS=f.mbits, BIAS=f.bias, IS_E4M3=f.name == "e4m3",
            BLOCK_P=triton.next_power_of_2(block), GROUPS=GROUPS, HW=hardware_casts(),
            **EXACT_LAUNCH)
    return out
