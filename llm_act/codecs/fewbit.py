"""Few-Bit Backward (Novikov et al., sec. 3): keep a few-bit bucket of x, not x.

The backward of a pointwise activation needs only f'(x). We replace f' by its optimal
piecewise-constant approximation q with 2**bits intervals (eq. (2)), so the forward
saves the interval index of every element (`bits` bits) and the backward multiplies the
output gradient by q's value there. `FewBit` is the codec storing the indices; the fit
of q (`fit_derivative`, `DerivativeTable`) and the exact derivatives (`derivative`) live
in `llm_act.codecs.fewbit_fit` and are re-exported here.
"""
from __future__ import annotations

import functools
import math

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.fewbit_fit import ACTIVATIONS, DerivativeTable, derivative, fit_derivative
from llm_act.kernels import custom_ops
from llm_act.kernels.fewbit_ref import code_bytes, flag_bytes

# the fit's public names stay importable from here (`llm_act.codecs.fewbit.fit_derivative`)
__all__ = ["FewBit", "ACTIVATIONS", "DerivativeTable", "derivative", "fit_derivative"]

_HIST_BINS = 4096


@functools.lru_cache(maxsize=None)
def _bin_mse(name: str, bits: int, lo: float, hi: float) -> torch.Tensor:
    """Mean of (f' - q)^2 over each of _HIST_BINS equal bins of [lo, hi] (float64)."""
    table = fit_derivative(name, bits, lo, hi)
    df = derivative(name)
    sub = 16  # midpoint rule on 16 sub-cells per bin
    edges = torch.linspace(lo, hi, _HIST_BINS * sub + 1, dtype=torch.float64)
    x = 0.5 * (edges[:-1] + edges[1:])
    err = (df(x) - table.lookup(x)) ** 2
    return err.view(_HIST_BINS, sub).mean(dim=1)


class FewBit(Codec):
    """Stores the `bits`-bit bucket of x in the fitted table of f'; decode returns q(x) ~ f'(x).

    Stored: ceil(n*bits/8) bytes of tightly packed codes (bits=3 packs 8 codes in 3 bytes)
    plus ceil(ceil(n/128)/8) bytes of non-finite group flags, i.e. bits + 1/128 bits per
    element (layout in `llm_act.kernels.fewbit_ref`). NaN/Inf inputs decode to NaN.
    """

    lossless = False
    stochastic = False
    keeps_nonfinite = False  # decode is f'(x), not x: non-finite x gives a NaN derivative

    def __init__(self, activation: str = "gelu", bits: int = 3, seed: int = 1234,
                 lo: float = -10.0, hi: float = 10.0):
        super().__init__(seed)
        self.table = fit_derivative(activation, bits, lo, hi)
        self.activation = activation
        self.bits = bits
        self.name = f"fewbit{bits}"
        self._tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._tensors:
            cuts = torch.tensor(self.table.cuts, dtype=torch.float32, device=device)
            levels = torch.tensor(self.table.levels, dtype=torch.float32, device=device)
            self._tensors[key] = (cuts, levels)
        return self._tensors[key]

    def _encode(self, x: torch.Tensor) -> Encoded:
        cuts, _ = self._table_tensors(x.device)
        codes, flags = custom_ops.fewbit_encode(x, cuts, self.bits, self.table.symmetric)
        enc = self._record(x, codes=codes, flags=flags)
        enc.meta.update(activation=self.activation, bits=self.bits)
        return enc

    def _decode(self, enc: Encoded) -> torch.Tensor:
        if enc.meta.get("bits") != self.bits or enc.meta.get("activation") != self.activation:
            raise ValueError(
                f"codec {self.name!r} ({self.activation}) cannot decode a record of "
                f"{enc.codec!r} ({enc.meta.get('activation')}, bits={enc.meta.get('bits')})"
            )
        _, levels = self._table_tensors(enc.device)
        codes, flags = enc.data["codes"], enc.data["flags"]
        out = custom_ops.fewbit_decode(codes, flags, levels, self.bits, enc.numel, enc.dtype)
        return out.view(enc.shape)

    def nbytes_for(self, shape, dtype: torch.dtype) -> int:
        n = math.prod(shape)
        return code_bytes(n, self.bits) + flag_bytes(n)

    def expected_error(self, x: torch.Tensor) -> float:
        """Predicted mean of (q(x) - f'(x))^2 over the finite elements of x.

        From a histogram of x over [lo, hi] (4096 bins; values outside count in the end
        bins, where f' is flat) and the per-bin mean squared deviation of the table.
        """
        self.check_input(x)
        t = self.table
        xf = x.detach().reshape(-1).float()
        xf = torch.where(torch.isfinite(xf), xf.clamp(t.lo, t.hi), float("nan"))
        hist = torch.histc(xf, bins=_HIST_BINS, min=t.lo, max=t.hi).double()
        mse = _bin_mse(self.activation, self.bits, t.lo, t.hi).to(hist.device)
        return float((hist * mse).sum() / hist.sum().clamp(min=1.0))

    def __repr__(self) -> str:
        return f"FewBit(activation={self.activation!r}, bits={self.bits})"
