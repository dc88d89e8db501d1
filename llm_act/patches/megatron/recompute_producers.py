"""What re-runs each recomputable site of a megatron-core block, and from what.

A recomputed site is rebuilt in backward by re-running its producer on the producer's
inputs, each itself stored (kept), decoded (a value codec) or recomputed, back to the
nearest stored tensor. The producers:

    attn.qkv_input <- input_layernorm(ln1.input)
    attn.out       <- core_attention(attn.q, attn.k, attn.v)       (needs the attention region)
    ln2.input      <- self_attn_bda(linear_proj(attn.out), ln1.input)   (hidden dropout replayed)
    mlp.fc1_input  <- pre_mlp_layernorm(ln2.input)
    mlp.act_input  <- linear_fc1(mlp.fc1_input) (+ bias)
    mlp.fc2_input  <- activation(mlp.act_input)
    moe.router_input <- pre_mlp_layernorm(ln2.input)
    moe.act_input  <- an expert's fc1(moe.fc1_input)                  (inside the expert's backward)
    moe.fc2_input  <- activation(moe.act_input) * moe.routing          (inside the expert's backward)

`moe.fc1_input` and `moe.routing` come out of the token dispatcher (collectives under expert
parallelism): they are recomputed only with the whole block.

The table is the schema's (`llm_act.sites.Site.recomputed_from`). It is re-exported here,
apart from the binder (`recompute.LayerRecompute`) because both the binder
(validation) and the per-forward frame (`recompute_region.LayerFrame`, which walks it) read it.

`producer_of(layer, site)` is the producer itself, the one place it is written: the binder's
rebuild runs it in backward, and measurement times it through the binder
(`LayerBinder.producer`), so neither restates the layer's forward.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from llm_act.measurement.step_tap import submodule
from llm_act.patches.megatron.mlp import activation_of
from llm_act.sites import BLOCK, LN2_INPUT, MLP_FC2_INPUT, PRODUCER_INPUTS, SITE_OF

__all__ = ["MOE_FULL_ONLY", "PRODUCER_INPUTS", "producer_of"]

#: MoE sites recomputed only with the whole block (the token dispatcher produces them)
MOE_FULL_ONLY: tuple[str, ...] = tuple(s.name for s in BLOCK if s.family == "moe" and not s.recomputed_from)


def producer_of(layer: torch.nn.Module, site: str) -> Optional[Callable[..., torch.Tensor]]:
    """The function of the tensors `site` is recomputed from (`PRODUCER_INPUTS[site]`, in that
    order) that returns `site` as the megatron-core TransformerLayer `layer` makes it in
    forward, through the layer's own modules (called as modules: hooks fire, ZeRO-3 gathers).
    It draws what the layer draws (the hidden dropout): a caller wanting the forward's values
    replays the forward's RNG state around the call. None for a site `layer` does not have
    (its slot is absent: the other MLP family's, one after the blocks), for `attn.out` (the
    core attention needs the forward's own arguments, its mask: the attention region replays
    the call it recorded) and the MoE experts' sites (rebuilt inside the experts' backward)."""
    spec = SITE_OF.get(site)
    if spec is None or submodule(layer, spec.slot) is None:
        return None
    if spec.made_by is not None:
        module = submodule(layer, spec.made_by)
        return None if module is None else functools.partial(_summed, module)
    if site == MLP_FC2_INPUT:
        return activation_of(layer.mlp.config)[1]
    if site == LN2_INPUT:
        return functools.partial(_attention_residual, layer)
    return None


def _summed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, a linear's `(output, bias)` summed as the next module in the forward sums it."""
    out = module(x)
    if isinstance(out, tuple):
        out, bias = out
        return out + bias if bias is not None else out
    return out


def _attention_residual(layer: torch.nn.Module, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`ln2.input`: the attention's output projection, through the layer's bias-dropout-add
    onto the residual stream (the block input, `ln1.input`)."""
    bda = layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)
    return bda(layer.self_attention.linear_proj(attn_out), residual, layer.hidden_dropout)
