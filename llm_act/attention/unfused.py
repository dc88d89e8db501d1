"""The unfused attention: softmax probabilities and dropout mask explicitly stored.

This is what stock megatron-core's core attention keeps (s x s per head), and the path
where those two tensors can be compressed instead of avoided: the probabilities
(`attn.softmax`, 0..1 with no outliers: `int4_asym`, Adacc sec. 3.2) and the keep-mask
(`attn.dropout_mask`: `bitmask` packs it 1 bit per element, `regen` keeps only the
generator state). Backward is the softmax backward written out from the stored
(decoded) probabilities, so no s x s tensor has to be recomputed. Q, K, V may be
encoded too (sites `attn.q/k/v`).

The keep-mask is stock dropout's for the [b, heads, s, s_k] probabilities in q's dtype
(`llm_act.codecs.regen.dropout_keep_mask`, from `generator` or the device's default one),
so the forward draws the mask stock attention draws, and raw, bitmask and regen storage use
the same mask bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from llm_act.attention import _common as C
from llm_act.attention._stash import Report, Stash, restore
from llm_act.codecs.base import Codec
from llm_act.codecs.regen import dropout_keep_mask
from llm_act.sites import ATTN_DROPOUT_MASK, ATTN_K, ATTN_Q, ATTN_SOFTMAX, ATTN_V

MASK_CODEC_NAMES = ("bitmask", "regen")


def _check_mask_codec(codec: Optional[Codec]) -> None:
    if codec is None:
        return
    if not isinstance(codec, Codec) or codec.name not in MASK_CODEC_NAMES:
        raise ValueError(f"mask_codec must be None, a 'bitmask' or a 'regen' codec, got {codec!r}")


class _UnfusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, p, scale, generator, softmax_codec, mask_codec,
                qkv_codecs, report):
        s, s_k, b, h, g, d = C.check_qkv(q, k, v)
        r = h // g
        acc = C.compute_dtype(q.dtype)
        qf = C.heads_view(q, g).to(acc).reshape(b, g, r * s, d)
        kf, vf = C.groups_view(k).to(acc), C.groups_view(v).to(acc)
        scores = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
        if causal:
            hidden = torch.ones(s, s_k, dtype=torch.bool, device=q.device).triu_(1)
            scores.view(b, g, r, s, s_k).masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # stored as the model dtype (stock)
        del scores
        stash = Stash(report)
        for site, x, codec in zip((ATTN_Q, ATTN_K, ATTN_V), (q, k, v), qkv_codecs):
            stash.add(site, x, codec)
        stash.add(ATTN_SOFTMAX, probs, softmax_codec)
        weights = probs.to(acc).view(b, g, r * s, s_k)
        if p > 0.0:
            gen = C.resolve_generator(generator, q.device)
            shape = (b, h, s, s_k)
            if mask_codec is not None and mask_codec.name == "regen":
                keep, enc = mask_codec.sample(shape, p, gen, q.device, like_dtype=q.dtype)
                stash.add_encoded(ATTN_DROPOUT_MASK, mask_codec, enc)
            else:
                keep = dropout_keep_mask(shape, p, gen, q.device, q.dtype)
                stash.add(ATTN_DROPOUT_MASK, keep, mask_codec)
            weights = weights * keep.view(b, g, r * s, s_k) * (1.0 / (1.0 - p))
        out = torch.matmul(weights, vf)
        stash.save(ctx)
        ctx.conf = (s, s_k, b, h, g, d, p, scale)
        return out.view(b, g, r, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, h, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        s, s_k, b, h, g, d, p, scale = ctx.conf
        r = h // g
        parts = restore(ctx)
        q, k, v, probs = parts[:4]
        acc = C.compute_dtype(q.dtype)
        qf = C.heads_view(q, g).to(acc).reshape(b, g, r * s, d)
        kf, vf = C.groups_view(k).to(acc), C.groups_view(v).to(acc)
        dof = C.heads_view(dout, g).to(acc).reshape(b, g, r * s, d)
        pf = probs.to(acc).view(b, g, r * s, s_k)
        dprobs = torch.matmul(dof, vf.transpose(-1, -2))
        if p > 0.0:
            keep = parts[4].view(b, g, r * s, s_k)
            inv_keep = 1.0 / (1.0 - p)
            dv = torch.matmul((pf * keep * inv_keep).transpose(-1, -2), dof)
            dprobs = dprobs.mul_(keep).mul_(inv_keep)
        else:
            dv = torch.matmul(pf.transpose(-1, -2), dof)
        dscores = pf * (dprobs - (dprobs * pf).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(dscores, kf)
        dk = torch.matmul(dscores.transpose(-1, -2), qf)
        dq = dq.view(b, g, r, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, h, d).to(q.dtype)
        dk = dk.permute(2, 0, 1, 3).to(k.dtype)
        dv = dv.permute(2, 0, 1, 3).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      dropout_p: float = 0.0, softmax_codec: Optional[Codec] = None,
                      mask_codec: Optional[Codec] = None, scale: Optional[float] = None,
                      generator: Optional[torch.Generator] = None,
                      qkv_codecs: tuple = (None, None, None),
                      report: Optional[Report] = None) -> torch.Tensor:
    """Attention with the probabilities [b, heads, s, s_k] and the keep-mask stored.

    `softmax_codec` encodes the stored probabilities (None: kept in q's dtype),
    `mask_codec` the keep-mask (None: kept as bool; "bitmask"; "regen"), `qkv_codecs`
    the stored q, k, v (None: kept).
    """
    C.check_qkv(q, k, v)
    p = C.check_dropout(dropout_p)
    scale = C.check_scale(scale, q.shape[-1])
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_codec is not None and not isinstance(softmax_codec, Codec):
        raise TypeError(f"softmax_codec must be a Codec or None, got {type(softmax_codec).__name__}")
    _check_mask_codec(mask_codec)
    if len(qkv_codecs) != 3:
        raise ValueError(f"qkv_codecs must hold 3 entries (q, k, v), got {len(qkv_codecs)}")
    if p > 0.0:
        C.resolve_generator(generator, q.device)
    return _UnfusedAttention.apply(q, k, v, causal, p, scale, generator, softmax_codec,
                                   mask_codec, tuple(qkv_codecs), report)
