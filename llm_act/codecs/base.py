"""The codec interface: what every compressor of a saved activation provides.

A codec turns a tensor into an `Encoded` record (packed payload + scales + indices, whose
`.nbytes` is the true stored size) and back. Lossy codecs also carry an error model, the
expected squared error predicted from the tensor's statistics, which the planner uses
as the noise S(option) a codec adds (GACT sec. 4).

Conventions shared by all codecs:
- `decode(encode(x))` has the shape, dtype and device of `x`; non-contiguous inputs are
  read as if contiguous; empty tensors round-trip.
- Finite in, finite out: values up to the dtype's maximum decode to finite values (the
  kernels work on scaled-down copies where a range could overflow, and clamp decoded
  values to the finite range). The kernels compute in float32, so float64 values beyond
  float32's range are not covered.
- Non-finite inputs decode to themselves: NaN stays NaN and +-Inf keeps its sign, so the
  loss scaler still sees overflow. The kernels leave them out of every statistic (group
  ranges, scales, means) and decode them to NaN by themselves (a flagged code), never to a
  finite value; `Codec.encode` also keeps their exact values in a side list of fixed
  capacity (`nonfinite_capacity`: 4 slots plus one per 8192 elements), which decode
  writes back: `nonfinite_index` (int32, or int64 beyond 2**31 elements; unused slots
  repeat a used one, or restore element 0 exactly), `nonfinite_value` (x's dtype) and
  `nonfinite_count` (int32 [1], how many there were). Fixed shapes: no host sync, and
  sequence-parallel shards keep one layout; one extra op per decode. When a
  tensor holds more non-finite values than the capacity, the extra ones decode to NaN (an
  Inf loses its sign, nothing becomes finite) and the codec's `nonfinite_overflow` (a
  device tensor, read it when you like: that read is the sync) counts them. `.nbytes`
  counts the side list. Lossless codecs need no list; codecs whose decode is not x
  (few-bit derivatives) set `keeps_nonfinite = False` and document their own rule.
- Stochastic rounding draws from the codec's own generator (one per device, seeded from
  `seed` alone), never from torch's global one, so compression changes no dropout mask.
  Who builds codecs picks the seed (`llm_act.runtime.controller.codec_seed`): equal on the
  tensor-parallel ranks only where they store the same tensor (`sites.tp_replicated`),
  different wherever the data differ (TP-split sites, SP shards, data-parallel replicas).
- Integer and complex tensors raise `TypeError` naming the codec and the dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


#: the non-finite side list has NONFINITE_MIN_SLOTS slots plus one per NONFINITE_STRIDE
#: elements (at most one per element): 12 slots (76 bytes) for 65536 bf16 elements, 0.14%
#: of an int4 record at any larger size
NONFINITE_MIN_SLOTS = 4
NONFINITE_STRIDE = 8192


def nonfinite_capacity(numel: int) -> int:
    """Slots of the non-finite side list of a tensor of `numel` elements: fixed by the
    size alone, so encoding needs no host sync and every record of a shape has one layout."""
    return min(numel, NONFINITE_MIN_SLOTS + numel // NONFINITE_STRIDE)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def side_list_nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of the side list of a tensor of `numel` elements of `dtype`."""
    if numel == 0:
        return 0
    slot = _index_dtype(numel).itemsize + dtype.itemsize
    return nonfinite_capacity(numel) * slot + 4


