"""Bit packing of small unsigned codes into bytes (pure-torch reference).

`bits` in {1, 2, 4, 8}: 8 // bits codes per byte, code j of a byte in bits
[j*bits, (j+1)*bits) (little-endian within the byte). The code count is padded up to a
multiple of 8 // bits with zeros.
"""
from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def packed_numel(n: int, bits: int) -> int:
    per = 8 // bits
    return (n + per - 1) // per


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flatten `codes` (integers in [0, 2**bits)) into a uint8 tensor of packed bytes."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat.clone()
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    flat = flat.view(-1, per)
    shifts = torch.arange(0, 8, bits, device=flat.device, dtype=torch.uint8)
    return (flat << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `n` codes as uint8."""
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    if bits == 8:
        return packed[:n]
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    codes = (packed.view(-1, 1) >> shifts) & mask
    return codes.reshape(-1)[:n]
