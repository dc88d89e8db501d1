"""Memory-efficient attention in pure torch: flash attention's tiling, for any device.

torch SDPA on CPU falls back to its math path when attention dropout is on and then
stores two s x s tensors per head; this path never stores one. The forward walks query
chunks x key chunks with an online softmax (running max and sum), so only one
[b, heads, chunk, chunk] tile exists at a time; causal tiles above the diagonal are
skipped and the diagonal tiles masked in place (no s x s mask anywhere). Backward
recomputes each tile from q, k, v and the logsumexp (FlashAttention-2's backward).

Dropout: the keep-mask is the one stock attention's dropout draws for its
[b, heads, s, s_k] probabilities from the same generator state (`dropout_keep_mask`, torch's
own dropout sampler), so the forward is stock's, mask for mask; a mask of our own formula
would be another dropout realization, and a different forward (issue 25). The mask is drawn
whole, 1 byte per element, and lives only while the forward (or backward) runs: it is a
transient, never stored. Only the generator state before the draw is saved (16 bytes on
CUDA, 5056 on CPU); backward draws the same mask again from a private generator set to that
state. `chunk_dropout_mask` gives that mask, for references. `mask_storage="bitmask"`
stores it packed instead (1 bit per element; for tests and comparisons only, it is s x s).

Saved for backward: q, k, v as given (GQA: un-expanded), out, logsumexp [b, heads, s]
(float32) and the generator state.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

import torch

from llm_act.attention import _common as C
from llm_act.attention._stash import Report, Stash, restore
from llm_act.codecs.bitmask import BitMask
from llm_act.codecs.regen import dropout_keep_mask
from llm_act.sites import ATTN_DROPOUT_MASK, ATTN_K, ATTN_OUT, ATTN_Q, ATTN_V

DEFAULT_CHUNK = 128
MASK_STORAGES = ("regen", "bitmask")


def chunk_sizes(chunk_size: Union[int, Sequence[int]]) -> tuple[int, int]:
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


def _keep_tile(keep: torch.Tensor, qs: int, qe: int, ks: int, ke: int, g: int) -> torch.Tensor:
    """[b, heads, s, s_k] keep-mask -> the tile's [b, g, r*Cq, Ck] (head i is group i // r)."""
    b, h = keep.shape[0], keep.shape[1]
    return keep[:, :, qs:qe, ks:ke].reshape(b, g, (h // g) * (qe - qs), ke - ks)


def chunk_dropout_mask(batch: int, heads: int, s: int, s_k: int, p: float,
                       generator: Optional[torch.Generator] = None, device=None,
                       like_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full keep-mask [batch, heads, s, s_k] (bool) that `chunked_attention` draws for
    inputs of `like_dtype`: stock dropout's mask for probabilities of that shape, from
    `generator` (advancing it, as the forward does; default: the device's default one)."""
    p = C.check_dropout(p)
    device = torch.device(device) if device is not None else (
        generator.device if generator is not None else torch.device("cpu"))
    gen = C.resolve_generator(generator, device)
    return dropout_keep_mask((batch, heads, s, s_k), p, gen, device, like_dtype)


def chunked_forward(q, k, v, causal: bool, p: float, scale: float,
                    keep: Optional[torch.Tensor], cq: int, ck: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [s, b, heads, d] in q's dtype, logsumexp [b, heads, s] in the accumulation dtype).

    `keep`: the dropout keep-mask [b, heads, s, s_k] (bool; None: no dropout). No autograd:
    callers wrap it.
    """
    s, s_k, b, h, g, d = C.check_qkv(q, k, v)
    r = h // g
    acc = C.compute_dtype(q.dtype)
    q5, k4, v4 = C.heads_view(q, g), C.groups_view(k), C.groups_view(v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(b, g, r, s, dtype=acc, device=q.device)
    inv_keep = 1.0 / (1.0 - p)
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
        if keep is not None:
            probs = probs.mul_(_keep_tile(keep, qs, qe, ks, ke, g)).mul_(inv_keep)
        o = o.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(probs, v4[:, :, ks:ke].to(acc)))
        m = m_new
        last = ke == s_k or (causal and ke > qe - 1)
        if last:
            o = o / lsum.unsqueeze(-1)
            out[qs:qe] = o.view(b, g, r, cqn, d).permute(3, 0, 1, 2, 4).reshape(cqn, b, h, d)
            lse[:, :, :, qs:qe] = (m + torch.log(lsum)).view(b, g, r, cqn)
    return out, lse.view(b, h, s)


def chunked_backward(q, k, v, out, lse, dout, causal: bool, p: float, scale: float,
                     keep: Optional[torch.Tensor], cq: int, ck: int
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
        if keep is not None:
            tile = _keep_tile(keep, qs, qe, ks, ke, g)
            dropped = probs * tile * inv_keep
            dprobs = dprobs.mul_(tile).mul_(inv_keep)
        else:
            dropped = probs
        dv[:, :, ks:ke] += torch.matmul(dropped.transpose(-1, -2), doc)
        dscores = probs.mul_(dprobs.sub_(delta)).mul_(scale)
        dqc += torch.matmul(dscores, kt)
        dk[:, :, ks:ke] += torch.matmul(dscores.transpose(-1, -2), qc)
        if ke == s_k or (causal and ke > qe - 1):
            dq[qs:qe] = dqc.view(b, g, r, cqn, d).permute(3, 0, 1, 2, 4).reshape(cqn, b, h, d)
    dk = dk.permute(2, 0, 1, 3).to(k.dtype)
    dv = dv.permute(2, 0, 1, 3).to(v.dtype)
    return dq, dk, dv


def draw_mask(gen: torch.Generator, p: float, q: torch.Tensor, s_k: int) -> torch.Tensor:
    """Stock dropout's keep-mask for the [b, heads, s, s_k] probabilities of `q` (in q's
    dtype, as megatron's softmax returns them), drawn from `gen` (advancing it)."""
    s, b, h = q.shape[0], q.shape[1], q.shape[2]
    return dropout_keep_mask((b, h, s, s_k), p, gen, q.device, q.dtype)


def replay_mask(state: torch.Tensor, p: float, q: torch.Tensor, s_k: int) -> torch.Tensor:
    """The mask `draw_mask` drew from `state`, drawn again (a private generator)."""
    return draw_mask(C.replay_generator(state, q.device), p, q, s_k)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, p, scale, generator, cq, ck, mask_storage, report):
        stash = Stash(report)
        keep = None
        if p > 0.0:
            gen = C.resolve_generator(generator, q.device)
            state = gen.get_state()
            keep = draw_mask(gen, p, q, k.shape[0])
        out, lse = chunked_forward(q, k, v, causal, p, scale, keep, cq, ck)
        for site, x in ((ATTN_Q, q), (ATTN_K, k), (ATTN_V, v), (ATTN_OUT, out),
                        (ATTN_OUT, lse)):
            stash.add(site, x)
        if p > 0.0 and mask_storage == "bitmask":
            stash.add(ATTN_DROPOUT_MASK, keep, BitMask())
        elif p > 0.0:
            stash.add(ATTN_DROPOUT_MASK, state)
        stash.save(ctx)
        ctx.conf = (causal, p, scale, cq, ck, mask_storage, q.device)
        return out

    @staticmethod
    def backward(ctx, dout):
        causal, p, scale, cq, ck, mask_storage, device = ctx.conf
        q, k, v, out, lse, *masks = restore(ctx)
        keep = None
        if p > 0.0 and mask_storage == "bitmask":
            keep = masks[0]
        elif p > 0.0:
            keep = replay_mask(masks[0], p, q, k.shape[0])
        dq, dk, dv = chunked_backward(q, k, v, out, lse, dout.contiguous(), causal, p, scale,
                                      keep, cq, ck)
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
    cq, ck = chunk_sizes(chunk_size)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mask_storage not in MASK_STORAGES:
        raise ValueError(f"mask_storage must be one of {MASK_STORAGES}, got {mask_storage!r}")
    if p > 0.0:
        C.resolve_generator(generator, q.device)
    return _ChunkedAttention.apply(q, k, v, causal, p, scale, generator, cq, ck, mask_storage,
                                   report)
