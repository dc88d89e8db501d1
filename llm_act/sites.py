"""Names of the tensors a GPT block saves for backward (part of the public API).

Names may grow; once written they stay. `ln1.input` is the block's checkpoint: it may be
kept or compressed but never recomputed.
"""
from __future__ import annotations

SITES: tuple[str, ...] = (
    "ln1.input",
    "attn.qkv_input",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.softmax",
    "attn.dropout_mask",
    "attn.out",
    "attn.hidden_dropout_mask",
    "ln2.input",
    "mlp.fc1_input",
    "mlp.act_input",
    "mlp.fc2_input",
    "mlp.hidden_dropout_mask",
    # qk-layernorm (Qwen3, OLMo 2): the inputs of SelfAttention's q_layernorm / k_layernorm,
    # per head [s, b, heads, head_dim] (before rotary)
    "attn.q_norm_input",
    "attn.k_norm_input",
    # MoE blocks (megatron-core MoELayer with SequentialMLP experts): the router's input (the
    # pre-MLP norm output), the permuted tokens entering the experts, the experts' activation
    # input and fc2 input (only the tokens routed to them: no dropped or padded rows), and the
    # routing itself (the per-token probabilities the experts scale by, and what the router
    # and the token dispatcher keep: scores, top-k and permutation indices)
    "moe.router_input",
    "moe.fc1_input",
    "moe.act_input",
    "moe.fc2_input",
    "moe.routing",
)

#: The block's checkpoint: kept or encoded, never recomputed (recomputation starts from it).
CHECKPOINT_SITE = "ln1.input"

#: The attention's inputs after rotary (views of one QKV buffer in megatron-core).
QKV_SITES: tuple[str, ...] = ("attn.q", "attn.k", "attn.v")

#: What the core attention saves internally (Megatron's "selective" recompute re-runs it).
ATTENTION_INTERNAL_SITES: tuple[str, ...] = ("attn.softmax", "attn.dropout_mask")

#: Sites only some blocks have (megatron-core `qk_layernorm=True`).
QK_NORM_SITES: tuple[str, ...] = ("attn.q_norm_input", "attn.k_norm_input")

#: Sites of a dense MLP and of an MoE layer: a block has one family or the other.
DENSE_MLP_SITES: tuple[str, ...] = ("mlp.fc1_input", "mlp.act_input", "mlp.fc2_input")
MOE_SITES: tuple[str, ...] = (
    "moe.router_input", "moe.fc1_input", "moe.act_input", "moe.fc2_input", "moe.routing")

MASK_SITES: frozenset[str] = frozenset(
    {"attn.dropout_mask", "attn.hidden_dropout_mask", "mlp.hidden_dropout_mask"}
)

#: Counted by the ledger inside a block but not planned: what a choice at another site brings
#: with it. `attn.lse`: the attention's logsumexp [b, heads, s] (float32), kept when lossy
#: Q/K/V are backpropagated from the stored output without a second forward
#: (`llm_act.attention`, lossy_backward="stored").
COUNTED_SITES: tuple[str, ...] = ("attn.lse",)

#: Counted by the ledger outside the blocks, not planned.
OUTER_SITES: tuple[str, ...] = ("embedding.output", "embedding.dropout_mask", "loss.logits")

