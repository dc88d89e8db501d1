"""`attention`: one entry point that picks the memory-efficient path and applies the codecs.

Backends: "sdpa" (torch's fused kernels), "chunked" (ours, for attention dropout where
SDPA has no memory-efficient kernel, i.e. on CPU), "unfused" (softmax and mask stored),
"auto" = sdpa when dropout is 0 or on CUDA, chunked otherwise. "stock" is the
framework's own attention and is not served here.

Compressed Q/K/V (Adacc sec. 3.2): when a codec at `attn.q/k/v` is lossy, the Function
stores the encoded Q, K, V (and the dropout generator state) and nothing else; backward
decodes them and recomputes the attention forward from the decoded values, so out and
logsumexp are consistent with what the backward differentiates, then runs the backward.
Storing the exact out/lse next to approximate Q/K/V would mix two different attentions.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

from llm_act.attention import _common as C
from llm_act.attention._stash import Report, Stash, is_lossy, restore
from llm_act.attention.chunked import (DEFAULT_CHUNK, MASK_STORAGES, _chunks, chunked_attention,
                                       chunked_backward, chunked_forward, draw_mask, replay_mask)
from llm_act.attention.sdpa import sdpa_attention, sdpa_call
from llm_act.attention.unfused import unfused_attention
from llm_act.codecs.base import Codec
from llm_act.codecs.regen import generator_as_default
from llm_act.codecs.registry import KEEP, make_codec

BACKENDS = ("auto", "sdpa", "chunked", "unfused")
CODEC_SITES = ("attn.q", "attn.k", "attn.v", "attn.softmax", "attn.dropout_mask")


def pick_backend(backend: str, dropout_p: float, device: torch.device) -> str:
    """The concrete backend for `backend` ("auto" resolved)."""
    if backend == "stock":
        raise ValueError("backend 'stock' is the framework's own core attention; "
                         "llm_act.attention serves 'auto', 'sdpa', 'chunked' and 'unfused'")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "sdpa" if dropout_p == 0.0 or torch.device(device).type == "cuda" else "chunked"
    return backend


def _codecs(codecs: Optional[Mapping[str, Union[Codec, str, None]]]) -> dict[str, Optional[Codec]]:
    out: dict[str, Optional[Codec]] = {}
    for site, c in (codecs or {}).items():
        if site not in CODEC_SITES:
            raise ValueError(f"codecs: site {site!r} is not an attention site; use {CODEC_SITES}")
        if isinstance(c, str):
            c = None if c == KEEP else make_codec(c)
        if c is not None and not isinstance(c, Codec):
            raise TypeError(f"codecs[{site!r}] must be a Codec, a codec name or None, got {type(c).__name__}")
        out[site] = c
    return out


class _RecomputeFromEncoded(torch.autograd.Function):
    """Forward on exact Q/K/V; stores encoded Q/K/V; backward recomputes from decoded ones."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal, p, scale, generator, cq, ck, qkv_codecs, report):
        stash = Stash(report)
        for site, x, codec in zip(("attn.q", "attn.k", "attn.v"), (q, k, v), qkv_codecs):
            stash.add(site, x, codec if is_lossy(codec) else None)
        state = None
        if p > 0.0:
            gen = C.resolve_generator(generator, q.device)
            state = gen.get_state()
            stash.add("attn.dropout_mask", state)
        if backend == "chunked":
            keep = draw_mask(gen, p, q, k.shape[0]) if p > 0.0 else None
            out, _ = chunked_forward(q, k, v, causal, p, scale, keep, cq, ck)
        else:
            with generator_as_default(generator if p > 0.0 else None, q.device):
                out = sdpa_call(q, k, v, causal, p, scale)
        stash.save(ctx)
        ctx.conf = (backend, causal, p, scale, cq, ck, q.device)
        return out

    @staticmethod
    def backward(ctx, dout):
        backend, causal, p, scale, cq, ck, device = ctx.conf
        q, k, v, *rest = restore(ctx)
        state = rest[0] if p > 0.0 else None
        if backend == "chunked":
            keep = replay_mask(state, p, q, k.shape[0]) if state is not None else None
            out, lse = chunked_forward(q, k, v, causal, p, scale, keep, cq, ck)
            dq, dk, dv = chunked_backward(q, k, v, out, lse, dout.contiguous(), causal, p, scale,
                                          keep, cq, ck)
        else:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            gen = C.replay_generator(state, device) if state is not None else None
            with torch.enable_grad(), generator_as_default(gen, device):
                out = sdpa_call(*leaves, causal, p, scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _report_plain(report: Optional[Report], q, k, v, out) -> None:
    """Tell `report` what SDPA stores that we can see (q, k, v, out; its logsumexp is
    internal and left to the ledger's own hooks)."""
    if report is None:
        return
    stash = Stash(report)
    for site, x in (("attn.q", q), ("attn.k", k), ("attn.v", v), ("attn.out", out)):
        stash.add(site, x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              dropout_p: float = 0.0, scale: Optional[float] = None, backend: str = "auto",
              generator: Optional[torch.Generator] = None,
              codecs: Optional[Mapping[str, Union[Codec, str, None]]] = None,
              report: Optional[Report] = None,
              chunk_size: Union[int, Sequence[int]] = DEFAULT_CHUNK,
              mask_storage: str = "regen", recompute_out: bool = False) -> torch.Tensor:
    """Core attention: q [s, b, heads, d], k/v [s_k, b, groups, d] (after rotary) -> [s, b, heads, d].

    `codecs`: site -> Codec, codec name or None, for `attn.q/k/v` (any backend),
    `attn.softmax` (unfused only) and `attn.dropout_mask` ("regen" or "bitmask": how the
    unfused and chunked paths keep the mask; SDPA regenerates its own). `report(site, tensors,
    nbytes)` is told what each site stores (for the ledger). `generator`: where dropout
    draws from (default: the device's default generator). `recompute_out`: store neither
    out nor logsumexp (sdpa/chunked), only Q, K, V (encoded where their codecs are lossy),
    and recompute the forward in backward -- for when the output is stored elsewhere,
    encoded (the output projection's input, site `attn.out`).
    """
    C.check_qkv(q, k, v)
    p = C.check_dropout(dropout_p)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mask_storage not in MASK_STORAGES:
        raise ValueError(f"mask_storage must be one of {MASK_STORAGES}, got {mask_storage!r}")
    chosen = pick_backend(backend, p, q.device)
    cs = _codecs(codecs)
    qkv_codecs = tuple(cs.get(site) for site in ("attn.q", "attn.k", "attn.v"))
    if chosen != "unfused" and (cs.get("attn.softmax") is not None):
        raise ValueError(f"codecs['attn.softmax'] applies only to the unfused backend, not {chosen!r}")
    if chosen == "unfused":
        return unfused_attention(q, k, v, causal, p, softmax_codec=cs.get("attn.softmax"),
                                 mask_codec=cs.get("attn.dropout_mask"), scale=scale,
                                 generator=generator,
                                 qkv_codecs=tuple(c if is_lossy(c) else None for c in qkv_codecs),
                                 report=report)
    if not isinstance(recompute_out, bool):
        raise TypeError(f"recompute_out must be a bool, got {type(recompute_out).__name__}")
    if recompute_out or any(is_lossy(c) for c in qkv_codecs):
        scale = C.check_scale(scale, q.shape[-1])
        cq, ck = _chunks(chunk_size)
        if p > 0.0:
            C.resolve_generator(generator, q.device)
        return _RecomputeFromEncoded.apply(q, k, v, chosen, causal, p, scale, generator, cq, ck,
                                           qkv_codecs, report)
    if chosen == "chunked":
        mask_codec = cs.get("attn.dropout_mask")
        if mask_codec is not None and mask_codec.name == "bitmask":
            mask_storage = "bitmask"
        return chunked_attention(q, k, v, causal, p, scale, generator, chunk_size, mask_storage,
                                 report)
    out = sdpa_attention(q, k, v, causal, p, scale, generator)
    _report_plain(report, q, k, v, out)
    return out
