"""Dropout masks packed 8 per byte, pure-torch reference: the spec of the kernels.

Element i of the flattened row-major mask is bit (i % 8) of byte i // 8 (the
`packing_ref` layout with bits=1): set where the mask is nonzero. Unpacking yields 0/1 in
the requested dtype (False/True for bool).
"""
from __future__ import annotations

import torch

from llm_act.kernels.packing_ref import pack_bits, packed_numel, unpack_bits


def mask_nbytes(n: int) -> int:
    return packed_numel(n, 1)


def pack_mask_ref(mask: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(numel / 8)]: bit i % 8 of byte i // 8 is (mask.flatten()[i] != 0)."""
    return pack_bits(mask.reshape(-1) != 0, 1)


def unpack_mask_ref(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Flat [n] tensor of `dtype` holding the first n bits of `packed` as 0/1."""
    return unpack_bits(packed, 1, n).to(dtype)
