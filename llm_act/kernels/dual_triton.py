"""DIVISION dual precision (1-D, along tokens), Triton kernels; the spec is `dual_ref`.

Encode is one launch, one pass over x: a program owns one chunk of tokens (`dual_ref.
chunk_blocks` pool blocks, 256 tokens at pool 8) for BLOCK_C channels, held in registers as
[blocks, POOL_P, BLOCK_C] (POOL_P: the pool rounded up to a power of two). It sums each
block's tokens one at a time in the reference's order (`dual_ref.pool_sum`; token i is
taken out of the tile by a masked sum of one term, which is exact), stores the bfloat16
LFC, reduces the residual h / 4 to the chunk's per-channel min/max and non-finite flag,
computes zero/step (`dual_ref.channel_params` by bit operations), rounds stochastically,
packs the codes along channels, and notes non-finite values in the side list
(`nonfinite_triton`). Decode is one launch over the same tiles: each code byte, LFC value
and zero/step loaded once (bytes as a vector, split by shifts; the LFC broadcast over its
pool block). bfloat16 roundings are done with bit operations so the interpreter (which
truncates float32 -> bfloat16) and GPUs agree, and the codec's own bfloat16 tensors (LFC,
zero, step, a bfloat16 output) are read and written as int16 bit patterns (the
interpreter's conversions mangle subnormals).

Same bits on a GPU as the reference, by construction (see `llm_act.kernels`): divisions
are `tl.math.div_rn` with the reference's operands and order; the pooled sum is a
sequential loop over the pool's tokens in the reference's order, not a tree sum; launches
pass `EXACT_LAUNCH` (no FMA contraction, e.g. of `acc + x * (1 / P)` or
`lfc / 4 + zero + code * step`).

Noise: `noise` [s, C] uniforms (bit-exact with the reference) or a `seed` (an int): 8
Philox bits per element (`random_triton.uniform8`), keyed by the codec's seed and call
count when a state is passed (no host sync, no noise tensor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_act.kernels import EXACT_LAUNCH
from llm_act.kernels.dual_ref import (chunk_blocks, decode_max, num_chunks, num_pool_blocks,
                                      pool_pow2, row_bytes)
from llm_act.kernels.fp8_triton import bf16_bits, bf16_rne, bf16_value
from llm_act.kernels.int_quant_ref import noise_args
from llm_act.kernels.int_quant_triton import ENCODE_WARPS, rounding_noise
from llm_act.kernels.nonfinite_triton import keep_nonfinite
from llm_act.kernels.nonfinite_ref import nonfinite_args

TILE = 4096  # elements per program
BF16_MAX: tl.constexpr = tl.constexpr(3.3895313892515355e38)  # dual_ref.BF16_MAX
H_SCALE: tl.constexpr = tl.constexpr(0.25)  # dual_ref.H_SCALE


@triton.jit
def _bf16_down(x):
    """float32 -> the largest bfloat16 value <= x (as float32); `dual_ref.bf16_down`."""
    b = x.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where((b < 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_up(x):
    """float32 -> the smallest bfloat16 value >= x (as float32); `dual_ref.bf16_up`."""
    b = x.to(tl.int32, bitcast=True)
    t = b & -65536
    t = tl.where((b >= 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _chunk_tile(s, C, pool, nb, BLOCKS: tl.constexpr, POOL_P: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """This program's tile: pool blocks [BLOCKS], token offsets in the pool [POOL_P], tokens
    [BLOCKS, POOL_P] and which exist, channels [BLOCK_C] and which exist."""
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    i = tl.arange(0, POOL_P)
    tok = blk[:, None] * pool + i[None, :]
    tval = (i[None, :] < pool) & (tok < s)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return blk, i, tok, tval, cols, cols < C


@triton.jit
def _dual_encode_kernel(
    x_ptr, noise_ptr, seed,
    lfc_ptr,  # [nb, C] bfloat16 out (int16 view)
    codes_ptr,  # [s, RB] uint8 out
    zero_ptr,  # [chunks, C] bfloat16 out (int16 view)
    step_ptr,  # [chunks, C] bfloat16 out (int16 view), negative = flagged
    state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr,
    s, C, pool, nb, RB, cap,
    BITS: tl.constexpr, BLOCKS: tl.constexpr, POOL_P: tl.constexpr, BLOCK_C: tl.constexpr,
    NOISE: tl.constexpr, SIDE: tl.constexpr,
):
    blk, i, tok, tval, cols, cmask = _chunk_tile(s, C, pool, nb, BLOCKS, POOL_P, BLOCK_C)
    valid = tval[:, :, None] & cmask[None, None, :]
    offs = tok[:, :, None] * C + cols[None, None, :]
    raw = tl.load(x_ptr + offs, mask=valid, other=0.0)
    x = raw.to(tl.float32)
    fin = valid & (tl.abs(x) < float("inf"))
    # LFC: terms of x / POOL_P (no overflow near the float32 max; exact scaling otherwise),
    # added token by token in order from 0.0 (`dual_ref.pool_sum`)
    xs = tl.where(fin, x, 0.0) * (1.0 / POOL_P)
    acc = tl.zeros([BLOCKS, BLOCK_C], tl.float32)
    for j in tl.static_range(POOL_P):
        acc = acc + tl.sum(tl.where((i == j)[None, :, None], xs, 0.0), axis=1)
    cnt = tl.sum(fin.to(tl.int32), axis=1).to(tl.float32)
    mean = tl.math.div_rn(acc, tl.maximum(cnt, 1.0)) * POOL_P
    mean = tl.where(cnt > 0, mean, 0.0)
    lfc = bf16_rne(tl.minimum(tl.maximum(mean, -BF16_MAX), BF16_MAX))
    lmask = (blk < nb)[:, None] & cmask[None, :]
    tl.store(lfc_ptr + blk[:, None] * C + cols[None, :], bf16_bits(lfc), mask=lmask)
    # the chunk's residual statistics per channel -> zero, step (`dual_ref.channel_params`)
    h = H_SCALE * x - H_SCALE * lfc[:, None, :]
    lo = tl.min(tl.min(tl.where(fin, h, float("inf")), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(fin, h, float("-inf")), axis=1), axis=0)
    bad = tl.max(tl.max((valid & ~fin).to(tl.int32), axis=1), axis=0)
    empty = lo > hi
    lo = _bf16_down(tl.where(empty, 0.0, lo))
    hi = _bf16_up(tl.where(empty, 0.0, hi))
    TOP: tl.constexpr = (1 << BITS) - 1
    levels = TOP - bad.to(tl.float32)
    step = _bf16_up(tl.math.div_rn(hi - lo, levels))
    poffs = tl.program_id(0).to(tl.int64) * C + cols
    tl.store(zero_ptr + poffs, bf16_bits(lo), mask=cmask)
    tl.store(step_ptr + poffs, bf16_bits(tl.where(bad > 0, -step, step)), mask=cmask)
    # codes = clamp(floor((h / 4 - zero) / step + u), 0, levels); non-finite: the top code
    inv_ok = step > 0
    safe = tl.where(inv_ok, step, 1.0)
    hq = tl.where(fin, h, lo[None, None, :])  # no NaN reaches min/max or the int cast
    r = tl.where(inv_ok[None, None, :], tl.math.div_rn(hq - lo[None, None, :],
                                                       safe[None, None, :]), 0.0)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    u = rounding_noise(noise_ptr, seed, state_ptr, offs, valid, pid, BLOCKS * POOL_P, BLOCK_C,
               NOISE, SIDE)
    u = tl.reshape(u, (BLOCKS, POOL_P, BLOCK_C))
    q = tl.minimum(tl.maximum(tl.floor(r + u), 0.0), levels[None, None, :])
    q = tl.where(fin, q.to(tl.int32), TOP)
    q = tl.where(valid, q, 0)
    PER: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PER) * BITS
    q4 = tl.reshape(q, (BLOCKS, POOL_P, BLOCK_C // PER, PER)) << shifts[None, None, None, :]
    packed = tl.sum(q4, axis=3)  # integers: exact in any order
    bcols = tl.program_id(1) * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    bmask = tval[:, :, None] & (bcols < RB)[None, None, :]
    tl.store(codes_ptr + tok[:, :, None] * RB + bcols[None, None, :], packed.to(tl.uint8),
             mask=bmask)
    keep_nonfinite(raw, offs, valid, state_ptr, nf_index_ptr, nf_value_ptr, nf_count_ptr, cap, SIDE)


@triton.jit
def _dual_decode_kernel(
    lfc_ptr,  # [nb, C] bfloat16 (int16 view)
    codes_ptr,  # [s, RB] uint8
    zero_ptr,  # [chunks, C] bfloat16 (int16 view)
    step_ptr,  # [chunks, C] bfloat16 (int16 view), negative = flagged
    out_ptr,  # [s, C] output dtype (int16 view for bfloat16)
    s, C, pool, nb, RB, big,
    BITS: tl.constexpr, BLOCKS: tl.constexpr, POOL_P: tl.constexpr, BLOCK_C: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """out = lfc[t // pool] + zero + code * |step|; NaN for the top code of flagged channels."""
    blk, i, tok, tval, cols, cmask = _chunk_tile(s, C, pool, nb, BLOCKS, POOL_P, BLOCK_C)
    PER: tl.constexpr = 8 // BITS
    bcols = tl.program_id(1) * (BLOCK_C // PER) + tl.arange(0, BLOCK_C // PER)
    bmask = tval[:, :, None] & (bcols < RB)[None, None, :]
    byte = tl.load(codes_ptr + tok[:, :, None] * RB + bcols[None, None, :], mask=bmask,
                   other=0).to(tl.int32)
    shifts = tl.arange(0, PER) * BITS
    q = (byte[:, :, :, None] >> shifts[None, None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, (BLOCKS, POOL_P, BLOCK_C))
    lmask = (blk < nb)[:, None] & cmask[None, :]
    lfc = bf16_value(tl.load(lfc_ptr + blk[:, None] * C + cols[None, :], mask=lmask, other=0))
    poffs = tl.program_id(0).to(tl.int64) * C + cols
    zero = bf16_value(tl.load(zero_ptr + poffs, mask=cmask, other=0))
    step = bf16_value(tl.load(step_ptr + poffs, mask=cmask, other=0))
    flagged = step.to(tl.int32, bitcast=True) < 0  # the sign bit, -0.0 included
    y = H_SCALE * lfc[:, None, :] + zero[None, None, :] \
        + q.to(tl.float32) * tl.abs(step)[None, None, :]
    y = tl.minimum(tl.maximum(y, -big * H_SCALE), big * H_SCALE) * (1.0 / H_SCALE)
    y = tl.where(flagged[None, None, :] & (q == (1 << BITS) - 1), float("nan"), y)
    valid = tval[:, :, None] & cmask[None, None, :]
    out_offs = tok[:, :, None] * C + cols[None, None, :]
    if OUT_BF16:  # out_ptr is an int16 view
        nan = y != y
        bits = bf16_bits(tl.where(nan, 0.0, y))
        tl.store(out_ptr + out_offs, tl.where(nan, 0x7FC0, bits.to(tl.int32)).to(tl.int16),
                 mask=valid)
    else:
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=valid)


def _tile(s, C, pool):
    """(BLOCKS, POOL_P, BLOCK_C): a tile is one chunk of pool blocks (all of them when
    fewer) by enough channels for about TILE elements (at least 16: whole bytes, and 16
    elements per Philox call)."""
    pool_p = pool_pow2(pool)
    blocks = min(chunk_blocks(pool), triton.next_power_of_2(num_pool_blocks(s, pool)))
    block_c = max(16, min(TILE // (blocks * pool_p), triton.next_power_of_2(C)))
    return blocks, pool_p, block_c


def dual_encode(x2, pool, bits, noise=None, seed=None, state=None, nf_index=None,
                nf_value=None, nf_count=None):
    """Same contract as `dual_ref.dual_encode_ref`, one launch; pass `noise` [s, C] or a
    `seed` (an int)."""
    if (noise is None) == (seed is None):
        raise ValueError("dual_encode needs exactly one of `noise` and `seed`")
    x2 = x2.contiguous()
    s, C = x2.shape
    nb, rb, K = num_pool_blocks(s, pool), row_bytes(C, bits), num_chunks(s, pool)
    dev = x2.device
    lfc = torch.empty(nb, C, dtype=torch.bfloat16, device=dev)
    codes = torch.empty(s, rb, dtype=torch.uint8, device=dev)
    zero = torch.empty(K, C, dtype=torch.bfloat16, device=dev)
    step = torch.empty(K, C, dtype=torch.bfloat16, device=dev)
    if s * C == 0:
        return lfc, codes, zero, step
    mode, noise_t, seed_i = noise_args(x2, noise, seed)
    side, *side_t = nonfinite_args(x2, state, nf_index, nf_value, nf_count)
    blocks, pool_p, block_c = _tile(s, C, pool)
    _dual_encode_kernel[(K, triton.cdiv(C, block_c))](
        x2, noise_t, seed_i, lfc.view(torch.int16), codes, zero.view(torch.int16),
        step.view(torch.int16), *side_t[:4], s, C, pool, nb, rb, side_t[4],
        BITS=bits, BLOCKS=blocks, POOL_P=pool_p, BLOCK_C=block_c, NOISE=mode, SIDE=side,
        num_warps=ENCODE_WARPS, **EXACT_LAUNCH)
    return lfc, codes, zero, step


def dual_decode(lfc, codes, zero, step, pool, bits, s, C, dtype):
    """Same contract as `dual_ref.dual_decode_ref`, one launch."""
    out = torch.empty(s, C, dtype=dtype, device=codes.device)
    if s * C:
        bf16 = dtype == torch.bfloat16
        blocks, pool_p, block_c = _tile(s, C, pool)
        _dual_decode_kernel[(num_chunks(s, pool), triton.cdiv(C, block_c))](
            lfc.view(torch.int16), codes, zero.view(torch.int16), step.view(torch.int16),
            out.view(torch.int16) if bf16 else out, s, C, pool, num_pool_blocks(s, pool),
            row_bytes(C, bits), decode_max(dtype), BITS=bits, BLOCKS=blocks, POOL_P=pool_p,
            BLOCK_C=block_c, OUT_BF16=bf16, **EXACT_LAUNCH)
    return out