def nonfinite_side_list(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Positions (flat, row-major) and exact values of the first `nonfinite_capacity`
    non-finite elements of `x`, and their count; fixed shapes, no host sync.

    Unused slots repeat the first used one, or hold element 0 and its exact value when x
    is finite, so decode writes every slot back in one op (`restore_nonfinite`) and never
    needs to know how many were used.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    if n == 0:
        return {"nonfinite_index": torch.empty(0, dtype=torch.int32, device=x.device),
                "nonfinite_value": flat.new_empty(0),
                "nonfinite_count": torch.empty(0, dtype=torch.int32, device=x.device)}
    bad = (flat - flat).ne_(0)  # NaN exactly where x is not finite: 2 ops (isfinite is 4, + not)
    index = torch.nonzero_static(bad, size=nonfinite_capacity(n), fill_value=n).reshape(-1)
    index = torch.where(index < n, index, index[0] % n)  # index[0] is n when none is used
    return {"nonfinite_index": index.to(_index_dtype(n)), "nonfinite_value": flat[index],
            "nonfinite_count": bad.sum(dtype=torch.int32).reshape(1)}


def restore_nonfinite(out: torch.Tensor, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Write the side list's exact values back into `out`, in place (a fresh tensor: decode
    never returns memory of the record), in one op and without a host sync."""
    return out.view(-1).index_put_((index,), value.to(out.dtype)).view(out.shape)


@dataclass
class Encoded:
    """A stored activation: the tensors that live until backward, and what decode needs.

    `data` holds every tensor that is kept (payload, scales, indices, masks); `meta` holds
    small Python values (sizes, flags). `.nbytes` counts every byte of `data`.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / max(self.numel, 1)


class Codec:
    """Base class. Subclasses implement `_encode` / `_decode` and `expected_error`."""

    #: registry name ("int4", "outlier_int4", ...); set by the registry or the subclass
    name: str = "codec"
    #: decode(encode(x)) == x bit for bit
    lossless: bool = False
    #: uses stochastic rounding (unbiased, random); deterministic codecs have a bias
    stochastic: bool = False
    #: a lossy codec whose decode approximates x: it restores non-finite inputs exactly from
    #: the side list (see module doc); lossless codecs keep them by themselves
    keeps_nonfinite: bool = True

    def __init__(self, seed: int = 1234):
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._overflow: dict[str, torch.Tensor] = {}

    # ---- public API -------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Encoded:
        self.check_input(x)
        x = x.contiguous()
        enc = self._encode(x)
        if self.keeps_nonfinite and not self.lossless:
            side = nonfinite_side_list(x)
            enc.data.update(side)
            if x.numel():
                self._count_overflow(side["nonfinite_count"], nonfinite_capacity(x.numel()))
        return enc

    def decode(self, enc: Encoded) -> torch.Tensor:
        if enc.numel == 0:
            return torch.empty(enc.shape, dtype=enc.dtype, device=enc.device)
        out = self._decode(enc)
        index = enc.data.get("nonfinite_index")
        if index is not None and index.numel():
            out = restore_nonfinite(out.contiguous(), index, enc.data["nonfinite_value"])
        return out

    def _count_overflow(self, count: torch.Tensor, capacity: int) -> None:
        """Add the non-finite values past the side list's capacity to `nonfinite_overflow`
        (on the device: no sync)."""
        over = count.sub(capacity).clamp_min_(0)
        total = self._overflow.get(str(count.device))
        if total is None:
            self._overflow[str(count.device)] = over.to(torch.int64)
        else:
            total.add_(over)

    @property
    def nonfinite_overflow(self) -> int:
        """Non-finite values, over all encodes so far, that did not fit the side list and
        decode to NaN instead of their exact value. Reading it syncs with the device."""
        return int(sum(int(t.sum()) for t in self._overflow.values()))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def expected_error(self, x: torch.Tensor) -> float:
        """Predicted mean squared error per element of `decode(encode(x))` against `x`.

        Computed analytically from statistics of `x` (group ranges, scales), not by
        encoding it; for stochastic codecs this is the variance, for nearest rounding
        the expected squared rounding error (bias^2 for the planner).
        """
        if self.lossless:
            return 0.0
        raise NotImplementedError(f"{type(self).__name__} has no error model")

    def nbytes_for(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """Stored bytes for a tensor of this shape and dtype, without encoding one (the
        non-finite side list included: `side_list_bytes`)."""
        raise NotImplementedError(f"{type(self).__name__}.nbytes_for")

    def within_raw(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether encoding a finite tensor of `shape`/`dtype` stores no more bytes than the
        raw tensor (`numel * itemsize`), from the size formula alone (no trial encode).

        Data-dependent sizes take their bound (`OutlierInt4`: the cap on outlier channels).
        Where this is False the tensor is kept instead ("never more than stock"). Real
        codecs never tie with an activation's raw size; records that hold x itself (the
        recompute and measuring pseudo-codecs) do, and count as stock. A codec without a
        size formula is assumed to fit.
        """
        shape = tuple(int(s) for s in shape)
        raw = math.prod(shape) * dtype.itemsize
        try:
            cap = getattr(self, "max_outliers", None)
            if cap is not None:
                nbytes = self.nbytes_for(shape, dtype, n_outliers=cap(shape[-1] if shape else 1))
            else:
                nbytes = self.nbytes_for(shape, dtype)
        except NotImplementedError:
            return True
        except ValueError:  # a shape the codec cannot take (a scalar for a per-axis codec)
            return False
        return nbytes <= raw

    def side_list_bytes(self, shape, dtype: torch.dtype) -> int:
        """Bytes of the non-finite side list that `encode` adds for `shape`/`dtype`."""
        if not self.keeps_nonfinite or self.lossless:
            return 0
        return side_list_nbytes(math.prod(int(s) for s in shape), dtype)

    # ---- checks ----------------------------------------------------------------------
    def check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec {self.name!r} encodes tensors, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"codec {self.name!r} encodes floating-point tensors "
                f"(float32, float16, bfloat16), got dtype {x.dtype}"
            )

    # ---- the codec's own random stream ----------------------------------------------
    def generator(self, device: torch.device) -> torch.Generator:
        """The codec's private generator on `device` (created and seeded on first use)."""
        device = torch.device(device)
        key = str(device)
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)  # not the device index: TP ranks on cuda:0..7 must agree
            self._generators[key] = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generators = {}
        for key, st in state.get("generators", {}).items():
            self.generator(torch.device(key)).set_state(st)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ---- subclass hooks ----------------------------------------------------------------
    def _encode(self, x: torch.Tensor) -> Encoded:  # x is contiguous and floating
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def _record(self, x: torch.Tensor, **data: torch.Tensor) -> Encoded:
        """An `Encoded` for `x` holding `data`; meta can be added by the caller."""
        return Encoded(self.name, x.shape, x.dtype, x.device, dict(data))
