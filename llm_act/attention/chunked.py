"""Memory-efficient attention in pure torch: flash attention's tiling, for any device.

torch SDPA on CPU falls back to its math path when attention dropout is on and then
stores two s x s tensors per head; this path never stores one. The forward walks query
chunks x key chunks with an online softmax (running max and sum), so only one
[b, heads, chunk, chunk] tile exists at a time; causal tiles above the diagonal are
skipped and the diagonal tiles masked in place (no s x s mask anywhere). Backward
recomputes each tile from q, k, v and the logsumexp (FlashAttention-2's backward).

Dropout: each tile's keep-mask is drawn when the tile is visited, in a fixed order
(query chunk outer, key chunk inner, skipped tiles draw nothing), with the formula of
`RegenMask` (`torch.rand(tile) >= p`). Only the generator state before the first draw is
saved (16 bytes on CUDA, 5056 on CPU); backward replays the same draws from a private
generator set to that state. `chunk_dropout_mask` rebuilds the full mask the same way,
for references. `mask_storage="bitmask"` stores the tile masks packed instead (1 bit per
element; for tests and comparisons only, it is s x s).

Saved for backward: q, k, v as given (GQA: un-expanded), out, logsumexp [b, heads, s]
(float32) and the generator state.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from llm_act.attention import _common as C
from llm_act.attention._stash import Report, Stash, restore
from llm_act.codecs.bitmask import BitMask

DEFAULT_CHUNK = 128
MASK_STORAGES = ("regen", "bitmask")


def _chunks(chunk_size: Union[int, Sequence[int]]) -> tuple[int, int]:
    sizes = (chunk_size, chunk_size) if isinstance(chunk_size, int) else tuple(chunk_size)
    if len(sizes) != 2 or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in sizes):
        raise ValueError(f"chunk_size must be a positive int or a pair of them, got {chunk_size!r}")
    return sizes  # type: ignore[return-value]


def _tiles(s: int, s_k: int, cq: int, ck: int, causal: bool) -> Iterator[tuple[int, int, int, int, bool]]:
    """(qs, qe, ks, ke, needs_causal_mask) in the fixed visiting (and mask-drawing) order.

    Causal = top-left aligned, key j visible to query i when j <= i (torch's `is_causal`).
    """
    for qs in range(0, s, cq):
        qe = min(qs + cq, s)
        for ks in range(0, s_k, ck):
            ke = min(ks + ck, s_k)
            if causal and ks > qe - 1:
                break
            yield qs, qe, ks, ke, causal and ke - 1 > qs


def _causal_fill(scores: torch.Tensor, qs: int, qe: int, ks: int, ke: int, r: int) -> None:
    """Set scores of keys after their query to -inf; scores is [b, g, r*Cq, Ck]."""
    qpos = torch.arange(qs, qe, device=scores.device)
    kpos = torch.arange(ks, ke, device=scores.device)
    hidden = kpos[None, :] > qpos[:, None]
    shape = scores.shape
    scores.view(shape[0], shape[1], r, qe - qs, ke - ks).masked_fill_(hidden, float("-inf"))


def _q_tile(x5: torch.Tensor, qs: int, qe: int, acc: torch.dtype) -> torch.Tensor:
    """[b, g, r, s, d] view -> [b, g, r*Cq, d] copy in the accumulation dtype."""
    b, g, r, _, d = x5.shape
    return x5[:, :, :, qs:qe].to(acc).reshape(b, g, r * (qe - qs), d)


def chunk_dropout_mask(batch: int, heads: int, s: int, s_k: int, p: float,
                       generator: Optional[torch.Generator] = None, device=None,
                       causal: bool = True, chunk_size: Union[int, Sequence[int]] = DEFAULT_CHUNK
                       ) -> torch.Tensor:
    """The full keep-mask [batch, heads, s, s_k] (bool) that `chunked_attention` draws.

    Draws tile by tile in the same order from `generator` (advancing it, as the forward
    does); tiles the causal path skips are left True (they carry zero probability).
    """
    p = C.check_dropout(p)
    cq, ck = _chunks(chunk_size)
    device = torch.device(device) if device is not None else (
        generator.device if generator is not None else torch.device("cpu"))
    gen = C.resolve_generator(generator, device)
    mask = torch.ones(batch, heads, s, s_k, dtype=torch.bool, device=device)
    for qs, qe, ks, ke, _ in _tiles(s, s_k, cq, ck, causal):
        mask[:, :, qs:qe, ks:ke] = C.draw_keep((batch, heads, qe - qs, ke - ks), p, gen, device)
    return mask


MaskSource = Callable[[int, tuple[int, ...]], torch.Tensor]


def chunked_forward(q, k, v, causal: bool, p: float, scale: float,
                    mask_source: Optional[MaskSource], cq: int, ck: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [s, b, heads, d] in q's dtype, logsumexp [b, heads, s] in the accumulation dtype).

    `mask_source(tile_index, shape)` gives each visited tile's keep-mask [b, heads, Cq, Ck]
    (None: no dropout). No autograd: callers wrap it.
    """
    s, s_k, b, h, g, d = C.check_qkv(q, k, v)
    r = h // g
    acc = C.compute_dtype(q.dtype)
    q5, k4, v4 = C.heads_view(q, g), C.groups_view(k), C.groups_view(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, g, r, s, dtype=acc, device=q.device)
    inv_keep = 1.0 / (1.0 - p)
    tile_idx = 0
    for qs, qe, ks, ke, needs_mask in _tiles(s, s_k, cq, ck, causal):
        cqn = qe - qs
        if ks == 0:  # a new query chunk
            qc = _q_tile(q5, qs, qe, acc)
            m = torch.full((b, g, r * cqn), float("-inf"), dtype=acc, device=q.device)
            lsum = torch.zeros_like(m)
            o = torch.zeros(b, g, r * cqn, d, dtype=acc, device=q.device)
        scores = torch.matmul(qc, k4[:, :, ks:ke].to(acc).transpose(-1, -2)).mul_(scale)
        if needs_mask:
            _causal_fill(scores, qs, qe, ks, ke, r)
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        probs = torch.exp(scores.sub_(m_new.unsqueeze(-1)))
        lsum = lsum * alpha + probs.sum(-1)
        if mask_source is not None:
            keep = mask_source(tile_idx, (b, h, cqn, ke - ks)).view(b, g, r * cqn, ke - ks)
            probs = probs.mul_(keep).mul_(inv_keep)
        o = o.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(probs, v4[:, :, ks:ke].to(acc)))
        m = m_new
        tile_idx += 1
        last = ke == s_k or (causal and ke > qe - 1)
        if last:
            o = o / lsum.unsqueeze(-1)
            out[qs:qe] = o.view(b, g, r, cqn, d).permute(3, 0, 1, 2, 4).reshape(cqn, b, h, d)
            lse[:, :, :, qs:qe] = (m + torch.log(lsum)).view(b, g, r, cqn)
    return out, lse.view(b, h, s)


