"""DIVISION's dual precision along tokens (1-D), pure-torch reference: the spec of the kernels.

A tensor is read as a matrix `x2` of shape [s, C]: s tokens (the pooled dimension) by C
channels (every other index, e.g. (b, h) of megatron's [s, b, h]). DIVISION (sec. 4.1,
App. F) adapted to 1-D:

- LFC: the mean of each block of `pool` consecutive tokens per channel (the last block
  averages what is there; non-finite values are left out of the mean, a block with none
  finite has LFC 0), rounded to bfloat16 (nearest even): lfc [ceil(s / pool), C].
- HFC: h = x - upsample(lfc) (nearest: token t uses block t // pool), float32.
- Per channel and chunk of tokens (DIVISION's per-channel quantization, per chunk so that
  the kernel is one pass; see below): zero = min h, step = (max h - min h) / (2^bits - 1)
  over the chunk's tokens, both stored as bfloat16 as in the paper, rounded outward (zero
  down, max up, step up) so every h lies in [zero, zero + levels * step] and stochastic
  rounding stays unbiased. Codes: floor((h - zero) / step + u), u ~ U[0, 1).
  A chunk is `chunk_blocks(pool)` pool blocks: CHUNK_TOKENS = 256 tokens rounded down to
  whole blocks of the pool rounded up to a power of two (32 blocks of 8 at the default
  pool): zero and step are bfloat16 [chunks, C].
- Non-finite inputs: a chunk's channel holding one stores its step negated (sign bit =
  flag); its finite values use codes 0 .. 2^bits - 2 (step = range / (2^bits - 2)) and
  code 2^bits - 1 decodes to NaN.
- Codes are packed along channels, 8 // bits per byte (`packing_ref` layout), each token
  row padded to whole bytes: codes [s, ceil(C * bits / 8)].

Decode: upsample(lfc) + zero + code * |step|, in float32, clamped to the output dtype's
finite range, NaN for the flagged code.

Finite in, finite out: sums, residuals and ranges of values near the float32 maximum
would overflow, so the block sum is taken of x / P (P = pool rounded up to a power of
two) and the residual is h / 4 (stored zero and step are those of h / 4, whose range
fits float32); the LFC is clamped to the bfloat16 range before rounding. Scaling by a
power of two is exact for normal numbers, so nothing changes where nothing overflows.

Order of the float operations (the kernels follow it exactly, see `llm_act.kernels`): the
block sum adds the pool's tokens one at a time in token order, starting from 0.0 (padding
tokens past s add 0.0), each term rounded as x / P (no fused multiply-add); then
mean = sum / count * P with a correctly rounded division. The per-chunk zero/step are
`channel_params` of the finite min/max of h / 4 over the chunk's tokens.

Why chunks (issue 26): whole-tensor statistics per channel need all of x before any code,
i.e. a second read of x; with statistics per chunk of 256 tokens a program holds the
chunk's tokens for a few channels in registers and encodes them in one pass. What it
stores: 4 bytes per channel per chunk, 1/64 byte per element at 256 tokens per chunk
(whole-tensor: 4 bytes per channel, 4 / s per element); what it adds to the error:
nothing, it takes some away: a chunk's residual range is at most the whole range.
"""
from __future__ import annotations

import torch

from llm_act.kernels.int_quant_ref import seeded_noise
from llm_act.kernels.nonfinite_ref import record_side_list
from llm_act.kernels.packing_ref import pack_bits, unpack_bits

BITS_ALLOWED = (2, 4, 8)
CHUNK_TOKENS = 256  # tokens per chunk of the zero/step statistics (whole pool blocks)


