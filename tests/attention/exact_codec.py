"""A codec flagged lossy whose decode is x bit for bit: it sends a tensor down the lossy-Q/K/V
paths (and the output projection's encoded path) with nothing lost, so those paths can be
compared with each other and with exact references to float tolerance."""
from __future__ import annotations

import math

import torch

from llm_act.codecs.base import Codec, Encoded


class ExactLossy(Codec):
    name = "exact_test"
    lossless = False  # take the lossy paths
    keeps_nonfinite = False

    def _encode(self, x: torch.Tensor) -> Encoded:
        return Encoded(self.name, x.shape, x.dtype, x.device, {"x": x.clone()})

    def _decode(self, enc: Encoded) -> torch.Tensor:
        return enc.data["x"].clone()

    def nbytes_for(self, shape, dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