#: The "compress" plan (Adacc sec. 3.2): layer-specific default codec per site.
DEFAULT_CODECS: dict[str, str] = {
    "ln1.input": "outlier_int4",
    "attn.qkv_input": "outlier_int4",
    "attn.q": "int4_channel",
    "attn.k": "int4_channel",
    "attn.v": "int4_channel",
    "attn.softmax": "int4_asym",
    "attn.dropout_mask": "regen",
    "attn.out": "outlier_int4",
    "attn.hidden_dropout_mask": "regen",
    "ln2.input": "outlier_int4",
    "mlp.fc1_input": "outlier_int4",
    "mlp.act_input": "fewbit3",
    "mlp.fc2_input": "outlier_int4",
    "mlp.hidden_dropout_mask": "regen",
    "attn.q_norm_input": "outlier_int4",
    "attn.k_norm_input": "outlier_int4",
    # MoE: value codecs only (the experts scale by the routing probability, whose gradient
    # needs f(x) itself, so few-bit derivative codecs do not apply at moe.act_input); the
    # routing codec encodes the per-token probabilities (indices stay exact)
    "moe.router_input": "outlier_int4",
    "moe.fc1_input": "outlier_int4",
    "moe.act_input": "outlier_int4",
    "moe.fc2_input": "outlier_int4",
    "moe.routing": "int8",
}


#: How a tensor-parallel rank holds the tensor each site stores (megatron-core 0.16):
#: - "replicated": the whole tensor on every TP rank when sequence parallelism is off (the
#:   residual stream [s, b, h] after the row-parallel all-reduce, which the norms save; the
#:   column-parallel linears' input, which `copy_to_tensor_model_parallel_region` hands
#:   whole to every rank; the hidden dropout of bias-dropout-add, drawn from the default
#:   generator on that replicated stream). Under sequence parallelism the same tensors are
#:   the rank's own token shard [s/tp, b, h]: the stream is reduce-scattered, a
#:   column-parallel linear saves (here: encodes) its local shard before the all-gather,
#:   and `TransformerBlock.forward` runs the layers in the RNG tracker's fork (each shard
#:   draws its own dropout).
#: - "heads": the rank's attention heads (`num_attention_heads_per_partition`, K/V
#:   `num_query_groups_per_partition`; attention dropout in the RNG tracker's fork; the
#:   qk-layernorm inputs [s, b, heads, head_dim] of the rank's query heads / query groups).
#: - "hidden": the rank's slice of the hidden dim, the row-parallel `linear_proj` input
#:   [s, b, h/tp] (`input_is_parallel`; sequence parallelism leaves it whole in s).
#: - "ffn": the rank's slice of the MLP dim, [s, b, ffn/tp] (fc1 is column-parallel with
#:   `gather_output=False`, fc2 row-parallel with `input_is_parallel`).
#: - "experts": the tokens routed to this rank's experts (after the token dispatcher), which
#:   differ from rank to rank of a TP group whenever its ranks hold different experts or
#:   different token shards.
TP_LAYOUT: dict[str, str] = {
    "ln1.input": "replicated",
    "attn.qkv_input": "replicated",
    "attn.q": "heads",
    "attn.k": "heads",
    "attn.v": "heads",
    "attn.softmax": "heads",
    "attn.dropout_mask": "heads",
    "attn.out": "hidden",
    "attn.hidden_dropout_mask": "replicated",
    "ln2.input": "replicated",
    "mlp.fc1_input": "replicated",
    "mlp.act_input": "ffn",
    "mlp.fc2_input": "ffn",
    "mlp.hidden_dropout_mask": "replicated",
    "attn.q_norm_input": "heads",
    "attn.k_norm_input": "heads",
    "moe.router_input": "replicated",
    "moe.fc1_input": "experts",
    "moe.act_input": "experts",
    "moe.fc2_input": "experts",
    "moe.routing": "experts",
}
assert set(TP_LAYOUT) == set(SITES), "every site needs its tensor-parallel layout"


def tp_replicated(site: str, sequence_parallel: bool) -> bool:
    """Whether every rank of a tensor-parallel group stores the same tensor at `site`
    (`TP_LAYOUT`): only the "replicated" sites, and only without sequence parallelism.
    Where it is, the ranks' codecs must round alike (their replicated parameters'
    gradients must agree); everywhere else the ranks hold different data and need
    independent rounding noise (`llm_act.runtime.controller.codec_seed`)."""
    return TP_LAYOUT[check_site(site)] == "replicated" and not sequence_parallel


def check_site(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; known sites: {', '.join(SITES)}")
    return site