def row_bytes(C: int, bits: int) -> int:
    return -(-C * bits // 8)


def num_pool_blocks(s: int, pool: int) -> int:
    return -(-s // pool)


def bf16_down(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest bfloat16 value <= x (as float32), by bit operations."""
    b = x.float().view(torch.int32)
    t = b & -65536
    t = torch.where((b < 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.view(torch.float32)


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest bfloat16 value >= x (as float32), by bit operations."""
    b = x.float().view(torch.int32)
    t = b & -65536
    t = torch.where((b >= 0) & ((b & 0xFFFF) != 0), t + 0x10000, t)
    return t.view(torch.float32)


BF16_MAX = torch.finfo(torch.bfloat16).max
FMAX = torch.finfo(torch.float32).max
H_SCALE = 0.25  # the residual is quantized as h * H_SCALE, so its range fits float32


def pool_pow2(pool: int) -> int:
    """`pool` rounded up to a power of two: block sums are taken of x / pool_pow2."""
    return 1 << (pool - 1).bit_length()


def decode_max(dtype: torch.dtype) -> float:
    """Decoded values are clamped to +-this: the dtype's max, float32's for wider ones."""
    return min(torch.finfo(dtype).max, FMAX)


def chunk_blocks(pool: int) -> int:
    """Pool blocks per chunk: CHUNK_TOKENS tokens of pool_pow2(pool) (at least one block)."""
    return max(1, CHUNK_TOKENS // pool_pow2(pool))


def num_chunks(s: int, pool: int) -> int:
    """Chunks of s tokens (zero/step rows)."""
    return -(-num_pool_blocks(s, pool) // chunk_blocks(pool))


def token_chunk(s: int, pool: int, device=None) -> torch.Tensor:
    """int64 [s]: the chunk of each token."""
    return torch.arange(s, device=device) // pool // chunk_blocks(pool)


def upsample(lfc: torch.Tensor, pool: int, s: int) -> torch.Tensor:
    """[s, C] float32: token t gets lfc[t // pool]."""
    return lfc.float().repeat_interleave(pool, dim=0)[:s]


def pool_sum(xp: torch.Tensor, inv_p2: float) -> torch.Tensor:
    """[nb, C] sums over dim 1 of `xp` [nb, pool, C] times `inv_p2`, token by token in
    order from 0.0: the order the kernel adds in (a tree or vector sum would round
    differently)."""
    acc = torch.zeros_like(xp[:, 0, :])
    for i in range(xp.shape[1]):
        acc = acc + xp[:, i, :] * inv_p2
    return acc


def channel_params(lo: torch.Tensor, hi: torch.Tensor, bad: torch.Tensor, bits: int):
    """(zero, step >= 0), float32 [C] bfloat16 values, from the finite min `lo` / max `hi`
    of h / 4 per channel (lo > hi: no finite value) and the non-finite flag `bad`."""
    empty = lo > hi
    lo = bf16_down(torch.where(empty, torch.zeros_like(lo), lo))
    hi = bf16_up(torch.where(empty, torch.zeros_like(hi), hi))
    levels = (1 << bits) - 1 - bad.float()
    return lo, bf16_up((hi - lo) / levels)


def dual_stats_ref(x2: torch.Tensor, pool: int, bits: int):
    """(lfc bf16 [nb, C], h / 4 float32 [s, C], finite bool [s, C], zero float32 [chunks, C],
    step float32 [chunks, C] (>= 0), bad bool [chunks, C]): everything but the rounding;
    zero and step are those of h / 4 over each chunk's tokens."""
    s, C = x2.shape
    xf = x2.float()
    fin = torch.isfinite(xf)
    xz = torch.where(fin, xf, torch.zeros_like(xf))
    nb = num_pool_blocks(s, pool)
    pad = nb * pool - s
    xp = torch.cat([xz, xz.new_zeros(pad, C)]).view(nb, pool, C)
    cnt = torch.cat([fin, fin.new_zeros(pad, C)]).view(nb, pool, C).sum(dim=1).float()
    p2 = pool_pow2(pool)
    mean = pool_sum(xp, 1.0 / p2) / cnt.clamp(min=1) * float(p2)
    mean = torch.where(cnt > 0, mean, torch.zeros_like(cnt))
    lfc = mean.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)
    h = H_SCALE * xf - H_SCALE * upsample(lfc, pool, s)
    K = num_chunks(s, pool)
    big = torch.finfo(torch.float32).max
    per = chunk_blocks(pool) * pool  # tokens per chunk

    def chunked(t, fill):
        return torch.cat([t, t.new_full((K * per - s, C), fill)]).view(K, per, C)

    lo = chunked(torch.where(fin, h, torch.full_like(h, big)), big).amin(dim=1)
    hi = chunked(torch.where(fin, h, torch.full_like(h, -big)), -big).amax(dim=1)
    bad = ~chunked(fin, True).all(dim=1)
    lo, step = channel_params(lo, hi, bad, bits)
    return lfc, h, fin, lo, step, bad


def dual_encode_ref(
    x2: torch.Tensor, pool: int, bits: int,
    noise: torch.Tensor | None = None, seed: int | None = None,
    state: torch.Tensor | None = None, nf_index: torch.Tensor | None = None,
    nf_value: torch.Tensor | None = None, nf_count: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lfc bf16 [nb, C], codes uint8 [s, row_bytes], zero bf16 [chunks, C], step bf16
    [chunks, C] signed) of the [s, C] matrix `x2`, with uniforms `noise` [s, C] for the
    stochastic rounding, or a `seed` (an int) to draw them from
    (`int_quant_ref.seeded_noise`): exactly one of the two. With `state`, x2's non-finite
    values go to the side-list buffers `nf_*` (`nonfinite_ref`)."""
    if (noise is None) == (seed is None):
        raise ValueError("dual_encode needs exactly one of `noise` and `seed`")
    record_side_list(x2, state, nf_index, nf_value, nf_count)
    s, C = x2.shape
    if noise is None:
        noise = seeded_noise(seed, s * C, x2.device)
    noise = noise.reshape(s, C)
    lfc, h, fin, lo, step, bad = dual_stats_ref(x2, pool, bits)
    chunk = token_chunk(s, pool, x2.device)
    lo_t, step_t = lo[chunk], step[chunk]
    top = (1 << bits) - 1
    levels = top - bad[chunk].float()
    r = torch.where(step_t > 0, (h - lo_t) / torch.where(step_t > 0, step_t, 1.0),
                    torch.zeros_like(h))
    q = torch.minimum(torch.floor(r + noise.float()).clamp(min=0), levels)
    q = torch.where(fin, q, torch.full_like(q, top)).to(torch.uint8)
    per = 8 // bits
    qp = torch.cat([q, q.new_zeros(s, (-C) % per)], dim=1)
    codes = pack_bits(qp, bits).view(s, row_bytes(C, bits))
    signed = torch.where(bad, -step, step)
    return lfc, codes, lo.to(torch.bfloat16), signed.to(torch.bfloat16)


def dual_decode_ref(lfc: torch.Tensor, codes: torch.Tensor, zero: torch.Tensor,
                    step: torch.Tensor, pool: int, bits: int, s: int, C: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """[s, C] tensor of `dtype`: upsample(lfc) + zero + code * |step| (NaN where flagged),
    computed as (upsample(lfc) / 4 + zero + code * |step|) * 4 with the stored h / 4 zero
    and step of each token's chunk."""
    rb = row_bytes(C, bits)
    q = unpack_bits(codes.reshape(-1), bits, s * rb * (8 // bits)).view(s, -1)[:, :C]
    chunk = token_chunk(s, pool, codes.device)
    stepf = step.float()[chunk]
    y = H_SCALE * upsample(lfc, pool, s) + zero.float()[chunk] + q.float() * stepf.abs()
    lim = decode_max(dtype) * H_SCALE  # clamp before scaling back: no Inf on the way
    y = y.clamp(-lim, lim) * (1.0 / H_SCALE)
    nan = torch.signbit(stepf) & (q == (1 << bits) - 1)
    y = torch.where(nan, torch.full_like(y, float("nan")), y)
    return y.to(dtype)
