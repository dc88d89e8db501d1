"""Block-scaled FP8 (E4M3 or E5M2): 8 bits per element plus one float32 scale per block.

A float format keeps relative precision over a wide range, so it needs no stochastic
rounding to stay close and no outlier handling: one scale per `block` consecutive
elements (amax / FMAX) maps each block onto the format's full range. E4M3 (3 mantissa
bits, max 448) is the precise one, E5M2 (2 mantissa bits, max 57344) the wide one.

Layout: payload uint8 [numel] (float8 bit patterns; non-finite inputs store the NaN code
0x7F, which decodes to NaN, and are left out of the block amax; the encode kernel records
their exact values in `Codec`'s side list in the same pass, and decode restores them),
scale float32 [ceil(numel / block)].
Size: numel + 4 * ceil(numel / block) bytes. Rounding is nearest-even (deterministic).
"""
from __future__ import annotations

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.kernels import custom_ops
from llm_act.kernels import fp8_ref as ref


class FP8(Codec):
    """Float8 `fmt` ("e4m3" or "e5m2") with a float32 scale per `block` elements."""

    name = "fp8"

    def __init__(self, fmt: str = "e4m3", block: int = 128, seed: int = 1234):
        super().__init__(seed=seed)
        self.format = ref.get_format(fmt)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive integer, got {block!r}")
        self.fmt = fmt
        self.block = block
        self.name = f"fp8_{fmt}"

    def nbytes_for(self, shape, dtype: torch.dtype) -> int:
        n = 1
        for s in shape:
            n *= int(s)
        return n + 4 * ref.num_blocks(n, self.block) + self.side_list_bytes(shape, dtype)

    def _encode(self, x: torch.Tensor) -> Encoded:
        side = self.side_buffers(x)
        payload, scale = custom_ops.fp8_encode(x, self.block, self.fmt, **side)
        enc = self._record(x, payload=payload, scale=scale)
        enc.data.update(self.side_record(side))
        return enc

    def _decode(self, enc: Encoded) -> torch.Tensor:
        out = custom_ops.fp8_decode(enc.data["payload"], enc.data["scale"], self.block,
                                    self.fmt, enc.dtype)
        return out.view(enc.shape)

    def expected_error(self, x: torch.Tensor) -> float:
        """Nearest-rounding error per element, ulp^2 / 12 summed over the finite elements.

        For y = |x| / scale in the binade [2^e, 2^(e+1)) the format's spacing is
        2^(e - mbits); below the smallest normal 2^min_exp it is the subnormal step
        2^(min_exp - mbits). Rounding to nearest leaves an error uniform over one spacing,
        variance (spacing * scale)^2 / 12; exact zeros and each block's amax (stored as FMAX
        exactly) contribute nothing. Non-finite
        elements (decoded to NaN) are left out of the mean.
        """
        self.check_input(x)
        n = x.numel()
        if n == 0:
            return 0.0
        f = self.format
        flat = x.reshape(-1).float()
        scale = ref.fp8_scales_ref(flat, self.block, self.fmt)
        y = ref.blocked_view(flat, self.block).abs() / scale[:, None]
        s = ref.blocked_view(torch.ones_like(flat), self.block) * scale[:, None]
        y, s = y.reshape(-1)[:n], s.reshape(-1)[:n]
        finite = torch.isfinite(y)
        y = torch.where(finite, y.clamp(max=f.fmax), torch.zeros_like(y))
        _, e = torch.frexp(y)  # y = m * 2^e, m in [0.5, 1): binade exponent e - 1
        spacing = torch.exp2((e - 1).clamp(min=f.min_exp).float() - f.mbits) * s
        # a block's amax maps onto FMAX, which is exact: only 0 < y < FMAX rounds
        rounds = (y > 0) & (y < f.fmax * (1.0 - 2.0**-20))
        var = torch.where(rounds, spacing.double() ** 2 / 12.0,
                          torch.zeros_like(y, dtype=torch.float64))
        count = int(finite.sum())
        return float(var.sum()) / max(count, 1)
