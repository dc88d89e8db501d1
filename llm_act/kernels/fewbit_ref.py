"""Few-bit derivative codes (Few-Bit Backward, sec. 3), pure-torch reference: the spec.

Encode: each element's bucket in a piecewise-constant table of f', found by comparing
t = x (or |x| when f' is even, the table then covers |x|) in float32 with the table's
2**bits - 1 interior cut points: code = #{cuts < t}, so intervals are (s_k, s_{k+1}]
and values beyond the cuts fall into the first or last bucket. The cuts are float32
numbers, so the float32 comparison is exact for float32/float16/bfloat16 inputs.

Codes are packed tightly as a little-endian bit stream: code i occupies bits
[i*bits, (i+1)*bits) of the byte string, i.e. 8 codes fill `bits` bytes and a tensor of
n codes takes ceil(n*bits/8) bytes. For bits in {1, 2, 4, 8} this is exactly the layout of
`packing_ref.pack_bits`; bits=3 packs 8 codes into 3 bytes (no 4-bit slots).

Non-finite inputs: one flag bit per group of 128 consecutive elements (bit-packed like
`pack_bits(..., 1)`) marks groups holding a NaN or +-Inf. In a flagged group the top code
R = 2**bits - 1 means "non-finite" and finite elements whose bucket is R are stored as
R - 1 (those groups produce a NaN gradient anyway, so the merged bucket costs nothing that
matters). Decode: levels[code] in float32, NaN where the group is flagged and code == R,
cast to the output dtype. The side data is ceil(ceil(n/128)/8) bytes: 1/128 bit/element.
"""
from __future__ import annotations

import torch

from llm_act.kernels.packing_ref import pack_bits, unpack_bits

GROUP = 128  # elements per non-finite flag bit


def code_bytes(n: int, bits: int) -> int:
    """Bytes of n tightly packed `bits`-bit codes."""
    return (n * bits + 7) // 8


def flag_bytes(n: int) -> int:
    """Bytes of the non-finite group flags of n elements (one bit per GROUP elements)."""
    groups = (n + GROUP - 1) // GROUP
    return (groups + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (integers in [0, 2**bits)) -> uint8 little-endian bit stream, code_bytes long."""
    flat = codes.reshape(-1).to(torch.int64)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, device=flat.device, dtype=torch.int64) * bits
    words = (flat.view(-1, 8) << shifts).sum(dim=1)  # 8 codes -> one 8*bits-bit word
    byte_shifts = torch.arange(bits, device=flat.device, dtype=torch.int64) * 8
    stream = ((words[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return stream[: code_bytes(n, bits)].clone()


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the first n codes as int64."""
    stream = packed.reshape(-1).to(torch.int64)
    pad = (-stream.numel()) % bits
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    byte_shifts = torch.arange(bits, device=stream.device, dtype=torch.int64) * 8
    words = (stream.view(-1, bits) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=stream.device, dtype=torch.int64) * bits
    codes = (words[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n]


def _group_flags(bad: torch.Tensor) -> torch.Tensor:
    """Per-GROUP 'contains a non-finite value' flags of a flat bool tensor."""
    pad = (-bad.numel()) % GROUP
    if pad:
        bad = torch.cat([bad, bad.new_zeros(pad)])
    return bad.view(-1, GROUP).any(dim=1)


def fewbit_encode_ref(
    x: torch.Tensor, cuts: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype) -> (packed codes uint8[code_bytes], group flags uint8[flag_bytes]).

    `cuts`: float32, sorted, 2**bits - 1 interior cut points (of |x| when `symmetric`).
    """
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    t = flat.abs() if symmetric else flat
    codes = torch.bucketize(t, cuts.to(torch.float32), right=False)  # #{cuts < t}
    bad = ~torch.isfinite(flat)
    flags = _group_flags(bad)
    in_flagged = flags.repeat_interleave(GROUP)[:n]
    top = (1 << bits) - 1
    codes = torch.where(in_flagged & (codes == top), max(top - 1, 0), codes)
    codes = torch.where(bad, top, codes)
    return pack_codes(codes, bits), pack_bits(flags, 1)


def fewbit_decode_ref(
    packed: torch.Tensor,
    flags: torch.Tensor,
    levels: torch.Tensor,
    bits: int,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Codes -> flat tensor of n table values levels[code] (float32 table) in `dtype`."""
    codes = unpack_codes(packed, bits, n)
    groups = (n + GROUP - 1) // GROUP
    in_flagged = unpack_bits(flags, 1, groups).bool().repeat_interleave(GROUP)[:n]
    out = levels.to(torch.float32)[codes]
    out = torch.where(in_flagged & (codes == (1 << bits) - 1), float("nan"), out)
    return out.to(dtype)
