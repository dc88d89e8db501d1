"""Autograd functions of a compressed MoE layer: the router's gating linear and one expert.

`EncodedRouterGating` is megatron-core's `RouterGatingLinearFunction` (logits in the router
dtype) saving the encoded router input (site `moe.router_input`).

`ExpertFFN` is one SequentialMLP expert, fc1 -> activation -> x probability -> fc2, as one
function, so that each tensor stock keeps is stored once, by its own site's choice:

    moe.fc1_input   x  the tokens routed to the expert      (a value codec, or kept)
    moe.act_input   h  fc1's output, the activation input   (a value codec, kept, or recomputed
                                                             from x: h = x W1^T)
    moe.fc2_input   z  f(h) * p, fc2's input                 (a value codec, kept, or recomputed
                                                             from h and p)
    moe.routing     p  the tokens' routing probabilities    (a value codec, or kept)

Stock also keeps f(h) for the probability's gradient; here it is re-derived from h in
backward. Rows whose probability is exactly 0 are padding (megatron's
`moe_pad_expert_input_to_capacity` routes them with probability 0): their output is 0 and
so is every gradient they carry back, so they are neither stored nor encoded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from llm_act.codecs.base import Codec
from llm_act.patches.megatron.functions import Record, linear_param_grads, megatron_linear_helpers, report_record
from llm_act.sites import MOE_ACT_INPUT, MOE_FC1_INPUT, MOE_FC2_INPUT, MOE_ROUTING

FC1, ACT, FC2, ROUTING = MOE_FC1_INPUT, MOE_ACT_INPUT, MOE_FC2_INPUT, MOE_ROUTING


class EncodedRouterGating(torch.autograd.Function):
    """logits = input @ weight^T (+ bias) in `router_dtype`, saving encode(input)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, router_dtype, codec: Codec, owner, site: str):
        ctx.save_for_backward(weight, bias)
        ctx.record, ctx.codec = Record(codec.encode(inp)), codec
        ctx.router_dtype, ctx.input_dtype, ctx.weight_dtype = router_dtype, inp.dtype, weight.dtype
        flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        w = weight.to(router_dtype)
        out = torch.mm(flat, w.t()) if bias is None else torch.addmm(bias.to(router_dtype), flat, w.t())
        report_record(owner, site, ctx.record, inp)
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output):
        weight, bias = ctx.saved_tensors
        inp = ctx.codec.decode(ctx.record.enc)
        ctx.record = None
        shape = inp.shape
        inp = inp.reshape(-1, shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = torch.mm(g, weight.to(ctx.router_dtype)).to(ctx.input_dtype).view(shape)
        grad_weight = torch.mm(g.t(), inp.to(ctx.router_dtype)).to(ctx.weight_dtype)
        grad_bias = g.sum(dim=0).to(ctx.weight_dtype) if bias is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


@dataclass
class ExpertStore:
    """How one expert's forward stores its tensors: a codec per site (a lossless `VisibleKeep`
    for "keep"), the sites rebuilt in backward, the activation, and its two linears (for
    megatron's gradient-accumulation fusion)."""

    codecs: dict
    recompute: frozenset
    fn: Callable[[torch.Tensor], torch.Tensor]
    fc1: torch.nn.Module
    fc2: torch.nn.Module
    owner: object


def _put(store: ExpertStore, site: str, t: torch.Tensor) -> Optional[Record]:
    if site in store.recompute:
        return None
    record = Record(store.codecs[site].encode(t))
    report_record(store.owner, site, record, t)
    return record


def _get(store: ExpertStore, site: str, record: Record) -> torch.Tensor:
    return store.codecs[site].decode(record.enc)


class _Fused:
    """What megatron's linear backward reads from its ctx (`linear_param_grads`)."""

    def __init__(self, linear: torch.nn.Module, weight: torch.Tensor):
        self.gradient_accumulation_fusion = bool(getattr(linear, "gradient_accumulation_fusion", False)) \
            and hasattr(weight, "main_grad")
        self.use_bias = False


class ExpertFFN(torch.autograd.Function):
    """out = (f(x W1^T) * p) W2^T for one expert's tokens x [n, hidden] and probabilities p [n]."""

    @staticmethod
    def forward(ctx, x, p, w1, w2, store: ExpertStore):
        h = torch.matmul(x, w1.t())
        z = (store.fn(h) * p.unsqueeze(-1)).to(h.dtype)
        out = torch.matmul(z, w2.t())
        live = None
        if bool((p == 0).any()):  # padding rows: nothing of them is stored
            live = (p != 0).nonzero().squeeze(1)
            x, h, z, p = (t.index_select(0, live) for t in (x, h, z, p))
        ctx.save_for_backward(w1, w2)
        ctx.store, ctx.live, ctx.rows = store, live, out.shape[0]
        ctx.records = {site: _put(store, site, t) for site, t in ((FC1, x), (ACT, h), (FC2, z), (ROUTING, p))}
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w1, w2 = ctx.saved_tensors
        store, live, rec = ctx.store, ctx.live, ctx.records
        ctx.records = None
        g = grad_out if live is None else grad_out.index_select(0, live)
        x = _get(store, FC1, rec[FC1])
        p = _get(store, ROUTING, rec[ROUTING])
        h = torch.matmul(x, w1.t()) if rec[ACT] is None else _get(store, ACT, rec[ACT])
        need_p = ctx.needs_input_grad[1]
        with torch.enable_grad():
            hh = h.detach().requires_grad_(True)
            pp = p.detach().requires_grad_(need_p)
            zz = (store.fn(hh) * pp.unsqueeze(-1)).to(hh.dtype)
        z = zz.detach() if rec[FC2] is None else _get(store, FC2, rec[FC2])
        L, prepare = megatron_linear_helpers()
        gz = torch.matmul(g, w2)
        g2, z2 = prepare(g, z)
        gw2, _ = linear_param_grads(_Fused(store.fc2, w2), L, w2, g2, z2)
        grads = torch.autograd.grad(zz, [hh, pp] if need_p else [hh], gz)
        gh, gp = grads[0], (grads[1] if need_p else None)
        gx = torch.matmul(gh, w1)
        gh2, x2 = prepare(gh, x)
        gw1, _ = linear_param_grads(_Fused(store.fc1, w1), L, w1, gh2, x2)
        if live is not None:
            gx = gx.new_zeros((ctx.rows, gx.shape[-1])).index_copy_(0, live, gx)
            if gp is not None:
                gp = gp.new_zeros(ctx.rows).index_copy_(0, live, gp)
        return gx, gp, gw1, gw2, None


class PaddingOnly(torch.autograd.Function):
    """An expert that received padding rows only (probability 0): its output is 0 and every
    gradient is 0 (the probabilities' gradient at padded positions is discarded by the
    router's scatter anyway), so nothing is stored."""

    @staticmethod
    def forward(ctx, x, p, w1, w2):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (x, p, w1, w2)]
        return x.new_zeros((x.shape[0], w2.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.shapes)
