"""Random bits for stochastic rounding inside the kernels: cheap and unbiased to 2**-8.

`uniform8` gives each element of an [R, C] tile u = (b + 1/2) / 256 with b an independent
uniform byte: one Philox call gives four 32-bit words, i.e. 16 elements' bytes (where
`tl.rand` spends a whole call on one element and keeps a quarter of it). Rounding
floor(v + u) then goes up with probability within 2**-9 of frac(v), so the decoded mean
is off by at most 2**-9 of a quantization step (K_BITS = 8; the tests bound it by 2**-8).
Counters are (program, position in tile), so no two elements of a launch share bits.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: random bits per element
K_BITS = 8


@triton.jit
def uniform8(seed, pid, R: tl.constexpr, C: tl.constexpr):
    """float32 [R, C] in (0, 1), 8 random bits each; R * C a multiple of 16."""
    W: tl.constexpr = R * C // 16
    ctr = pid.to(tl.int64) * W + tl.arange(0, W)
    r0, r1, r2, r3 = tl.randint4x(seed, ctr)
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), (W, 4))
    shifts = (tl.arange(0, 4) * 8).to(tl.uint32)
    b = (words[:, :, None] >> shifts[None, None, :]) & 255
    return tl.reshape((b.to(tl.float32) + 0.5) * (1.0 / 256.0), (R, C))
