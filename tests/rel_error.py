"""The relative error the tests compare gradients and outputs by (torch only, so a torch-only
test can use it without importing megatron-core)."""
from __future__ import annotations

from typing import Mapping, Sequence, Union

import torch

Tensors = Union[torch.Tensor, Mapping[str, torch.Tensor], Sequence[torch.Tensor]]


def rel_error(got: Tensors, ref: Tensors) -> float:
    """||got - ref|| / ||ref||, in float64: of one tensor, or of a dict or list of tensors taken
    together (one norm over all of `ref`'s entries). A zero `ref` gives 0 where `got` is zero
    too and a huge number where it is not, never a division by zero."""
    if isinstance(ref, torch.Tensor):
        pairs = [(got, ref)]
    elif isinstance(ref, Mapping):
        pairs = [(got[k], ref[k]) for k in ref]
    else:
        pairs = list(zip(got, ref, strict=True))
    num = sum(float((g.detach().double() - r.detach().double()).pow(2).sum()) for g, r in pairs)
    den = sum(float(r.detach().double().pow(2).sum()) for _, r in pairs)
    return (num / max(den, 1e-60)) ** 0.5
