"""`attention`: one entry point that picks the memory-efficient path and applies the codecs.

Backends: "sdpa" (torch's fused kernels), "chunked" (ours, for attention dropout where
SDPA has no memory-efficient kernel, i.e. on CPU), "unfused" (softmax and mask stored),
"auto" = sdpa when dropout is 0 or on CUDA, chunked otherwise. "stock" is the
framework's own attention and is not served here.

Compressed Q/K/V (Adacc sec. 3.2): when a codec at `attn.q/k/v` is lossy, the Function
stores the encoded Q, K, V (and the dropout generator state), and backward differentiates
the attention at the decoded values. Two ways (`lossy_backward`):

- "recompute" (`_RecomputeFromEncoded`, the default): backward recomputes out and
  logsumexp from the decoded Q/K/V, so both are consistent with what it differentiates,
  then runs the attention backward.
- "stored" (`_BackwardFromStored`): the forward also keeps its output (the memory the
  output projection keeps anyway: `attn.out`, no extra bytes; or, when the projection
  stores it encoded, a handle to its record, `OutSource`) and its logsumexp (`attn.lse`,
  float32, 4 bytes per (b, head, s)); backward runs only the attention backward
  (FlashAttention-2's: D = rowsum(dO * O), P = exp(S - lse), dV = P^T dO, dP = dO V^T,
  dS = P * (dP - D), dQ = dS K * scale, dK = dS^T Q * scale; chunked: tile by tile, no
  s x s tensor) on the decoded Q/K/V. No second attention forward: 2 of the 7 s x s
  matmuls of "recompute" (29% of its FLOPs) are saved.

Why "recompute" is the default (measured, `tools/attention_backward_error.py`, real
megatron-core layers on CPU): "stored" mixes exact row statistics with decoded Q/K/V. P =
exp(S~ - lse) is no longer normalised (the decoded logits' row-wise shift, which a softmax
cancels, stays in), and D from the true O does not match the decoded V, so the rows of dS
no longer sum to zero. Its dq, dk, dv errors are 1.05-1.3x those of "recompute" at
initialisation and 1.35-1.7x with peaked attention (QKV weights x3), the layer-input
gradient's 1.02-1.17x and 1.4-1.6x (int4_channel and fp8_e4m3 at Q/K/V, attn.out kept or
encoded, fp32 and bf16, MHA and GQA, dropout 0 and 0.1). With exact values both give the
same gradient (bit for bit on CPU); "stored" is the choice when the FLOPs matter more than
that error.
"""
from __future__ import annotations

import weakref
from typing import Callable, Mapping, Optional, Sequence, Union

import torch

from llm_act.attention import _common as C
from llm_act.attention._stash import Report, Stash, is_lossy, restore
from llm_act.attention.chunked import (DEFAULT_CHUNK, MASK_STORAGES, chunk_sizes, chunked_attention,
                                       chunked_backward, chunked_forward, draw_mask, replay_mask)
from llm_act.attention.fused import fused_backward, fused_forward, fused_kind
from llm_act.attention.sdpa import sdpa_attention, sdpa_call
from llm_act.attention.unfused import unfused_attention
from llm_act.codecs.base import Codec
from llm_act.codecs.regen import generator_as_default
from llm_act.codecs.registry import KEEP, make_codec
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_K,
    ATTN_LSE,
    ATTN_OUT,
    ATTN_Q,
    ATTN_SOFTMAX,
    ATTN_V,
)

BACKENDS = ("auto", "sdpa", "chunked", "unfused")
CODEC_SITES = (ATTN_Q, ATTN_K, ATTN_V, ATTN_SOFTMAX, ATTN_DROPOUT_MASK)
QKV = (ATTN_Q, ATTN_K, ATTN_V)
LOSSY_BACKWARDS = ("auto", "stored", "recompute")
#: what lossy_backward="auto" runs (chosen by the measured gradient errors, see the module doc)
DEFAULT_LOSSY_BACKWARD = "recompute"


def resolve_lossy_backward(mode: str) -> str:
    """"stored" or "recompute" for `mode` ("auto" -> `DEFAULT_LOSSY_BACKWARD`)."""
    if mode not in LOSSY_BACKWARDS:
        raise ValueError(f"lossy_backward must be one of {LOSSY_BACKWARDS}, got {mode!r}")
    return DEFAULT_LOSSY_BACKWARD if mode == "auto" else mode


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


def _stash_inputs(report, q, k, v, qkv_codecs, p, generator):
    """A forward's stash of Q, K, V (encoded where their codec is lossy) and, with dropout,
    the generator state before the draw (the mask is replayed, never stored); and that
    generator (None without dropout)."""
    stash = Stash(report)
    for site, x, codec in zip(QKV, (q, k, v), qkv_codecs):
        stash.add(site, x, codec if is_lossy(codec) else None)
    gen = None
    if p > 0.0:
        gen = C.resolve_generator(generator, q.device)
        stash.add(ATTN_DROPOUT_MASK, gen.get_state())
    return stash, gen


