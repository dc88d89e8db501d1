"""DIVISION dual precision (1-D, along tokens), Triton kernels; the spec is `dual_ref`.

Encode is parallel over tokens and channels, two kernels and a tiny torch step between:
- `_dual_stats_kernel`, grid (token chunks, channel blocks): each program walks the pool
  blocks of its token chunk for its BLOCK_C channels; per block it sums the tokens one by
  one (the reference's order), stores the bfloat16 LFC and folds the residual h / 4 of the
  [POOL_P, BLOCK_C] tile into the chunk's per-channel min/max and non-finite flag, which
  it writes as partials [chunks, C];
- torch reduces the partials over chunks (min/max/any: order-free) and turns them into
  zero/step with `dual_ref.channel_params` itself (no host sync);
- `_dual_quant_kernel`, grid (pool-block tiles, channel blocks): reloads x and the stored
  LFC, rounds the residual stochastically and packs the codes.
Decode is elementwise over [BLOCK_S, BLOCK_C] tiles. bfloat16 roundings are done with bit
operations so the interpreter (which truncates float32 -> bfloat16) and GPUs agree, and
the codec's own bfloat16 tensors (LFC, zero, step, a bfloat16 output) are read and
written as int16 bit patterns (the interpreter's conversions mangle subnormals).

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): divisions
are `tl.math.div_rn` with the reference's operands and order; the pooled sum is a
sequential loop over the pool's tokens in the reference's order (`dual_ref.pool_sum`),
not `tl.sum`, whose tree order differs on a GPU; launches pass `EXACT_LAUNCH` (no FMA
contraction, e.g. of `acc + x * (1 / P)` or `lfc / 4 + zero + code * step`).

Noise: `noise` [s, C] uniforms (bit-exact with the reference) or a `seed` tensor [1] on
the device, from which the kernel draws `tl.rand` (no host sync, no noise tensor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.dual_ref import channel_params, decode_max, num_pool_blocks, row_bytes
from llm_act.kernels.fp8_triton import bf16_bits, bf16_rne, bf16_value

BLOCK_C = 64  # channels per program (a multiple of every 8 // bits)
BLOCK_S = 32  # tokens per decode tile
QUANT_ROWS = 32  # tokens (whole pool blocks, at least one) per quantize program
TARGET_PROGRAMS = 1024  # stats programs to aim for (token chunks x channel blocks)
BF16_MAX: tl.constexpr = tl.constexpr(3.3895313892515355e38)  # dual_ref.BF16_MAX
H_SCALE: tl.constexpr = tl.constexpr(0.25)  # dual_ref.H_SCALE


@triton.jit
def _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P: tl.constexpr):
    """Load pool block `blk` of columns `cols`: (x float32, finite, in-range, rows, offsets)."""
    r = tl.arange(0, POOL_P)
    rows = blk * pool + r.to(tl.int64)
    inb = (r[:, None] < pool) & (rows[:, None] < s) & (cols[None, :] < C)
    offs = rows[:, None] * C + cols[None, :]
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    fin = inb & (tl.abs(x) < float("inf"))
    return x, fin, inb, rows, offs


@triton.jit
def _pool_lfc(x_ptr, blk, cols, s, C, pool, POOL_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """bfloat16-rounded LFC (as float32) of pool block `blk`: `dual_ref.dual_stats_ref`'s
    mean, the tokens added one at a time in order (`dual_ref.pool_sum`)."""
    acc = tl.zeros([BLOCK_C], tl.float32)
    cnt = tl.zeros([BLOCK_C], tl.float32)
    cmask = cols < C
    for r in range(0, pool):
        row = blk * pool + r + tl.zeros([1], tl.int64)  # int64 (loop values may be ints)
        m = cmask & (row < s)
        x = tl.load(x_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
        fin = m & (tl.abs(x) < float("inf"))
        # terms of x / POOL_P: no overflow near the float32 max (exact scaling otherwise);
        # padding tokens past s add 0.0, as in the reference
        acc = acc + tl.where(fin, x, 0.0) * (1.0 / POOL_P)
        cnt = cnt + fin.to(tl.float32)
    mean = tl.math.div_rn(acc, tl.maximum(cnt, 1.0)) * POOL_P
    mean = tl.where(cnt > 0, mean, 0.0)
    mean = tl.minimum(tl.maximum(mean, -BF16_MAX), BF16_MAX)
    return bf16_rne(mean)


@triton.jit
def _dual_stats_kernel(
    x_ptr,  # [s, C] input, any float dtype
    lfc_ptr,  # [nb, C] bfloat16 out (int16 view)
    lo_ptr,  # [chunks, C] float32 out: finite min of h / 4 over the chunk (+inf: none)
    hi_ptr,  # [chunks, C] float32 out: finite max of h / 4 over the chunk (-inf: none)
    bad_ptr,  # [chunks, C] int32 out: 1 where the chunk holds a non-finite value
    s, C, pool, nb, blocks_per_chunk,
    POOL_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """LFC of the pool blocks of one token chunk, and the residual's partial statistics."""
    chunk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    lo = tl.full([BLOCK_C], float("inf"), tl.float32)
    hi = tl.full([BLOCK_C], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_C], tl.int32)
    b0 = chunk * blocks_per_chunk
    for blk in range(b0, tl.minimum(b0 + blocks_per_chunk, nb)):
        lfc = _pool_lfc(x_ptr, blk, cols, s, C, pool, POOL_P, BLOCK_C)
        tl.store(lfc_ptr + (blk + tl.zeros([1], tl.int64)) * C + cols, bf16_bits(lfc),
                 mask=cmask)
        x, fin, inb, rows, offs = _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P)
        h = H_SCALE * x - H_SCALE * lfc[None, :]
        lo = tl.minimum(lo, tl.min(tl.where(fin, h, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(fin, h, float("-inf")), axis=0))
        bad = tl.maximum(bad, tl.max((inb & ~fin).to(tl.int32), axis=0))
    out = chunk.to(tl.int64) * C + cols
    tl.store(lo_ptr + out, lo, mask=cmask)
    tl.store(hi_ptr + out, hi, mask=cmask)
    tl.store(bad_ptr + out, bad, mask=cmask)


@triton.jit
def _dual_quant_kernel(
    x_ptr,  # [s, C] input, any float dtype
    noise_ptr,  # [s, C] float32 uniforms (USE_SEED False)
    seed_ptr,  # [1] int64 seed for tl.rand (USE_SEED True)
    lfc_ptr,  # [nb, C] bfloat16 (int16 view), written by the stats kernel
    zero_ptr,  # [C] float32: zero of h / 4 (a bfloat16 value)
    step_ptr,  # [C] float32: step of h / 4 (>= 0, a bfloat16 value)
    bad_ptr,  # [C] int32: 1 for channels holding a non-finite value
    codes_ptr,  # [s, RB] uint8 out
    s, C, pool, nb, RB,
    BITS: tl.constexpr, POOL_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCKS: tl.constexpr,
    USE_SEED: tl.constexpr,
):
    """codes = clamp(floor((h / 4 - zero) / step + u), 0, levels) for BLOCKS pool blocks."""
    pc = tl.program_id(1)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    lo = tl.load(zero_ptr + cols, mask=cmask, other=0.0)
    step = tl.load(step_ptr + cols, mask=cmask, other=0.0)
    bad = tl.load(bad_ptr + cols, mask=cmask, other=0)
    TOP: tl.constexpr = (1 << BITS) - 1
    levels = TOP - bad.to(tl.float32)
    inv_ok = step > 0
    safe = tl.where(inv_ok, step, 1.0)
    if USE_SEED:
        seed = tl.load(seed_ptr)
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    bcols = pc * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    for i in tl.static_range(BLOCKS):
        blk = tl.program_id(0) * BLOCKS + i
        x, fin, inb, rows, offs = _pool_tile(x_ptr, blk, cols, s, C, pool, POOL_P)
        blk_c = blk + tl.zeros([BLOCK_C], tl.int64)
        lfc = bf16_value(tl.load(lfc_ptr + blk_c * C + cols, mask=cmask & (blk_c < nb),
                                 other=0))
        # non-finite lanes take `lo`: no NaN reaches min/max or the int cast
        h = tl.where(fin, H_SCALE * x - H_SCALE * lfc[None, :], lo[None, :])
        r = tl.where(inv_ok[None, :], tl.math.div_rn(h - lo[None, :], safe[None, :]), 0.0)
        if USE_SEED:
            u = tl.rand(seed, offs.to(tl.int32))
        else:
            u = tl.load(noise_ptr + offs, mask=inb, other=0.0)
        q = tl.minimum(tl.maximum(tl.floor(r + u), 0.0), levels[None, :])
        q = tl.where(fin, q.to(tl.int32), TOP)
        q = tl.where(inb, q, 0)
        q3 = tl.reshape(q, [POOL_P, BLOCK_C // PER, PER]) << shifts[None, None, :]
        packed = tl.sum(q3, axis=2)  # integers: exact in any order
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
    if s * C == 0:
        return (lfc, codes, torch.empty(C, dtype=torch.bfloat16, device=dev),
                torch.empty(C, dtype=torch.bfloat16, device=dev))
    pool_p = triton.next_power_of_2(pool)
    col_blocks = triton.cdiv(C, BLOCK_C)
    # stats: enough token chunks to fill the GPU with the channel blocks; partials are
    # [chunks, C], a small fraction of x
    per_chunk = triton.cdiv(nb, max(1, min(nb, triton.cdiv(TARGET_PROGRAMS, col_blocks))))
    chunks = triton.cdiv(nb, per_chunk)
    lo = torch.empty(chunks, C, dtype=torch.float32, device=dev)
    hi = torch.empty_like(lo)
    bad = torch.empty(chunks, C, dtype=torch.int32, device=dev)
    _dual_stats_kernel[(chunks, col_blocks)](
        x2, lfc.view(torch.int16), lo, hi, bad, s, C, pool, nb, per_chunk,
        POOL_P=pool_p, BLOCK_C=BLOCK_C, **EXACT_LAUNCH)
    bad = bad.amax(0) > 0
    zero, step = channel_params(lo.amin(0), hi.amax(0), bad, bits)  # the reference's own
    use_seed = seed is not None
    blocks = max(1, QUANT_ROWS // pool_p)
    _dual_quant_kernel[(triton.cdiv(nb, blocks), col_blocks)](
        x2, x2 if use_seed else noise.contiguous().float(), seed if use_seed else step,
        lfc.view(torch.int16), zero, step, bad.to(torch.int32), codes, s, C, pool, nb, rb,
        BITS=bits, POOL_P=pool_p, BLOCK_C=BLOCK_C, BLOCKS=blocks, USE_SEED=use_seed,
        **EXACT_LAUNCH)
    return (lfc, codes, zero.to(torch.bfloat16),
            torch.where(bad, -step, step).to(torch.bfloat16))


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
            BITS=bits, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, OUT_BF16=bf16, **EXACT_LAUNCH)
    return out
