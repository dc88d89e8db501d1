"""Block-scaled FP8 (E4M3 / E5M2), pure-torch reference: the spec of the kernels.

The flattened row-major tensor is cut into blocks of `block` consecutive elements (the
last one may be short). Each block stores one float32 scale = amax / FMAX, amax over its
finite |x| (a block whose scale would be 0 stores 1.0), and one byte per element: the bit
pattern of the float8 value nearest (round to nearest even) to clamp(x / scale, -FMAX,
FMAX), computed in float32. Non-finite inputs store the format's NaN code 0x7F.
Decode: float8 value * scale, in float32, clamped to +-float32 max (FMAX * scale may
round one ulp past an amax near it), cast to the output dtype. The NaN code decodes to NaN
by itself; with a `state`, encode also fills the non-finite side list (`nonfinite_ref`),
from which the codec restores the exact values.

The float8 conversion is the format's own, round to nearest even with saturation by the
clamp to +-FMAX before it: torch's `.to(torch.float8_*)` here, the hardware's
`cvt.rn.satfinite` on a GPU (the same function of a float32 in [-FMAX, FMAX]), and integer
bit operations under the Triton interpreter, whose float8 casts round ties wrongly
(`fp8_bits_ref` / `fp8_value_ref` below spell those out in torch so that arithmetic is
tested on CPU against torch's casts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_act.kernels.int_quant_ref import clamp_finite
from llm_act.kernels.nonfinite_ref import record_side_list


@dataclass(frozen=True)
class FP8Format:
    """An 8-bit float: 1 sign, `ebits` exponent, `mbits` mantissa bits, exponent bias."""

    name: str
    torch_dtype: torch.dtype
    ebits: int
    mbits: int
    bias: int
    fmax: float  # largest finite value

    @property
    def min_exp(self) -> int:
        """Exponent of the smallest normal number (subnormal step = 2**(min_exp - mbits))."""
        return 1 - self.bias


FORMATS = {
    "e4m3": FP8Format("e4m3", torch.float8_e4m3fn, 4, 3, 7, 448.0),
    "e5m2": FP8Format("e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0),
}
NAN_CODE = 0x7F  # NaN in both formats (e4m3fn: S.1111.111, e5m2: S.11111.11)


def get_format(fmt: str) -> FP8Format:
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}") from None


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def blocked_view(flat: torch.Tensor, block: int) -> torch.Tensor:
    """[nblocks, block] view of `flat` padded with zeros."""
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def fp8_scales_ref(x: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """float32 [nblocks]: amax of the finite |x| per block / FMAX (0 -> 1.0)."""
    f = get_format(fmt)
    a = x.reshape(-1).float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    amax = blocked_view(a, block).amax(dim=1)
    # a tensor divisor: torch's CUDA `/` by a Python scalar multiplies by its reciprocal
    scale = amax / torch.full_like(amax, f.fmax)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_encode_ref(
    x: torch.Tensor, block: int, fmt: str,
    state: torch.Tensor | None = None, nf_index: torch.Tensor | None = None,
    nf_value: torch.Tensor | None = None, nf_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload uint8 [numel], scale float32 [nblocks]) of `x` (any shape, read row-major).

    With `state`, x's non-finite values go to the side-list buffers `nf_*`
    (`nonfinite_ref`; the kernel finds them in its one pass)."""
    f = get_format(fmt)
    record_side_list(x, state, nf_index, nf_value, nf_count)
    flat = x.reshape(-1).float()
    n = flat.numel()
    scale = fp8_scales_ref(flat, block, fmt)
    y = blocked_view(flat, block) / scale[:, None]
    y = y.reshape(-1)[:n].clamp(-f.fmax, f.fmax)
    bits = y.to(f.torch_dtype).view(torch.uint8)
    bits = torch.where(torch.isfinite(flat), bits, torch.full_like(bits, NAN_CODE))
    return bits, scale


def fp8_decode_ref(payload: torch.Tensor, scale: torch.Tensor, block: int, fmt: str,
                   dtype: torch.dtype) -> torch.Tensor:
    """Flat [numel] tensor of `dtype`: float8 value of each byte times its block's scale."""
    f = get_format(fmt)
    n = payload.numel()
    v = payload.view(f.torch_dtype).float()
    y = clamp_finite((blocked_view(v, block) * scale[:, None]).reshape(-1)[:n])
    return y.to(dtype)


# ---- the bit arithmetic the kernel uses, spelled out in torch ------------------------------
def fp8_bits_ref(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 bits of float32 `y` (finite, |y| <= FMAX) rounded to nearest even, by integer
    and exact float operations only (no float8 cast): what the Triton kernel computes."""
    f = get_format(fmt)
    bits = y.float().view(torch.int32)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF  # |y| as bits
    shift = 23 - f.mbits
    # normal: round the float32 mantissa to mbits (RNE); a carry moves into the exponent
    odd = (a >> shift) & 1
    r = (a + ((1 << (shift - 1)) - 1) + odd) >> shift
    normal = r - ((127 - f.bias) << f.mbits)
    # subnormal: |y| in units of the subnormal step, rounded to an integer by the 2**23 trick
    t = (y.float().abs() * 2.0 ** (f.bias - 1 + f.mbits)).clamp(max=2.0**f.mbits)  # used below
    sub = ((t + 8388608.0) - 8388608.0).to(torch.int32)
    is_normal = a >= ((127 + f.min_exp) << 23)
    mag = torch.where(is_normal, normal, sub)
    return ((sign << 7) | mag).to(torch.uint8)


def fp8_value_ref(code: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 value of uint8 float8 bit patterns, by bit operations (no float8 cast)."""
    f = get_format(fmt)
    c = code.to(torch.int32)
    sign = (c >> 7) & 1
    e = (c >> f.mbits) & ((1 << f.ebits) - 1)
    m = c & ((1 << f.mbits) - 1)
    normal = ((sign << 31) | ((e + 127 - f.bias) << 23) | (m << (23 - f.mbits))).view(torch.float32)
    sub = m.float() * 2.0 ** (f.min_exp - f.mbits)
    sub = torch.where(sign == 1, -sub, sub)
    v = torch.where(e == 0, sub, normal)
    if f.name == "e4m3":  # e4m3fn: no infinities, S.1111.111 is NaN
        special = (c & 0x7F) == 0x7F
        return torch.where(special, torch.full_like(v, float("nan")), v)
    top = e == (1 << f.ebits) - 1  # e5m2: IEEE-like, m == 0 is inf, else NaN
    inf = torch.where(sign == 1, -float("inf"), float("inf")) * torch.ones_like(v)
    return torch.where(top, torch.where(m == 0, inf, torch.full_like(v, float("nan"))), v)
