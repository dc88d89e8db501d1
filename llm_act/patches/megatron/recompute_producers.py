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
"""
from __future__ import annotations

from llm_act.sites import BLOCK, PRODUCER_INPUTS

__all__ = ["MOE_FULL_ONLY", "PRODUCER_INPUTS"]

#: MoE sites recomputed only with the whole block (the token dispatcher produces them)
MOE_FULL_ONLY: tuple[str, ...] = tuple(s.name for s in BLOCK if s.family == "moe" and not s.recomputed_from)
