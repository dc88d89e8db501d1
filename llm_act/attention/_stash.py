"""Tensors an attention Function keeps for backward, raw or encoded by a codec.

Everything goes through `ctx.save_for_backward` (the payload, scales and indices of an
encoded record included), so `saved_tensors_hooks` and the ledger see the true stored
bytes. `report(site, tensors, nbytes)`, when given, is told what each site stores (the
megatron layers pass a closure over `llm_act.ledger.report(layer, ...)`); each storage is
reported once, under the first site that holds it (Q, K, V views of one QKV buffer).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from llm_act.codecs.base import Codec, Encoded

Report = Callable[[str, list, int], None]


class Stash:
    """Collects tensors to save and how to rebuild each entry in backward."""

    def __init__(self, report: Optional[Report] = None):
        self.tensors: list[torch.Tensor] = []
        self.layout: list[tuple[int, int, Any]] = []  # (start, count, how to rebuild)
        self.report = report
        self._seen: set[int] = set()

    def add(self, site: str, x: torch.Tensor, codec: Optional[Codec] = None) -> int:
        """Store `x` raw (codec None) or encoded; returns the entry's index."""
        if codec is None:
            parts, how = [x], None
        else:
            enc = codec.encode(x)
            keys = list(enc.data)
            parts = [enc.data[k] for k in keys]
            how = (codec, enc.codec, enc.shape, enc.dtype, enc.device, keys, dict(enc.meta))
        self._report(site, parts)
        self.layout.append((len(self.tensors), len(parts), how))
        self.tensors.extend(parts)
        return len(self.layout) - 1

    def add_encoded(self, site: str, codec: Codec, enc: Encoded) -> int:
        """Store a record made elsewhere (e.g. `RegenMask.sample`)."""
        keys = list(enc.data)
        parts = [enc.data[k] for k in keys]
        self._report(site, parts)
        self.layout.append((len(self.tensors), len(parts),
                            (codec, enc.codec, enc.shape, enc.dtype, enc.device, keys, dict(enc.meta))))
        self.tensors.extend(parts)
        return len(self.layout) - 1

    def _report(self, site: str, parts: list[torch.Tensor]) -> None:
        if self.report is None:
            return
        fresh, nbytes = [], 0
        for t in parts:
            st = t.untyped_storage()
            if id(st) in self._seen:
                continue
            self._seen.add(id(st))
            fresh.append(t)
            nbytes += st.nbytes()
        if fresh:
            self.report(site, fresh, nbytes)

    def save(self, ctx) -> None:
        ctx.save_for_backward(*self.tensors)
        ctx.stash_layout = self.layout


def restore(ctx, saved: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """The entries, decoded, in the order they were added."""
    saved = ctx.saved_tensors if saved is None else saved
    out = []
    for start, count, how in ctx.stash_layout:
        parts = saved[start:start + count]
        if how is None:
            out.append(parts[0])
            continue
        codec, name, shape, dtype, device, keys, meta = how
        enc = Encoded(name, shape, dtype, device, dict(zip(keys, parts)), meta)
        out.append(codec.decode(enc))
    return out


def is_lossy(codec: Optional[Codec]) -> bool:
    return codec is not None and not codec.lossless
