"""Outlier-separated INT4 (Adacc sec. 3.2): exact outlier channels + ActNN INT4 for the rest.

LLM activations put their outliers in a few channels (hidden dims). Quantizing them with
everything else stretches every group's range; Adacc stores those channels exactly and
quantizes the rest in the tensor's own row-major layout (no transpose). Channels are
picked by the z-score of their absolute column sums (eq. 1), threshold `z_threshold`.

Layout: x is read as [rows, C] with C = x.shape[-1] (megatron's [s, b, h] gives rows =
s*b). Stored: INT4 codes of every element (outliers coded 0 and excluded from group
ranges), float32 scale and zero per group of `group_size` consecutive elements, and a
fixed number n = floor(max_outlier_frac * C) of outlier slots (`meta["n_outliers"]`,
default 1/64 of the channels): their values [rows, n] in x's dtype and their channel
indices (int16 when C < 2**15, else int32; an unused slot holds C and zeros). Size:

    ceil(numel / 2) + 8 * ceil(numel / group_size) + n * rows * itemsize + n * index_bytes

(+ the non-finite side list). The slots go to the channels with z > `z_threshold`, the
largest z first when more qualify. Fixed slots make every shape independent of the data:
no host sync per encode, and sequence-parallel shards share one layout. What they cost:
1/64 of the channels in x's dtype, 0.031 bytes per element in bf16 on top of INT4's 0.5625
(+5.6%), whether the data has outliers or not. With z > 3, Gaussian data without real
outliers shows ~0.13% of its channels as outliers (one in 512 channels);
`outlier_count(enc)` says how many slots an encode used (a device read).

Non-finite values are left out of the column sums and group ranges (in an outlier channel
the kernels store them as NaN, among inliers they use IntQuant's flagged-group code, see
`llm_act.kernels.outlier_ref`); `Codec`'s side list restores them exactly (NaN stays NaN,
+-Inf keeps its sign).
"""
from __future__ import annotations

import math

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.kernels import custom_ops, use_triton
from llm_act.kernels import outlier_ref as ref


