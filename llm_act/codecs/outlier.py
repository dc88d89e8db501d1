"""Outlier-separated INT4 (Adacc sec. 3.2): exact outlier channels + ActNN INT4 for the rest.

LLM activations put their outliers in a few channels (hidden dims). Quantizing them with
everything else stretches every group's range; Adacc stores those channels exactly and
quantizes the rest in the tensor's own row-major layout (no transpose). Channels are
picked by the z-score of their absolute column sums (eq. 1), threshold `z_threshold`.

One pass (issue 26): Adacc's z-scores are over the whole tensor, which an encode kernel
knows only after reading all of it. Here each tile of 8 rows x 512 channels (at
group_size 128; `outlier_ref.tile_layout`) picks its own outliers among its 512 channels,
by the z-score of their |x| sums over its 8 rows, inside the program that quantizes it:
one launch reads x once and writes the record once. The alternative, last call's channel
choice kept on the device, was not taken: a codec serves many sites and shapes, the first
call has no choice, and a stale choice misses new outliers; per-tile choice costs one
channel index per slot per 8 rows (0.004 bytes per element) and finds local outliers
too. Outlier channels of LLM activations are the same in every row, so every chunk finds
them again (with Gaussian rows, a chunk picks an inlier channel now and then: it is stored
exactly, which only lowers the error). What it changes against a whole-tensor choice: a
tile keeps at most `slots` = floor(max_outlier_frac * 512) channels (8 at the default
1/64, the same 1/64 of the channels in total), so more than 8 outlier channels inside one
block of 512 channels leave the extra ones quantized with their group's inliers. Measured
on bf16 Gaussian data [512, 1024] with 8 outlier channels (x30) placed at random, 30
draws: relative RMSE 0.0500 on average, worst 0.0511 (whole-tensor choice: 0.0499, worst
0.0508); tiles of 256 channels with 4 slots averaged 0.0564, worst 0.143 (5 outliers in
one tile).

Layout (`outlier_ref`): x is read as [rows, C] with C = x.shape[-1] (megatron's [s, b, h]
gives rows = s*b). Stored: INT4 codes of every element, rows padded to whole bytes
(outliers coded 0 and excluded from group ranges), float32 scale and zero per group of
`group_size` consecutive channels of a row (groups do not span rows), and n slots per row
(`meta["n_outliers"]`, tiles * slots, 1/64 of the channels at the default): their values
[rows, n] in x's dtype and, per chunk of 8 rows, their channel indices [chunks, n]
(int16 when C < 2**15, else int32; an unused slot holds C and a value 0). Size:

    rows * ceil(C / 2) + 8 * rows * ceil(C / group_size) + n * rows * itemsize
    + n * ceil(rows / rows_per_chunk) * index_bytes

(+ the non-finite side list). In bf16 at C a multiple of 512: 0.5 + 0.0625 + 0.03125 +
0.0039 = 0.5977 bytes per element (the whole-tensor choice stored 0.5938: n indices
once). Fixed slots keep every shape independent of the data: no host sync, and
sequence-parallel shards share one layout. `outlier_count(enc)` says how many channels an
encode kept exactly in some chunk (a device read).

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


def _kept_channels(index: torch.Tensor, C: int) -> int:
    """Channels some chunk keeps exactly (unused slots hold C); reads the device."""
    seen = torch.zeros(C + 1, dtype=torch.bool, device=index.device)
    seen[index.long().reshape(-1)] = True
    return int(seen[:C].sum())


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

    def tile_slots(self, C: int) -> int:
        """Outlier slots of each tile: floor(max_outlier_frac * channels per tile), 0 when
        C < 2 (`outlier_ref.slots_per_tile`)."""
        return ref.slots_per_tile(C, self.group_size, self.max_outlier_frac)

    def max_outliers(self, C: int) -> int:
        """The outlier slots of a row for C channels (tiles * `tile_slots`): what `encode`
        stores, about max_outlier_frac * C."""
        return ref.record_layout(1, C, self.group_size, self.tile_slots(C))["slots_per_row"]

    @staticmethod
    def outlier_count(enc: Encoded) -> int:
        """Channels `enc` keeps exactly in at least one row chunk; reads the device."""
        index = enc.data.get("index")
        return 0 if index is None else _kept_channels(index, enc.meta["channels"])

    def count_outliers(self, x: torch.Tensor) -> int:
        """Channels of `x` whose z-score over the whole tensor exceeds the threshold, slots
        or not: the data's outlier rate, a statistic for the planner's tracking points
        (reads the device)."""
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0 or C < 2:
            return 0
        return int(ref.outlier_z(ref.column_abs_sums(x.contiguous().view(rows, C)))
                   .gt(self.z_threshold).sum())

    @property
    def last_outlier_count(self) -> int:
        """Channels the last encode kept exactly in some row chunk; reads the device."""
        return 0 if self._last is None else _kept_channels(*self._last)

    # ---- size ---------------------------------------------------------------------------
    def nbytes_for(self, shape, dtype: torch.dtype, n_outliers: int | None = None) -> int:
        """Stored bytes for `shape`/`dtype` with `n_outliers` slots per row (default: this
        codec's fixed `max_outliers(C)`, what `encode` stores)."""
        rows, C = _matrix_shape(shape)
        if rows * C == 0:
            return 0
        if n_outliers is None:
            n_outliers = self.max_outliers(C)
        if not 0 <= n_outliers <= C:
            raise ValueError(f"n_outliers must be in [0, {C}], got {n_outliers!r}")
        lay = ref.record_layout(rows, C, self.group_size, 0)
        itemsize = torch.empty((), dtype=dtype).element_size()
        index_bytes = torch.empty((), dtype=ref.index_dtype(C)).element_size()
        return (rows * lay["row_bytes"] + 8 * rows * lay["groups"]
                + n_outliers * (rows * itemsize + lay["chunks"] * index_bytes)
                + self.side_list_bytes(shape, dtype))

    # ---- encode / decode --------------------------------------------------------------
    def select(self, x2: torch.Tensor) -> torch.Tensor:
        """The outlier slots the encode kernel picks in the [rows, C] matrix `x2`
        (`outlier_ref.select_tiles_ref`): int64 [row chunks, slots per row], ascending
        channels per tile, C for an unused slot."""
        return ref.select_tiles_ref(x2, self.group_size, self.z_threshold,
                                    self.tile_slots(x2.shape[1]))

    def _rounding(self, x: torch.Tensor) -> dict:
        """Stochastic rounding: the kernel draws Philox bits keyed by the codec's seed and
        call count (no op, no tensor); the reference takes noise from the codec's
        generator."""
        if use_triton(x):
            return {"seed": self.seed}
        return {"noise": torch.rand(x.numel(), generator=self.generator(x.device),
                                    device=x.device)}

    def _encode(self, x: torch.Tensor) -> Encoded:
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0:
            enc = Encoded(self.name, x.shape, x.dtype, x.device)
            enc.meta.update(n_outliers=0, rows=rows, channels=C, group_size=self.group_size)
            self._last = None
            return enc
        x2 = x.view(rows, C)
        side = self.side_buffers(x)
        packed, scale, zero, values, index = custom_ops.outlier_encode(
            x2, self.group_size, self.z_threshold, self.tile_slots(C), **self._rounding(x2),
            **side)
        enc = self._record(x, packed=packed, scale=scale, zero=zero, values=values,
                           index=index, **self.side_record(side))
        enc.meta.update(n_outliers=values.shape[1], rows=rows, channels=C,
                        group_size=self.group_size)
        self._last = (index, C)  # counted when asked (`last_outlier_count`), not every encode
        return enc

    def _decode(self, enc: Encoded) -> torch.Tensor:
        d = enc.data
        out = custom_ops.outlier_decode(d["packed"], d["scale"], d["zero"], d["values"],
                                        d["index"], enc.meta["group_size"], enc.meta["rows"],
                                        enc.meta["channels"], enc.dtype)
        return out.view(enc.shape)

    # ---- error model ------------------------------------------------------------------
    def expected_error(self, x: torch.Tensor) -> float:
        """Stochastic-rounding variance per element: sum over groups of
        n_g * Delta_g^2 / 6 over numel, Delta_g = inlier range / 15 (14 in a flagged
        group), with the outlier channels each tile keeps exactly (`select`)."""
        self.check_input(x)
        rows, C = _matrix_shape(x.shape)
        if rows * C == 0:
            return 0.0
        x2 = x.contiguous().view(rows, C)
        _, use, _, mn, mx, bad = ref.group_stats(x2, self.select(x2), self.group_size)
        rng = mx.double() - mn.double()  # float64: a float32 range can overflow
        delta = rng / torch.where(bad, ref.LEVELS - 1.0, float(ref.LEVELS)).double()
        var = (use.sum(dim=-1).double() * delta ** 2 / 6.0).sum()
        return float(var) / (rows * C)
