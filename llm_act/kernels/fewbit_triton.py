"""Few-bit derivative code Triton kernels; the spec (layout, NaN handling) is `fewbit_ref`.

Both kernels work on a [GROUPS, 128] tile (GROUPS flag groups: their 8 flag bits make one
byte) and read each stored byte once. The tables are read once per program, not per
element: up to 4 bits (the registry's fewbit1-4) as 2**bits - 1 cut and 2**bits level
scalars, so an element's bucket is a count of the cuts below it (`#{cuts < t}`, compares
only) and its value a chain of selects; wider tables are loaded as one vector and looked
up with `tl.gather` (a binary search of `bits` steps in encode; shared memory on a GPU).

Encode is one pass: it reads x once, marks the groups holding non-finite values, writes
their flag byte and packs 8 codes into `bits` bytes. Decode loads each word's `bits` bytes
as a [words, bytes] tile, joins and shifts them apart into 8 codes (the encode's packing
in reverse), reads its flag byte once, and writes levels[code] (NaN where flagged and
code == 2**bits - 1). The level table is float32 (the reference's arithmetic) and converted
to the output dtype in the kernel: round to nearest even on a GPU, by hand for bfloat16
under the interpreter (`fp8_triton.bf16_rne`: its cast truncates). No float arithmetic
besides compares and that conversion; launches still pass `EXACT_LAUNCH`. No torch op, no
host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.fewbit_ref import GROUP, code_bytes, flag_bytes
from llm_act.kernels import hardware_casts
from llm_act.kernels.fp8_triton import bf16_rne

GROUPS = 8  # flag groups per program: their 8 flag bits make one byte
#: up to this many bits the tables are scalars; wider ones are gathered
SCAN_BITS: tl.constexpr = tl.constexpr(4)


@triton.jit
def _bucket(t, cuts_ptr, BITS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """int32 #{cuts < t} of float32 t [GROUPS, GROUP] (NaN: 0)."""
    if BITS <= SCAN_BITS:
        code = tl.zeros([GROUPS, GROUP], dtype=tl.int32)
        for k in tl.static_range((1 << BITS) - 1):
            code += (t > tl.load(cuts_ptr + k)).to(tl.int32)
    else:  # binary search in the table held by the program
        T: tl.constexpr = 1 << BITS
        i = tl.arange(0, T)
        table = tl.load(cuts_ptr + i, mask=i < T - 1, other=float("inf"))
        tf = tl.reshape(t, [GROUPS * GROUP])
        code = tl.zeros([GROUPS * GROUP], dtype=tl.int32)
        for s in tl.static_range(BITS):
            probe = code + (1 << (BITS - 1 - s))
            code = tl.where(tf > tl.gather(table, probe - 1, 0), probe, code)
        code = tl.reshape(code, [GROUPS, GROUP])
    return code


@triton.jit
def _level(code, levels_ptr, BITS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """float32 levels[code] of int32 codes [GROUPS, GROUP]."""
    if BITS <= SCAN_BITS:
        v = tl.zeros([GROUPS, GROUP], dtype=tl.float32)
        for k in tl.static_range(1 << BITS):
            v = tl.where(code == k, tl.load(levels_ptr + k), v)
    else:
        table = tl.load(levels_ptr + tl.arange(0, 1 << BITS))
        v = tl.gather(table, tl.reshape(code, [GROUPS * GROUP]), 0)
        v = tl.reshape(v, [GROUPS, GROUP])
    return v


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
    code = _bucket(t, cuts_ptr, BITS, GROUPS, GROUP)  # NaN compares false: 0, replaced below
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
    levels_ptr,  # [2**BITS] float32 table values
    out_ptr,  # [n] output dtype
    n, nbytes,
    BITS: tl.constexpr, BYTES_P2: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
    HW: tl.constexpr,
):
    pid = tl.program_id(0)
    BLOCK: tl.constexpr = GROUP * GROUPS
    offs = (pid.to(tl.int64) * BLOCK + tl.arange(0, GROUPS)[:, None] * GROUP
            + tl.arange(0, GROUP)[None, :])
    mask = offs < n
    TOP: tl.constexpr = (1 << BITS) - 1
    if BITS == 8:
        code = tl.load(code_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:  # each word's BITS bytes, loaded once, joined and shifted apart into 8 codes
        WORDS: tl.constexpr = BLOCK // 8
        k = tl.arange(0, BYTES_P2)
        boffs = (pid.to(tl.int64) * (WORDS * BITS) + tl.arange(0, WORDS)[:, None] * BITS
                 + k[None, :])
        byte = tl.load(code_ptr + boffs, mask=(k[None, :] < BITS) & (boffs < nbytes), other=0)
        word = tl.sum(byte.to(tl.int64) << (k * 8).to(tl.int64)[None, :], axis=1)
        code8 = (word[:, None] >> (tl.arange(0, 8) * BITS).to(tl.int64)[None, :]) & TOP
        code = tl.reshape(code8.to(tl.int32), [GROUPS, GROUP])
    fbyte = tl.load(flag_ptr + pid).to(tl.int32)  # this program's 8 groups
    flagged = ((fbyte >> tl.arange(0, GROUPS)) & 1)[:, None] == 1
    v = _level(code, levels_ptr, BITS, GROUPS, GROUP)
    v = tl.where(flagged & (code == TOP), float("nan"), v)
    if not HW:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            v = bf16_rne(v)  # the interpreter's float32 -> bfloat16 cast truncates
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _float32_on(table: torch.Tensor, device) -> torch.Tensor:
    """`table` as a contiguous float32 tensor on `device`; no op when it already is one
    (the codecs keep their tables so)."""
    if table.dtype != torch.float32 or table.device != device or not table.is_contiguous():
        table = table.to(device=device, dtype=torch.float32).contiguous()
    return table


def fewbit_encode(
    x: torch.Tensor, cuts: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `fewbit_ref.fewbit_encode_ref`."""
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    cuts = _float32_on(cuts, x.device)
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
    levels = _float32_on(levels, packed.device)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if n:
        grid = (triton.cdiv(n, GROUP * GROUPS),)
        _fewbit_decode_kernel[grid](
            packed, flags, levels, out, n, packed.numel(),
            BITS=bits, BYTES_P2=triton.next_power_of_2(bits), GROUP=GROUP, GROUPS=GROUPS,
            HW=hardware_casts(), **EXACT_LAUNCH)
    return out
