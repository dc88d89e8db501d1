"""DIVISION dual precision (1-D, along tokens), Triton kernels; the spec is `dual_ref`.

Encode is one kernel: each program owns BLOCK_C channels of the [s, C] matrix and walks
all tokens twice, [POOL_P, BLOCK_C] tiles one pool block at a time (coalesced along C):
pass 1 computes the LFC (stored) and the residual's per-channel min/max and non-finite
flag, then zero/step; pass 2 recomputes the LFC of each tile (cheaper than re-reading it),
rounds the residual stochastically and packs the codes. Decode is elementwise over
[BLOCK_S, BLOCK_C] tiles. bfloat16 roundings are done with bit operations so the
interpreter (which truncates float32 -> bfloat16) and GPUs agree, and the codec's own
bfloat16 tensors (LFC, zero, step, a bfloat16 output) are read and written as int16 bit
patterns (the interpreter's conversions mangle subnormals).

Noise: `noise` [s, C] uniforms (bit-exact with the reference) or a `seed` tensor [1] on
the device, from which the kernel draws `tl.rand` (no host sync, no noise tensor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels.dual_ref import decode_max, num_pool_blocks, row_bytes
from llm_act.kernels.fp8_triton import bf16_bits, bf16_rne, bf16_value

BLOCK_C = 64  # channels per program (a multiple of every 8 // bits)
BLOCK_S = 32  # tokens per decode tile
BF16_MAX: tl.constexpr = tl.constexpr(3.3895313892515355e38)  # dual_ref.BF16_MAX
H_SCALE: tl.constexpr = tl.constexpr(0.25)  # dual_ref.H_SCALE


@triton.jit
def _bf16_down(x):
    """largest bfloat16 <= x, as float32 (bit operations)."""
    b = x.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where((b < 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_up(x):
    """smallest bfloat16 >= x, as float32 (bit operations)."""
    b = x.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where((b >= 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P: tl.constexpr):
    """Load pool block `blk` of columns `cols`: (x float32, finite, in-range, bf16 LFC)."""
    r = tl.arange(0, POOL_P)
    rows = blk * pool + r
    inb = (r[:, None] < pool) & (rows[:, None] < s) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    fin = inb & (tl.abs(x) < float("inf"))
    xz = tl.where(fin, x, 0.0)
    cnt = tl.sum(fin.to(tl.float32), axis=0)
    # sum of x / POOL_P: no overflow near the float32 max (exact scaling otherwise)
    mean = tl.sum(xz * (1.0 / POOL_P), axis=0) / tl.maximum(cnt, 1.0) * POOL_P
    mean = tl.where(cnt > 0, mean, 0.0)
    mean = tl.minimum(tl.maximum(mean, -BF16_MAX), BF16_MAX)
    return x, fin, inb, bf16_rne(mean), rows, offs


@triton.jit
def _dual_encode_kernel(
    x_ptr,  # [s, C] input, any float dtype
    noise_ptr,  # [s, C] float32 uniforms (USE_SEED False)
    seed_ptr,  # [1] int64 seed for tl.rand (USE_SEED True)
    lfc_ptr,  # [nb, C] bfloat16 out
    codes_ptr,  # [s, RB] uint8 out
    zero_ptr,  # [C] bfloat16 out
    step_ptr,  # [C] bfloat16 out, negated for channels holding non-finite values
    s, C, pool, nb, RB,
    BITS: tl.constexpr, POOL_P: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_SEED: tl.constexpr,
):
    """LFC = finite mean per pool block; codes = floor((x - LFC - zero) / step + u)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    lo = tl.full([BLOCK_C], float("inf"), tl.float32)
    hi = tl.full([BLOCK_C], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_C], tl.int32)
    for blk in range(0, nb):  # pass 1: LFC, residual range, non-finite flag
        x, fin, inb, lfc, rows, offs = _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P)
        tl.store(lfc_ptr + blk * C + cols, bf16_bits(lfc), mask=cmask)
        h = H_SCALE * x - H_SCALE * lfc[None, :]
        lo = tl.minimum(lo, tl.min(tl.where(fin, h, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(fin, h, float("-inf")), axis=0))
        bad = tl.maximum(bad, tl.max((inb & ~fin).to(tl.int32), axis=0))
    empty = lo > hi
    lo = _bf16_down(tl.where(empty, 0.0, lo))
    hi = _bf16_up(tl.where(empty, 0.0, hi))
    TOP: tl.constexpr = (1 << BITS) - 1
    levels = TOP - bad.to(tl.float32)
    step = _bf16_up((hi - lo) / levels)
    tl.store(zero_ptr + cols, bf16_bits(lo), mask=cmask)
    tl.store(step_ptr + cols, bf16_bits(tl.where(bad > 0, -step, step)), mask=cmask)
    inv_ok = step > 0
    safe = tl.where(inv_ok, step, 1.0)
    if USE_SEED:
        seed = tl.load(seed_ptr)
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    bcols = pid * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    for blk in range(0, nb):  # pass 2: stochastic rounding and packing
        x, fin, inb, lfc, rows, offs = _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P)
        h = tl.where(fin, H_SCALE * x - H_SCALE * lfc[None, :], lo[None, :])  # no NaN reaches the int cast
        r = tl.where(inv_ok[None, :], (h - lo[None, :]) / safe[None, :], 0.0)
        if USE_SEED:
            u = tl.rand(seed, offs.to(tl.int32))
        else:
            u = tl.load(noise_ptr + offs, mask=inb, other=0.0)
        q = tl.minimum(tl.maximum(tl.floor(r + u), 0.0), levels[None, :])
        q = tl.where(fin, q.to(tl.int32), TOP)
        q = tl.where(inb, q, 0)
        q3 = tl.reshape(q, [POOL_P, BLOCK_C // PER, PER]) << shifts[None, None, :]
        packed = tl.sum(q3, axis=2)
        rmask = (tl.arange(0, POOL_P)[:, None] < pool) & (rows[:, None] < s)
        boffs = rows[:, None].to(tl.int64) * RB + bcols[None, :]
        tl.store(codes_ptr + boffs, packed.to(tl.uint8), mask=rmask & (bcols[None, :] < RB))


@triton.jit
def _dual_decode_kernel(
    lfc_ptr,  # [nb, C] bfloat16
    codes_ptr,  # [s, RB] uint8
    zero_ptr,  # [C] bfloat16
    step_ptr,  # [C] bfloat16, negative = channel flagged
    out_ptr,  # [s, C] output dtype
    s, C, pool, RB, big,
    BITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """out = lfc[t // pool] + zero + code * |step|; NaN for the top code of flagged channels."""
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows[:, None] < s) & (cols[None, :] < C)
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(codes_ptr + rows[:, None].to(tl.int64) * RB + (cols // PER)[None, :],
                   mask=m, other=0).to(tl.int32)
    q = (byte >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
    lfc = bf16_value(tl.load(lfc_ptr + (rows // pool)[:, None].to(tl.int64) * C + cols[None, :],
                             mask=m, other=0))
    zero = bf16_value(tl.load(zero_ptr + cols, mask=cols < C, other=0))
    step = bf16_value(tl.load(step_ptr + cols, mask=cols < C, other=0))
    flagged = step.to(tl.int32, bitcast=True) < 0  # the sign bit, -0.0 included
    y = H_SCALE * lfc + zero[None, :] + q.to(tl.float32) * tl.abs(step)[None, :]
    y = tl.minimum(tl.maximum(y, -big * H_SCALE), big * H_SCALE) * (1.0 / H_SCALE)
    y = tl.where(flagged[None, :] & (q == (1 << BITS) - 1), float("nan"), y)
    out_offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    if OUT_BF16:  # out_ptr is an int16 view
        nan = y != y
        bits = bf16_bits(tl.where(nan, 0.0, y))
        tl.store(out_ptr + out_offs, tl.where(nan, 0x7FC0, bits.to(tl.int32)).to(tl.int16),
                 mask=m)
    else:
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=m)


def dual_encode(x2: torch.Tensor, pool: int, bits: int, noise: torch.Tensor | None = None,
                seed: torch.Tensor | None = None):
    """Same contract as `dual_ref.dual_encode_ref`; pass `noise` [s, C] or `seed` [1]."""
    if (noise is None) == (seed is None):
        raise ValueError("dual_encode needs exactly one of `noise` and `seed`")
    x2 = x2.contiguous()
    s, C = x2.shape
    nb, rb = num_pool_blocks(s, pool), row_bytes(C, bits)
    dev = x2.device
    lfc = torch.empty(nb, C, dtype=torch.bfloat16, device=dev)
    codes = torch.empty(s, rb, dtype=torch.uint8, device=dev)
    zero = torch.empty(C, dtype=torch.bfloat16, device=dev)
    step = torch.empty(C, dtype=torch.bfloat16, device=dev)
    if s * C:
        use_seed = seed is not None
        noise_arg = x2 if use_seed else noise.contiguous().float()
        seed_arg = seed if use_seed else zero
        _dual_encode_kernel[(triton.cdiv(C, BLOCK_C),)](
            x2, noise_arg, seed_arg, lfc.view(torch.int16), codes, zero.view(torch.int16),
            step.view(torch.int16), s, C, pool, nb, rb,
            BITS=bits, POOL_P=triton.next_power_of_2(pool), BLOCK_C=BLOCK_C,
            USE_SEED=use_seed)
    return lfc, codes, zero, step


def dual_decode(lfc: torch.Tensor, codes: torch.Tensor, zero: torch.Tensor,
                step: torch.Tensor, pool: int, bits: int, s: int, C: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `dual_ref.dual_decode_ref`."""
    out = torch.empty(s, C, dtype=dtype, device=codes.device)
    if s * C:
        big = decode_max(dtype)
        bf16 = dtype == torch.bfloat16
        grid = (triton.cdiv(s, BLOCK_S), triton.cdiv(C, BLOCK_C))
        _dual_decode_kernel[grid](
            lfc.view(torch.int16), codes, zero.view(torch.int16), step.view(torch.int16),
            out.view(torch.int16) if bf16 else out, s, C, pool, row_bytes(C, bits), big,
            BITS=bits, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, OUT_BF16=bf16)
    return out