class _RecomputeFromEncoded(torch.autograd.Function):
    """Forward on exact Q/K/V; stores encoded Q/K/V; backward recomputes from decoded ones."""

    @staticmethod
    def forward(ctx, q, k, v, backend, causal, p, scale, generator, cq, ck, qkv_codecs, report):
        stash, gen = _stash_inputs(report, q, k, v, qkv_codecs, p, generator)
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


class OutSource:
    """The attention output as its consumer stores it, for the "stored" backward.

    When the next op keeps the output anyway (megatron's output projection, encoded at
    `attn.out`), the attention keeps no copy: the consumer `offer`s, in its forward, the
    tensor it stores and a `fetch()` that gives it back in backward (decoded). The offer is
    taken only if that tensor is this attention's output (same memory and size): with an op
    in between (an output gate) or no offer, backward recomputes the forward instead.
    `take()` hands the output over once (a second backward through a retained graph
    recomputes).
    """

    def __init__(self) -> None:
        self._out: Optional[tuple] = None
        self._fetch: Optional[Callable[[], torch.Tensor]] = None

    def expect(self, out: torch.Tensor) -> None:
        # the storage itself (weakly), not its address: memory freed in between may hold
        # another tensor of the same size at the same address
        self._out = (weakref.ref(out.untyped_storage()), out.storage_offset(), out.numel())

    def offer(self, x: Optional[torch.Tensor], fetch: Callable[[], torch.Tensor]) -> bool:
        if self._out is None or not isinstance(x, torch.Tensor):
            return False
        storage, offset, numel = self._out
        if storage() is not x.untyped_storage() or (x.storage_offset(), x.numel()) != (offset, numel):
            return False
        self._fetch = fetch
        return True

    def take(self) -> Optional[torch.Tensor]:
        fetch, self._fetch = self._fetch, None
        return None if fetch is None else fetch()


def _stored_impl(backend: str, q, k, v, causal: bool, p: float) -> Optional[str]:
    """The kernels of the "stored" backward for `backend`: "chunked" (ours, any device), a
    fused kind (`fused.fused_kind`), or None (no kernel returns the logsumexp here: SDPA
    with dropout on CPU, or inputs CUDA's efficient kernel does not take)."""
    if backend == "chunked":
        return "chunked"
    return fused_kind(q, k, v, causal, p)


def _forward_lse(impl: str, q, k, v, causal: bool, p: float, scale: float,
                 gen: Optional[torch.Generator], cq: int, ck: int):
    """(out [s, b, heads, d], logsumexp, rng tensors) by `impl`; dropout drawn from `gen`."""
    if impl == "chunked":
        keep = draw_mask(gen, p, q, k.shape[0]) if p > 0.0 else None
        out, lse = chunked_forward(q, k, v, causal, p, scale, keep, cq, ck)
        return out, lse, ()
    with generator_as_default(gen if p > 0.0 else None, q.device):
        return fused_forward(impl, q, k, v, causal, p, scale)


class _BackwardFromStored(torch.autograd.Function):
    """Forward on exact Q/K/V; stores encoded Q/K/V, the output (or an `OutSource`) and the
    logsumexp; backward runs only the attention backward on the decoded Q/K/V.

    The dropout mask is the forward's: the generator state before the draw is stored and
    replayed (chunked), or the fused kernel's philox seed and offset are (CUDA)."""

    @staticmethod
    def forward(ctx, q, k, v, impl, causal, p, scale, generator, cq, ck, qkv_codecs, report,
                out_source):
        stash, gen = _stash_inputs(report, q, k, v, qkv_codecs, p, generator)
        out, lse, rng = _forward_lse(impl, q, k, v, causal, p, scale, gen, cq, ck)
        for t in rng:
            stash.add(ATTN_DROPOUT_MASK, t)
        if out_source is None:
            stash.add(ATTN_OUT, out)  # the memory the output projection keeps too
        else:
            out_source.expect(out)
        stash.add(ATTN_LSE, lse)
        stash.save(ctx)
        ctx.conf = (impl, causal, p, scale, cq, ck, len(rng), out_source)
        return out

    @staticmethod
    def backward(ctx, dout):
        impl, causal, p, scale, cq, ck, n_rng, out_source = ctx.conf
        parts = restore(ctx)
        q, k, v = parts[:3]
        i = 3
        state = None
        if p > 0.0:
            state, i = parts[3], 4
        rng = tuple(parts[i:i + n_rng])
        i += n_rng
        if out_source is None:
            out, i = parts[i], i + 1
        else:
            out = out_source.take()
        lse = parts[i]
        if out is None:  # the consumer stored no output after all: recompute it (and lse)
            gen = C.replay_generator(state, q.device) if state is not None else None
            out, lse, rng = _forward_lse(impl, q, k, v, causal, p, scale, gen, cq, ck)
        else:
            out = out.reshape(q.shape)
        if impl == "chunked":
            keep = replay_mask(state, p, q, k.shape[0]) if state is not None else None
            dq, dk, dv = chunked_backward(q, k, v, out, lse, dout.contiguous(), causal, p, scale,
                                          keep, cq, ck)
        else:
            dq, dk, dv = fused_backward(impl, dout, q, k, v, out, lse, rng, causal, p, scale)
        return (dq, dk, dv) + (None,) * 10