def chunked_backward(q, k, v, out, lse, dout, causal: bool, p: float, scale: float,
                     mask_source: Optional[MaskSource], cq: int, ck: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in the inputs' dtypes; tiles visited in the forward's order."""
    s, s_k, b, h, g, d = C.check_qkv(q, k, v)
    r = h // g
    acc = C.compute_dtype(q.dtype)
    q5, k4, v4 = C.heads_view(q, g), C.groups_view(k), C.groups_view(v)
    o5, do5 = C.heads_view(out, g), C.heads_view(dout, g)
    lse4 = lse.view(b, g, r, s)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros(b, g, s_k, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    inv_keep = 1.0 / (1.0 - p)
    tile_idx = 0
    for qs, qe, ks, ke, needs_mask in _tiles(s, s_k, cq, ck, causal):
        cqn = qe - qs
        if ks == 0:
            qc, doc = _q_tile(q5, qs, qe, acc), _q_tile(do5, qs, qe, acc)
            delta = (doc * _q_tile(o5, qs, qe, acc)).sum(-1, keepdim=True)
            lse_c = lse4[:, :, :, qs:qe].reshape(b, g, r * cqn, 1).to(acc)
            dqc = torch.zeros_like(qc)
        kt, vt = k4[:, :, ks:ke].to(acc), v4[:, :, ks:ke].to(acc)
        scores = torch.matmul(qc, kt.transpose(-1, -2)).mul_(scale)
        if needs_mask:
            _causal_fill(scores, qs, qe, ks, ke, r)
        probs = torch.exp(scores.sub_(lse_c))
        dprobs = torch.matmul(doc, vt.transpose(-1, -2))
        if mask_source is not None:
            keep = mask_source(tile_idx, (b, h, cqn, ke - ks)).view(b, g, r * cqn, ke - ks)
            dropped = probs * keep * inv_keep
            dprobs = dprobs.mul_(keep).mul_(inv_keep)
        else:
            dropped = probs
        dv[:, :, ks:ke] += torch.matmul(dropped.transpose(-1, -2), doc)
        dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
        dqc += torch.matmul(dscores, kt)
        dk[:, :, ks:ke] += torch.matmul(dscores.transpose(-1, -2), qc)
        tile_idx += 1
        if ke == s_k or (causal and ke > qe - 1):
            dq[qs:qe] = dqc.view(b, g, r, cqn, d).permute(3, 0, 1, 2, 4).reshape(cqn, b, h, d)
    dk = dk.permute(2, 0, 1, 3).to(k.dtype)
    dv = dv.permute(2, 0, 1, 3).to(v.dtype)
    return dq, dk, dv


def regen_source(state: torch.Tensor, p: float, device) -> MaskSource:
    """Tile masks replayed, in order, from a private generator set to `state`."""
    gen = C.replay_generator(state, device)
    return lambda _i, shape: C.draw_keep(shape, p, gen, device)


def drawing_source(gen: torch.Generator, p: float, device,
                   keep_tiles: Optional[list] = None) -> MaskSource:
    """Tile masks drawn from `gen` (advancing it); optionally collected in `keep_tiles`."""
    def source(_i, shape):
        keep = C.draw_keep(shape, p, gen, device)
        if keep_tiles is not None:
            keep_tiles.append(keep)
        return keep
    return source


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, p, scale, generator, cq, ck, mask_storage, report):
        stash = Stash(report)
        source, tiles = None, None
        if p > 0.0:
            gen = C.resolve_generator(generator, q.device)
            state = gen.get_state()
            tiles = [] if mask_storage == "bitmask" else None
            source = drawing_source(gen, p, q.device, tiles)
        out, lse = chunked_forward(q, k, v, causal, p, scale, source, cq, ck)
        for site, x in (("attn.q", q), ("attn.k", k), ("attn.v", v), ("attn.out", out),
                        ("attn.out", lse)):
            stash.add(site, x)
        if p > 0.0 and tiles is not None:
            codec = BitMask()
            for t in tiles:
                stash.add("attn.dropout_mask", t, codec)
        elif p > 0.0:
            stash.add("attn.dropout_mask", state)
        stash.save(ctx)
        ctx.conf = (causal, p, scale, cq, ck, mask_storage, q.device)
        return out

    @staticmethod
    def backward(ctx, dout):
        causal, p, scale, cq, ck, mask_storage, device = ctx.conf
        q, k, v, out, lse, *masks = restore(ctx)
        source = None
        if p > 0.0 and mask_storage == "bitmask":
            source = lambda i, _shape: masks[i]  # noqa: E731 (decoded tile masks, in order)
        elif p > 0.0:
            source = regen_source(masks[0], p, device)
        dq, dk, dv = chunked_backward(q, k, v, out, lse, dout.contiguous(), causal, p, scale,
                                      source, cq, ck)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      dropout_p: float = 0.0, scale: Optional[float] = None,
                      generator: Optional[torch.Generator] = None,
                      chunk_size: Union[int, Sequence[int]] = DEFAULT_CHUNK,
                      mask_storage: str = "regen",
                      report: Optional[Report] = None) -> torch.Tensor:
    """Attention over q [s, b, heads, d], k/v [s_k, b, groups, d] -> [s, b, heads, d].

    `dropout_p` > 0 draws the keep-masks from `generator` (default: the device's default
    generator, so megatron's RNG tracker applies); `chunk_size` is an int or a pair
    (query chunk, key chunk); `mask_storage`: "regen" (the generator state) or
    "bitmask"; `report(site, tensors, nbytes)` is told what each site stores (`_stash`).
    """
    C.check_qkv(q, k, v)
    p = C.check_dropout(dropout_p)
    scale = C.check_scale(scale, q.shape[-1])
    cq, ck = _chunks(chunk_size)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mask_storage not in MASK_STORAGES:
        raise ValueError(f"mask_storage must be one of {MASK_STORAGES}, got {mask_storage!r}")
    if p > 0.0:
        C.resolve_generator(generator, q.device)
    return _ChunkedAttention.apply(q, k, v, causal, p, scale, generator, cq, ck, mask_storage,
                                   report)
