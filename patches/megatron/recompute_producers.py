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

The table lives apart from the binder (`recompute.LayerRecompute`) because both the binder
(validation) and the per-forward frame (`recompute_region._Frame`, which walks it) read it.
"""
from __future__ import annotations

from llm_act.sites import QKV_SITES

#: site -> the sites its producer reads
PRODUCER_INPUTS: dict[str, tuple[str, ...]] = {
    "attn.qkv_input": ("ln1.input",),
    "attn.out": QKV_SITES,
    "ln2.input": ("attn.out", "ln1.input"),
    "mlp.fc1_input": ("ln2.input",),
    "mlp.act_input": ("mlp.fc1_input",),
    "mlp.fc2_input": ("mlp.act_input",),
    "moe.router_input": ("ln2.input",),
    "moe.act_input": ("moe.fc1_input",),
    "moe.fc2_input": ("moe.act_input", "moe.routing"),
}
#: MoE sites recomputed only with the whole block (the token dispatcher produces them)
MOE_FULL_ONLY = ("moe.fc1_input", "moe.routing")