def _report_plain(report: Optional[Report], q, k, v, out) -> None:
    """Tell `report` what SDPA stores that we can see (q, k, v, out; its logsumexp is
    internal and left to the ledger's own hooks)."""
    if report is None:
        return
    stash = Stash(report)
    for site, x in ((ATTN_Q, q), (ATTN_K, k), (ATTN_V, v), (ATTN_OUT, out)):
        stash.add(site, x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              dropout_p: float = 0.0, scale: Optional[float] = None, backend: str = "auto",
              generator: Optional[torch.Generator] = None,
              codecs: Optional[Mapping[str, Union[Codec, str, None]]] = None,
              report: Optional[Report] = None,
              chunk_size: Union[int, Sequence[int]] = DEFAULT_CHUNK,
              mask_storage: str = "regen", recompute_out: bool = False,
              lossy_backward: str = "auto", out_source: Optional[OutSource] = None) -> torch.Tensor:
    """Core attention: q [s, b, heads, d], k/v [s_k, b, groups, d] (after rotary) -> [s, b, heads, d].

    `codecs`: site -> Codec, codec name or None, for `attn.q/k/v` (any backend),
    `attn.softmax` (unfused only) and `attn.dropout_mask` ("regen" or "bitmask": how the
    unfused and chunked paths keep the mask; SDPA regenerates its own). `report(site, tensors,
    nbytes)` is told what each site stores (for the ledger). `generator`: where dropout
    draws from (default: the device's default generator). `recompute_out`: store neither
    out nor logsumexp (sdpa/chunked), only Q, K, V (encoded where their codecs are lossy),
    and recompute the forward in backward -- for when the output is stored elsewhere,
    encoded (the output projection's input, site `attn.out`). `lossy_backward` (with lossy
    Q/K/V, sdpa/chunked): "stored" runs only the attention backward from the stored output
    and logsumexp, "recompute" recomputes them from the decoded Q/K/V first, "auto" =
    `DEFAULT_LOSSY_BACKWARD` (see the module doc). With `recompute_out`, "stored" needs
    `out_source` (where the consumer hands its stored output back); without one, or where
    no kernel gives the logsumexp (SDPA with dropout on CPU), it recomputes.
    """
    C.check_qkv(q, k, v)
    p = C.check_dropout(dropout_p)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if mask_storage not in MASK_STORAGES:
        raise ValueError(f"mask_storage must be one of {MASK_STORAGES}, got {mask_storage!r}")
    mode = resolve_lossy_backward(lossy_backward)
    if out_source is not None and not isinstance(out_source, OutSource):
        raise TypeError(f"out_source must be an OutSource or None, got {type(out_source).__name__}")
    chosen = pick_backend(backend, p, q.device)
    cs = _codecs(codecs)
    qkv_codecs = tuple(cs.get(site) for site in QKV)
    if chosen != "unfused" and (cs.get(ATTN_SOFTMAX) is not None):
        raise ValueError(f"codecs['attn.softmax'] applies only to the unfused backend, not {chosen!r}")
    if chosen == "unfused":
        return unfused_attention(q, k, v, causal, p, softmax_codec=cs.get(ATTN_SOFTMAX),
                                 mask_codec=cs.get(ATTN_DROPOUT_MASK), scale=scale,
                                 generator=generator,
                                 qkv_codecs=tuple(c if is_lossy(c) else None for c in qkv_codecs),
                                 report=report)
    if not isinstance(recompute_out, bool):
        raise TypeError(f"recompute_out must be a bool, got {type(recompute_out).__name__}")
    lossy = any(is_lossy(c) for c in qkv_codecs)
    if recompute_out or lossy:
        scale = C.check_scale(scale, q.shape[-1])
        cq, ck = chunk_sizes(chunk_size)
        if p > 0.0:
            C.resolve_generator(generator, q.device)
        impl = None
        if lossy and mode == "stored" and (not recompute_out or out_source is not None):
            impl = _stored_impl(chosen, q, k, v, causal, p)
        if impl is not None:
            return _BackwardFromStored.apply(q, k, v, impl, causal, p, scale, generator, cq, ck,
                                             qkv_codecs, report,
                                             out_source if recompute_out else None)
        return _RecomputeFromEncoded.apply(q, k, v, chosen, causal, p, scale, generator, cq, ck,
                                           qkv_codecs, report)
    if chosen == "chunked":
        mask_codec = cs.get(ATTN_DROPOUT_MASK)
        if mask_codec is not None and mask_codec.name == "bitmask":
            mask_storage = "bitmask"
        return chunked_attention(q, k, v, causal, p, scale, generator, chunk_size, mask_storage,
                                 report)
    out = sdpa_attention(q, k, v, causal, p, scale, generator)
    _report_plain(report, q, k, v, out)
    return out
