"""The codecs a compressed module (`ActModule`) gets around a recomputed site.

A consumer stores its tensors through a codec; recomputation fits that path with two
pseudo-codecs instead of a second mechanism. `SiteRecompute` is the choice "recompute": its
"encode" stores a ticket (0 bytes) on the layer's per-forward frame, its "decode" asks the
frame for the rebuilt value. `VisibleKeep` is "keep" for a site a rebuild reads: the record
holds x itself (the bytes stock keeps), where the plain "keep" (no codec: the stock path)
makes no record for the frame to read.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.registry import KEEP, RECOMPUTE


class RecomputeOwner(Protocol):
    """What the recompute codecs and the per-forward frame (`recompute_region`) read of the
    layer's binder (`recompute.LayerRecompute`), declared here so that neither imports it."""

    #: the layer's index, for messages
    index: int
    #: the layer's {site: choice} in force
    choice: Mapping[str, str]
    #: the open per-forward frame (`recompute_region.LayerFrame`), None outside a forward
    frame: Optional[Any]

    def rebuild(self, frame: Any, site: str) -> torch.Tensor:
        """Recompute `site` (and the group of recomputed sites it belongs to) in `frame`."""
        ...


class VisibleKeep(Codec):
    """"keep" through a compressed module: the record holds x itself (same bytes as stock),
    so a recomputation downstream can read it."""

    name = KEEP
    lossless = True

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded(KEEP, x.shape, x.dtype, x.device, {"x": x})

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.data["x"]

    def nbytes_for(self, shape, dtype) -> int:
        return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


class SiteRecompute(Codec):
    """The "recompute" choice as a codec: stores a ticket (0 bytes), decode rebuilds."""

    name = RECOMPUTE
    lossless = True

    def __init__(self, owner: RecomputeOwner, site: str):
        super().__init__(0)
        self.owner, self.site = owner, site

    def encode(self, x: torch.Tensor) -> Encoded:
        frame = self.owner.frame
        if frame is None:
            raise RuntimeError(
                f"site {self.site!r} of layer {self.owner.index}: 'recompute' needs the layer's "
                "forward to run through the TransformerLayer (its hooks open the frame)")
        frame.pending.add(self.site)
        return Encoded(RECOMPUTE, x.shape, x.dtype, x.device, {}, {"frame": frame, "site": self.site})

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.meta["frame"].take(enc.meta["site"])

    def nbytes_for(self, shape, dtype) -> int:
        return 0
