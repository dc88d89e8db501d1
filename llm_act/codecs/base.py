"""The codec interface: what every compressor of a saved activation provides.

A codec turns a tensor into an `Encoded` record (packed payload + scales + indices, whose
`.nbytes` is the true stored size) and back. Lossy codecs also carry an error model, the
expected squared error predicted from the tensor's statistics, which the planner uses
as the noise S(option) a codec adds (GACT sec. 4).

Conventions shared by all codecs:
- `decode(encode(x))` has the shape, dtype and device of `x`; non-contiguous inputs are
  read as if contiguous (per-channel codecs read strided rows in place, the others copy);
  empty tensors round-trip.
- Finite in, finite out: values up to the dtype's maximum decode to finite values (the
  kernels work on scaled-down copies where a range could overflow, and clamp decoded
  values to the finite range). The kernels compute in float32, so float64 values beyond
  float32's range are not covered.
- Non-finite inputs decode to themselves: NaN stays NaN and +-Inf keeps its sign, so the
  loss scaler still sees overflow. The kernels leave them out of every statistic (group
  ranges, scales, means) and decode them to NaN by themselves (a flagged code), never to a
  finite value; `Codec.encode` also keeps their exact values in a side list of fixed
  capacity (`nonfinite_capacity`: 4 slots plus one per 8192 elements), which decode
  writes back: `nonfinite_index` (int32, or int64 beyond 2**31 elements),
  `nonfinite_value` (x's dtype) and `nonfinite_count` (int32 [1], how many there were;
  slots past it are unwritten and ignored). Codecs whose kernels take the side-list
  buffers (`side_buffers`) find the values in their own pass (`llm_act.kernels.
  nonfinite_triton`); for the others `encode` scans x with the torch reference. Fixed
  shapes: no host sync, and sequence-parallel shards keep one layout; one extra small op
  per decode. When a tensor holds more non-finite values than the capacity, the extra
  ones decode to NaN (an Inf loses its sign, nothing becomes finite) and the codec's
  `nonfinite_overflow` counts them (on the device; reading it is the sync). `.nbytes`
  counts the side list. Lossless codecs need no list; codecs whose decode is not x
  (few-bit derivatives) set `keeps_nonfinite = False` and document their own rule.
- Stochastic rounding draws from the codec's own generator (one per device, seeded from
  `seed` alone), never from torch's global one, so compression changes no dropout mask.
  Who builds codecs picks the seed (`llm_act.runtime.seeds.codec_seed`): equal on the
  tensor-parallel ranks only where they store the same tensor (`sites.tp_replicated`),
  different wherever the data differ (TP-split sites, SP shards, data-parallel replicas).
- Integer and complex tensors raise `TypeError` naming the codec and the dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_act.kernels import custom_ops, nonfinite_ref

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


#: the side list's size rule (`llm_act.kernels.nonfinite_ref`): 4 slots + 1 per 8192 elements
NONFINITE_MIN_SLOTS, NONFINITE_STRIDE = nonfinite_ref.MIN_SLOTS, nonfinite_ref.STRIDE
nonfinite_capacity = nonfinite_ref.nonfinite_capacity
side_list_nbytes = nonfinite_ref.side_list_nbytes

#: the record's keys for the side list, in the kernels' argument order
SIDE_KEYS = ("nonfinite_index", "nonfinite_value", "nonfinite_count")


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
        self._states: dict[str, torch.Tensor] = {}

    # ---- public API -------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> Encoded:
        self.check_input(x)
        x = x if self._reads_strided_rows(x) else x.contiguous()
        enc = self._encode(x)
        if self.keeps_nonfinite and not self.lossless and SIDE_KEYS[0] not in enc.data:
            side = nonfinite_ref.side_list_ref(x, self.state(x.device))
            enc.data.update(zip(SIDE_KEYS, side))
        return enc

    def decode(self, enc: Encoded) -> torch.Tensor:
        if enc.numel == 0:
            return torch.empty(enc.shape, dtype=enc.dtype, device=enc.device)
        out = self._decode(enc)
        index = enc.data.get(SIDE_KEYS[0])
        if index is not None and index.numel():
            out = out.contiguous()
            custom_ops.restore_nonfinite(out, *(enc.data[k] for k in SIDE_KEYS))
        return out

    # ---- the non-finite side list and the per-device state ------------------------------
    def state(self, device: torch.device) -> torch.Tensor:
        """The codec's state on `device` (`nonfinite_ref.new_state`: its call count, which
        keys the kernels' random stream, and the side list's running count and overflow);
        one encode at a time per device uses it."""
        key = str(torch.device(device))
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = nonfinite_ref.new_state(device)
        return st

    def side_buffers(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keyword arguments for an encode op that records the side list in its own pass:
        the state and the unwritten buffers (`state`, `nf_index`, `nf_value`, `nf_count`)."""
        index, value, count = nonfinite_ref.empty_side_list(x.numel(), x.dtype, x.device)
        return {"state": self.state(x.device), "nf_index": index, "nf_value": value,
                "nf_count": count}

    @staticmethod
    def side_record(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The record's entries for the side list an encode op filled (`side_buffers`)."""
        return dict(zip(SIDE_KEYS, (buffers["nf_index"], buffers["nf_value"],
                                    buffers["nf_count"])))

    @property
    def nonfinite_overflow(self) -> int:
        """Non-finite values, over all encodes so far, that did not fit the side list and
        decode to NaN instead of their exact value. Reading it syncs with the device."""
        return int(sum(int(t) for t in self.overflow_counters()))

    def overflow_counters(self) -> list[torch.Tensor]:
        """`nonfinite_overflow`'s counters, one per device, still on it (no sync): a reader
        of many codecs sums them there and transfers once."""
        return [t[nonfinite_ref.OVERFLOW] for t in self._states.values()]

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
        return side_list_nbytes(math.prod(tuple(int(s) for s in shape)), dtype)

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
            "states": {k: t.cpu() for k, t in self._states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._generators = {}
        for key, st in state.get("generators", {}).items():
            self.generator(torch.device(key)).set_state(st)
        self._states = {k: t.to(torch.device(k)).clone()
                        for k, t in state.get("states", {}).items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # ---- subclass hooks ----------------------------------------------------------------
    def _reads_strided_rows(self, x: torch.Tensor) -> bool:
        """Whether `_encode` takes x as it is (rows of the last dim, any row stride) instead
        of a contiguous copy: a view such as `attn.v`, a slice of the QKV buffer, is then
        read in place."""
        return False

    def _encode(self, x: torch.Tensor) -> Encoded:  # floating; contiguous unless the above
        raise NotImplementedError

    def _decode(self, enc: Encoded) -> torch.Tensor:
        raise NotImplementedError

    def _record(self, x: torch.Tensor, **data: torch.Tensor) -> Encoded:
        """An `Encoded` for `x` holding `data`; meta can be added by the caller."""
        return Encoded(self.name, x.shape, x.dtype, x.device, dict(data))
