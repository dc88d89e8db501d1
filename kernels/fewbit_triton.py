"""Few-bit derivative code Triton kernels; the spec (layout, NaN handling) is `fewbit_ref`.

Encode is one pass: one program reads GROUPS x 128 elements, finds each bucket by a
`bits`-step binary search in the (tiny, cached) cut table, marks the groups holding
non-finite values, writes their flag byte and packs 8 codes into `bits` bytes. Decode
gathers the (at most two) bytes holding each code, looks the code up in the level table
(cast to the output dtype on the host: no float conversion in the kernel, so the
interpreter's truncating bfloat16 cast never matters) and writes NaN where flagged.
No host synchronisation. No float arithmetic at all (compares, gathers and bit
operations), so nothing depends on GPU rounding; launches still pass `EXACT_LAUNCH`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.fewbit_ref import GROUP, code_bytes, flag_bytes

GROUPS = 8  # flag groups per encode program: their 8 flag bits make one byte
DECODE_BLOCK = 1024


@triton.jit
def _fewbit_encode_kernel(
    x_ptr,  # [n] input, any float dtype
    cuts_ptr,  # [2**BITS - 1] float32 sorted interior cut points
    code_ptr,  # [code_bytes(n, BITS)] uint8 packed codes
    flag_ptr,  # [flag_bytes(n)] uint8 group flags
    n, nbytes,
    BITS: tl.constexpr, BYTES_P2: tl.constexpr, SYMMETRIC: tl.constexpr,
    GROUP: tl.constexpr, GROUPS: tl.constexpr,
):
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = GROUP * GROUPS
    offs = (pid.to(tl.int64) * BLOCK + tl.arange(0, GROUPS)[:, None] * GROUP
            + tl.arange(0, GROUP)[None, :])
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SYMMETRIC:
        t = tl.abs(x)
    else:
        t = x
    # binary search: code = #{cuts < t}; NaN compares false and ends at 0 (replaced below)
    code = tl.zeros([GROUPS, GROUP], dtype=tl.int32)
    for s in tl.static_range(BITS):
        probe = code + (1 << (BITS - 1 - s))
        c = tl.load(cuts_ptr + probe - 1)
        code = tl.where(t > c, probe, code)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    gflag = tl.max(bad.to(tl.int32), axis=1)  # [GROUPS]
    flagged = gflag[:, None] > 0
    TOP: tl.constexpr = (1 << BITS) - 1
    SPARE: tl.constexpr = TOP - 1 if BITS > 1 else 0
    code = tl.where(flagged & (code == TOP), SPARE, code)
    code = tl.where(bad, TOP, code)
    code = tl.where(mask, code, 0)  # the tail of the last word is zero, as in the reference
    fbyte = tl.sum(gflag << tl.arange(0, GROUPS), axis=0)
    tl.store(flag_ptr + pid, fbyte.to(tl.uint8))
    if BITS == 8:
        tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
    else:
        WORDS: tl.constexpr = BLOCK // 8
        code8 = tl.reshape(code, [WORDS, 8]).to(tl.int64)
        word = tl.sum(code8 << (tl.arange(0, 8) * BITS).to(tl.int64)[None, :], axis=1)
        k = tl.arange(0, BYTES_P2)
        byte = (word[:, None] >> (k * 8).to(tl.int64)[None, :]) & 0xFF
        boffs = (pid.to(tl.int64) * (WORDS * BITS) + tl.arange(0, WORDS)[:, None] * BITS
                 + k[None, :])
        tl.store(code_ptr + boffs, byte.to(tl.uint8),
                 mask=(k[None, :] < BITS) & (boffs < nbytes))


@triton.jit
def _fewbit_decode_kernel(
    code_ptr,  # [nbytes] uint8 packed codes
    flag_ptr,  # [flag_bytes(n)] uint8 group flags
    levels_ptr,  # [2**BITS] table values, already in the output dtype
    out_ptr,  # [n] output dtype
    n, nbytes,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bit = offs * BITS
    byte = bit >> 3
    lo = tl.load(code_ptr + byte, mask=mask, other=0).to(tl.int32)
    hi = tl.load(code_ptr + byte + 1, mask=mask & (byte + 1 < nbytes), other=0).to(tl.int32)
    TOP: tl.constexpr = (1 << BITS) - 1
    code = ((lo | (hi << 8)) >> (bit & 7).to(tl.int32)) & TOP
    g = offs // GROUP
    f = (tl.load(flag_ptr + (g >> 3), mask=mask, other=0).to(tl.int32) >> (g & 7).to(tl.int32)) & 1
    v = tl.load(levels_ptr + code, mask=mask, other=0.0)
    v = tl.where((f == 1) & (code == TOP), float("nan"), v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def fewbit_encode(
    x: torch.Tensor, cuts: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fewbit_ref.fewbit_encode_ref`."""
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    cuts = cuts.to(device=x.device, dtype=torch.float32).contiguous()
    nbytes = code_bytes(n, bits)
    codes = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    flags = torch.empty(flag_bytes(n), dtype=torch.uint8, device=x.device)
    if n:
        grid = (triton.cdiv(n, GROUP * GROUPS),)
        _fewbit_encode_kernel[grid](
            flat, cuts, codes, flags, n, nbytes,
            BITS=bits, BYTES_P2=triton.next_power_of_2(bits), SYMMETRIC=bool(symmetric),
            GROUP=GROUP, GROUPS=GROUPS, **EXACT_LAUNCH)
    return codes, flags


def fewbit_decode(
    packed: torch.Tensor,
    flags: torch.Tensor,
    levels: torch.Tensor,
    bits: int,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Same contract as `fewbit_ref.fewbit_decode_ref`."""
    # the table is cast on the host (float32 -> dtype, as the reference does), so the
    # kernel only gathers and never converts floats
    levels = levels.to(device=packed.device, dtype=torch.float32).to(dtype).contiguous()
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if n:
        grid = (triton.cdiv(n, DECODE_BLOCK),)
        _fewbit_decode_kernel[grid](
            packed, flags, levels, out, n, packed.numel(),
            BITS=bits, GROUP=GROUP, BLOCK=DECODE_BLOCK, **EXACT_LAUNCH)
    return out