def _matrix_shape(shape) -> tuple[int, int]:
    """(rows, C) of the [rows, C] view of a tensor of `shape` (a scalar is [1, 1])."""
    shape = tuple(int(s) for s in shape)
    C = shape[-1] if shape else 1
    numel = math.prod(shape)
    return (numel // C if C else 0), C


def _used_slots(index: torch.Tensor, C: int) -> int:
    """Outlier slots in use (an unused one holds C); reads the device."""
    return int((index.long() < C).sum())


def _index_dtype(C: int) -> torch.dtype:
    return torch.int16 if C <= torch.iinfo(torch.int16).max else torch.int32


class OutlierInt4(Codec):
    """Exact outlier channels (z-score of |column sums| > `z_threshold`) + stochastic INT4.

    `group_size` must be even (two codes per byte, no byte straddles groups);
    `max_outlier_frac=0` turns the separation off (plain INT4).
    """

    name = "outlier_int4"
    stochastic = True

    def __init__(self, z_threshold: float = 3.0, group_size: int = 128, seed: int = 1234,
                 max_outlier_frac: float = 1.0 / 64):
        super().__init__(seed=seed)
        if isinstance(z_threshold, bool) or not isinstance(z_threshold, (int, float)) \
                or math.isnan(z_threshold):
            raise ValueError(f"z_threshold must be a real number, got {z_threshold!r}")
        if isinstance(group_size, bool) or not isinstance(group_size, int) \
                or group_size < 2 or group_size % 2:
            raise ValueError(
                f"group_size must be an even integer >= 2 (two INT4 codes per byte), "
                f"got {group_size!r}")
        if isinstance(max_outlier_frac, bool) or not isinstance(max_outlier_frac, (int, float)) \
                or not 0.0 <= max_outlier_frac <= 1.0:
            raise ValueError(f"max_outlier_frac must be in [0, 1], got {max_outlier_frac!r}")
        self.z_threshold = float(z_threshold)
        self.group_size = group_size
        self.max_outlier_frac = float(max_outlier_frac)
        #: the last encode's outlier slots and channel count (the slots only: a whole record
        #: kept here would outlive its backward)
        self._last: tuple[torch.Tensor, int] | None = None

    def max_outliers(self, C: int) -> int:
        """The outlier slots for C channels: floor(max_outlier_frac * C) (none when C < 2)."""
        return int(math.floor(self.max_outlier_frac * C + 1e-9)) if C >= 2 else 0

    @staticmethod
    def outlier_count(enc: Encoded) -> int:
        """Outlier channels `enc` keeps exactly (its used slots); reads the device."""
        index = enc.data.get("index")
        return 0 if index is None else _used_slots(index, enc.meta["channels"])

    def count_outliers(self, x: torch.Tensor) -> int:
        """Channels of `x` whose z-score exceeds the threshold, slots or not: the data's
        outlier rate, a statistic for the planner's tracking points (reads the device)."""
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0 or C < 2:
            return 0
        return int(ref.outlier_z(custom_ops.outlier_colsum(x.contiguous().view(rows, C)))
                   .gt(self.z_threshold).sum())

    @property
    def last_outlier_count(self) -> int:
        """Outlier channels of the last encode; reads the device."""
        return 0 if self._last is None else _used_slots(*self._last)

    # ---- size ---------------------------------------------------------------------------
    def nbytes_for(self, shape, dtype: torch.dtype, n_outliers: int | None = None) -> int:
        """Stored bytes for `shape`/`dtype` with `n_outliers` slots (default: this codec's
        fixed `max_outliers(C)`, what `encode` stores)."""
        rows, C = _matrix_shape(shape)
        numel = rows * C
        if numel == 0:
            return 0
        if n_outliers is None:
            n_outliers = self.max_outliers(C)
        if not 0 <= n_outliers <= C:
            raise ValueError(f"n_outliers must be in [0, {C}], got {n_outliers!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        index_bytes = torch.empty((), dtype=_index_dtype(C)).element_size()
        groups = -(-numel // self.group_size)
        return (-(-numel // 2) + 8 * groups
                + n_outliers * (rows * itemsize + index_bytes) + self.side_list_bytes(shape, dtype))

    # ---- encode / decode --------------------------------------------------------------
    def select(self, x2: torch.Tensor) -> torch.Tensor:
        """The int64 outlier slots of the [rows, C] matrix `x2` (`outlier_ref.select_outliers`:
        ascending channel indices, C for an unused slot; no host sync)."""
        return ref.select_outliers(custom_ops.outlier_colsum(x2), self.z_threshold,
                                   self.max_outliers(x2.shape[1]))

    def _encode(self, x: torch.Tensor) -> Encoded:
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0:
            enc = Encoded(self.name, x.shape, x.dtype, x.device)
            enc.meta.update(n_outliers=0, rows=rows, channels=C, group_size=self.group_size)
            self._last = None
            return enc
        x2 = x.view(rows, C)
        idx = self.select(x2)
        gen = self.generator(x.device)
        if use_triton(x2):
            seed = torch.randint(0, 2**31 - 1, (1,), generator=gen, device=x.device)
            packed, scale, zero, values = custom_ops.outlier_encode(
                x2, idx, self.group_size, seed=seed)
        else:
            noise = torch.rand(rows * C, generator=gen, device=x.device)
            packed, scale, zero, values = custom_ops.outlier_encode(
                x2, idx, self.group_size, noise=noise)
        enc = self._record(x, packed=packed, scale=scale, zero=zero, values=values,
                           index=idx.to(_index_dtype(C)))
        enc.meta.update(n_outliers=int(idx.numel()), rows=rows, channels=C,
                        group_size=self.group_size)
        self._last = (idx, C)  # counted when asked (`last_outlier_count`), not on every encode
        return enc

    def _decode(self, enc: Encoded) -> torch.Tensor:
        d = enc.data
        out = custom_ops.outlier_decode(d["packed"], d["scale"], d["zero"], d["index"],
                                        d["values"], enc.meta["group_size"], enc.meta["rows"],
                                        enc.meta["channels"], enc.dtype)
        return out.view(enc.shape)

    # ---- error model ------------------------------------------------------------------
    def expected_error(self, x: torch.Tensor) -> float:
        """Stochastic-rounding variance per element: sum over groups of
        n_g * Delta_g^2 / 6 over numel, Delta_g = inlier range / 15 (outliers: exact)."""
        self.check_input(x)
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0:
            return 0.0
        x2 = x.contiguous().view(rows, C)
        idx = self.select(x2)
        _, use, _, mn, mx, bad = ref.group_stats(x2, idx, self.group_size)
        rng = mx.double() - mn.double()  # float64: a float32 range can overflow
        delta = rng / torch.where(bad, ref.LEVELS - 1.0, float(ref.LEVELS)).double()
        var = (use.sum(dim=1).double() * delta ** 2 / 6.0).sum()
        return float(var) / (rows * C)
