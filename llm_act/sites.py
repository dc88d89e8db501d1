"""The block schema: every tensor a GPT block saves for backward, declared once (public API).

A `Site` states, for one saved tensor: the module slot that stores it and how the ledger
recognises it there, its tensor-parallel layout, its dtype rule and shape, the default
codec, what recomputes it, and the backward stage that reads it. The ledger, the layer
swap and spec, the recompute producers, measurement and the analytic model all derive
their tables from `BLOCK` (see docs/architecture.md, "Adding a site"), in the manner of
megatron-core's `TransformerLayerSubmodules`: slots declared once as typed fields.

Names may grow; once written they stay. This is the one production module that spells
them; code elsewhere uses the constants below (`ATTN_OUT`, ...) or the derived tables.
`ln1.input` is the block's checkpoint: it may be kept or compressed but never recomputed.
The one site outside the blocks that is planned, the final norm's input, is declared here
too (`Site.scope` "model", `MODEL_SITES`): the last layer's plan carries its choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional, get_args

# ---- the names (spelled here only) --------------------------------------------------------
LN1_INPUT = "ln1.input"
ATTN_QKV_INPUT = "attn.qkv_input"
ATTN_Q = "attn.q"
ATTN_K = "attn.k"
ATTN_V = "attn.v"
ATTN_SOFTMAX = "attn.softmax"
ATTN_DROPOUT_MASK = "attn.dropout_mask"
ATTN_OUT = "attn.out"
ATTN_HIDDEN_DROPOUT_MASK = "attn.hidden_dropout_mask"
LN2_INPUT = "ln2.input"
MLP_FC1_INPUT = "mlp.fc1_input"
MLP_ACT_INPUT = "mlp.act_input"
MLP_FC2_INPUT = "mlp.fc2_input"
MLP_HIDDEN_DROPOUT_MASK = "mlp.hidden_dropout_mask"
ATTN_Q_NORM_INPUT = "attn.q_norm_input"
ATTN_K_NORM_INPUT = "attn.k_norm_input"
MOE_ROUTER_INPUT = "moe.router_input"
MOE_FC1_INPUT = "moe.fc1_input"
MOE_ACT_INPUT = "moe.act_input"
MOE_FC2_INPUT = "moe.fc2_input"
MOE_ROUTING = "moe.routing"
#: planned outside the blocks: the input of the decoder's final norm (the last block's output)
FINAL_NORM_INPUT = "final_norm.input"
#: counted inside a block, not planned: the attention's logsumexp [b, heads, s] (float32),
#: kept when lossy Q/K/V are backpropagated from the stored output without a second forward
ATTN_LSE = "attn.lse"
#: counted outside the blocks, not planned
EMBEDDING_OUTPUT = "embedding.output"
EMBEDDING_DROPOUT_MASK = "embedding.dropout_mask"
LOSS_LOGITS = "loss.logits"
#: the chunked loss's saved logsumexp (an analytic term beside `loss.logits`)
LOSS_LOGSUMEXP = "loss.logsumexp"


class BlockDims(NamedTuple):
    """One rank's dimensions of a block, for the shape formulas (`Site.dims`)."""

    s: int          # sequence length
    sl: int         # the rank's share of the sequence (s / tp under sequence parallelism)
    b: int          # micro-batch size
    h: int          # hidden size
    a: int          # attention heads on this rank
    g: int          # query groups on this rank
    d: int          # head dim
    f1: int         # fc1's output width on this rank (2x ffn for a gated unit)
    f2: int         # fc2's input width on this rank
    rows: int = 0   # MoE: token rows routed to this rank's experts
    moe_f1: int = 0
    moe_f2: int = 0


#: the schema's closed vocabularies: a `Site` or `Tag` outside them is refused when it is
#: declared (`Site.__post_init__`), and type checkers see every comparison against them
Holder = Literal["norm", "column", "row", "bda", "mlp", "core_attention", "moe", "attention"]
Layout = Literal["replicated", "heads", "hidden", "ffn", "experts"]
SiteDtype = Literal["activation", "mask", "float32"]
Stage = Literal["mlp", "attention", "final"]
Family = Literal["qkv", "attention_internal", "qk_norm", "dense_mlp", "moe", "mask", "outer", "block"]
Need = Literal["dropout", "unfused_attention", "qk_layernorm", "dense", "moe", "last"]
Scope = Literal["layer", "model"]
TagHow = Literal["input", "output", "owns", "after"]


def _check_word(value: str, vocabulary, field: str, name: str) -> None:
    allowed = get_args(vocabulary)
    if value not in allowed:
        raise ValueError(f"site {name!r}: {field} {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Tag:
    """How the ledger recognises a site's tensors in the slot that stores it.

    - "input": the slot module's positional input `arg` is the site's tensor (pre-hook);
    - "output": the slot module's output is (the attention probabilities);
    - "owns": whatever the slot module saves inside itself, by default;
    - "after": saved in the layer itself (the bias-dropout-add) once the slot has run.
    """

    how: TagHow
    slot: str
    arg: int = 0


@dataclass(frozen=True)
class Site:
    """One saved tensor of a block."""

    name: str
    slot: str
    """the layer submodule (path relative to the TransformerLayer) that stores the site"""
    holder: Holder
    """the kind of module the layer swap puts in `slot`: "norm", "column" / "row" (the
    parallel linears), "bda" (bias-dropout-add), "mlp", "core_attention", "moe", or
    "attention" (SelfAttention itself, for the qk-norms' own slots)"""
    layout: Layout
    """how a tensor-parallel rank holds it (`TP_LAYOUT`)"""
    dtype: SiteDtype
    """"activation" (the model's dtype), "mask" (bool on CUDA's RNG, else the model's dtype)
    or "float32\""""
    dims: Callable[[BlockDims], tuple[int, ...]]
    codec: str
    """the "compress" plan's codec (Adacc sec. 3.2)"""
    stage: Stage
    """the backward stage that consumes it: "mlp" runs first, then "attention"; "final" for the
    final norm's input, consumed before any block backpropagates"""
    tags: tuple[Tag, ...]
    recomputed_from: tuple[str, ...] = ()
    """what its producer reads when the layers rebuild it (empty: only the whole block
    recomputes it)"""
    made_by: Optional[str] = None
    """the layer submodule (path relative to the TransformerLayer) whose forward, on the one
    tensor in `recomputed_from`, returns this site (a linear's `(output, bias)` is summed):
    the rebuild and its timing call it generically. None: the producer is special (the
    activation, the attention, the projection with bias-dropout-add)"""
    rebuild_reads: tuple[str, ...] = ()
    """what else the rebuild needs available, beside `recomputed_from` (the planner's view)"""
    alone: bool = False
    """the planner may choose "recompute" for this site by itself (`LayerRecompute.bind`
    rebuilds it from its producer's inputs). Not offered: `attn.q/k/v` (recomputed only
    with the whole block), `attn.out`, `attn.softmax`, `attn.dropout_mask` (the core
    attention is recomputed as one region: plan "recompute" or a JSON plan asks for it),
    and the hidden dropout masks ("recompute" there is the `regen` codec, which is offered)"""
    family: Family = "block"
    """"qkv", "attention_internal", "qk_norm", "dense_mlp", "moe", "mask", "outer" (saved once
    per model, after the blocks) or "block\""""
    needs: tuple[Need, ...] = ()
    """what a block needs to have the site: "dropout", "unfused_attention",
    "qk_layernorm", "dense", "moe", "last" (the model's last layer) (all of them)"""
    decode_group: Optional[str] = None
    """sites of one group are decoded at once by one backward op"""
    linear_backward: bool = True
    """whether the gradients the backward computes from this tensor are linear in it (a
    linear's input, V through probs @ V, the routing probability the experts scale by, an
    exact mask). Only there does an unbiased rounding give an unbiased gradient; where not
    (Q and K through the softmax, a norm's input, the activation's input) every lossy codec
    biases the gradient, stochastic rounding too (issue 42: SR INT2 at q/k/v alone cost the
    Llama-style bench model +3%), so plan "auto" charges it as it charges nearest rounding
    (`codecs.registry.unbiased_at`)"""
    scope: Scope = "layer"
    """where `slot` (and the ledger's tag slots) are found: "layer", relative to the
    TransformerLayer; "model", relative to the TransformerBlock that holds the layers -- a
    tensor saved once per model after its last layer (the final norm's input). A "model"
    site is planned as a site of the last layer (its plan carries the choice; `needs`
    "last"), priced as a block of its own (whole-block recompute never covers it) and never
    recomputed"""

    def __post_init__(self) -> None:
        for field, vocabulary in (("holder", Holder), ("layout", Layout), ("dtype", SiteDtype),
                                  ("stage", Stage), ("family", Family), ("scope", Scope)):
            _check_word(getattr(self, field), vocabulary, field, self.name)
        for need in self.needs:
            _check_word(need, Need, "need", self.name)
        for tag in self.tags:
            _check_word(tag.how, TagHow, "tag", self.name)


def _hid(x: BlockDims) -> tuple[int, ...]:
    return (x.sl, x.b, x.h)


def _heads(x: BlockDims) -> tuple[int, ...]:
    return (x.s, x.b, x.a, x.d)


def _groups(x: BlockDims) -> tuple[int, ...]:
    return (x.s, x.b, x.g, x.d)


def _scores(x: BlockDims) -> tuple[int, ...]:
    return (x.b, x.a, x.s, x.s)


_ATTN = "self_attention"
_CORE = "self_attention.core_attention"

#: The block, in the public order of `SITES` (names are appended as they are added; the
#: ledger ranks sites by it where one tensor's attribution is ambiguous).
BLOCK: tuple[Site, ...] = (
    Site(LN1_INPUT, "input_layernorm", "norm", "replicated", "activation", _hid, "outlier_int4",
         "attention", (Tag("input", "input_layernorm"), Tag("owns", "input_layernorm")), linear_backward=False),
    Site(ATTN_QKV_INPUT, "self_attention.linear_qkv", "column", "replicated", "activation", _hid,
         "outlier_int4", "attention",
         (Tag("input", "self_attention.linear_qkv"), Tag("owns", "self_attention.linear_qkv")),
         recomputed_from=(LN1_INPUT,), made_by="input_layernorm", alone=True),
    # saved by SelfAttention itself beside Q: RoPE's cos/sin tables, booked with Q
    Site(ATTN_Q, _CORE, "core_attention", "heads", "activation", _heads, "int4_channel", "attention",
         (Tag("input", _CORE, 0), Tag("owns", _ATTN)), family="qkv", decode_group="attention", linear_backward=False),
    Site(ATTN_K, _CORE, "core_attention", "heads", "activation", _groups, "int4_channel", "attention",
         (Tag("input", _CORE, 1),), family="qkv", decode_group="attention", linear_backward=False),
    Site(ATTN_V, _CORE, "core_attention", "heads", "activation", _groups, "int4_channel", "attention",
         (Tag("input", _CORE, 2),), family="qkv", decode_group="attention"),
    # the masked softmax: its output and the boolean causal mask the torch path saves; the
    # probabilities probs @ V reads, before and after dropout, are its output too
    Site(ATTN_SOFTMAX, _CORE + ".scale_mask_softmax", "core_attention", "heads", "activation",
         _scores, "int4_asym", "attention",
         (Tag("owns", _CORE + ".scale_mask_softmax"), Tag("output", _CORE + ".scale_mask_softmax"),
          Tag("output", _CORE + ".attention_dropout")),
         family="attention_internal", needs=("unfused_attention",), linear_backward=False),
    Site(ATTN_DROPOUT_MASK, _CORE + ".attention_dropout", "core_attention", "heads", "mask", _scores,
         "regen", "attention", (Tag("owns", _CORE + ".attention_dropout"),),
         family="attention_internal", needs=("unfused_attention", "dropout")),
    Site(ATTN_OUT, "self_attention.linear_proj", "row", "hidden", "activation",
         lambda x: (x.s, x.b, x.a * x.d), "outlier_int4", "attention",
         (Tag("input", "self_attention.linear_proj"), Tag("owns", "self_attention.linear_proj")),
         recomputed_from=(ATTN_Q, ATTN_K, ATTN_V), rebuild_reads=(ATTN_QKV_INPUT,),
         decode_group="attention"),
    Site(ATTN_HIDDEN_DROPOUT_MASK, "self_attn_bda", "bda", "replicated", "mask", _hid, "regen",
         "attention", (Tag("after", _ATTN),), family="mask", needs=("dropout",)),
    Site(LN2_INPUT, "pre_mlp_layernorm", "norm", "replicated", "activation", _hid, "outlier_int4",
         "mlp", (Tag("input", "pre_mlp_layernorm"), Tag("owns", "pre_mlp_layernorm")),
         recomputed_from=(ATTN_OUT, LN1_INPUT), rebuild_reads=(ATTN_HIDDEN_DROPOUT_MASK,),
         alone=True, linear_backward=False),
    Site(MLP_FC1_INPUT, "mlp.linear_fc1", "column", "replicated", "activation", _hid,
         "outlier_int4", "mlp", (Tag("input", "mlp.linear_fc1"), Tag("owns", "mlp.linear_fc1")),
         recomputed_from=(LN2_INPUT,), made_by="pre_mlp_layernorm", alone=True, family="dense_mlp",
         needs=("dense",)),
    Site(MLP_ACT_INPUT, "mlp", "mlp", "ffn", "activation", lambda x: (x.s, x.b, x.f1), "fewbit3",
         "mlp", (Tag("owns", "mlp"),), recomputed_from=(MLP_FC1_INPUT,), made_by="mlp.linear_fc1",
         alone=True,
         family="dense_mlp", needs=("dense",), linear_backward=False),
    Site(MLP_FC2_INPUT, "mlp.linear_fc2", "row", "ffn", "activation", lambda x: (x.s, x.b, x.f2),
         "outlier_int4", "mlp", (Tag("input", "mlp.linear_fc2"), Tag("owns", "mlp.linear_fc2")),
         recomputed_from=(MLP_ACT_INPUT,), alone=True, family="dense_mlp", needs=("dense",)),
    Site(MLP_HIDDEN_DROPOUT_MASK, "mlp_bda", "bda", "replicated", "mask", _hid, "regen", "mlp",
         (Tag("after", "mlp"), Tag("after", "moe")), family="mask", needs=("dropout",)),
    # qk-layernorm (Qwen3, OLMo 2): the per-head inputs [s, b, heads, head_dim] of
    # SelfAttention's q_layernorm / k_layernorm (before rotary)
    Site(ATTN_Q_NORM_INPUT, "self_attention.q_layernorm", "norm", "heads", "activation", _heads,
         "outlier_int4", "attention",
         (Tag("input", "self_attention.q_layernorm"), Tag("owns", "self_attention.q_layernorm")),
         family="qk_norm", needs=("qk_layernorm",), linear_backward=False),
    Site(ATTN_K_NORM_INPUT, "self_attention.k_layernorm", "norm", "heads", "activation", _groups,
         "outlier_int4", "attention",
         (Tag("input", "self_attention.k_layernorm"), Tag("owns", "self_attention.k_layernorm")),
         family="qk_norm", needs=("qk_layernorm",), linear_backward=False),
    # MoE blocks (MoELayer with SequentialMLP experts): the router's input (the pre-MLP norm
    # output), the permuted tokens entering the experts, the experts' activation input and
    # fc2 input (only the tokens routed to them), and the routing itself (the per-token
    # probabilities the experts scale by; scores, top-k and permutation indices stay exact).
    # Value codecs only at moe.act_input: the experts scale by the routing probability,
    # whose gradient needs f(x) itself. moe.fc1_input and moe.routing come out of the token
    # dispatcher: only the whole block recomputes them.
    Site(MOE_ROUTER_INPUT, "mlp.router", "moe", "replicated", "activation", _hid, "outlier_int4",
         "mlp", (Tag("input", "moe.router"),), recomputed_from=(LN2_INPUT,),
         made_by="pre_mlp_layernorm", family="moe",
         needs=("moe",)),
    Site(MOE_FC1_INPUT, "mlp.experts", "moe", "experts", "activation", lambda x: (x.rows, x.h),
         "outlier_int4", "mlp",
         (Tag("input", "moe.experts.*", 0), Tag("input", "moe.experts.*.linear_fc1"),
          Tag("owns", "moe.experts.*.linear_fc1")), family="moe", needs=("moe",)),
    Site(MOE_ACT_INPUT, "mlp.experts", "moe", "experts", "activation",
         lambda x: (x.rows, x.moe_f1), "outlier_int4", "mlp", (Tag("owns", "moe.experts.*"),),
         recomputed_from=(MOE_FC1_INPUT,), family="moe", needs=("moe",), linear_backward=False),
    Site(MOE_FC2_INPUT, "mlp.experts", "moe", "experts", "activation",
         lambda x: (x.rows, x.moe_f2), "outlier_int4", "mlp",
         (Tag("input", "moe.experts.*.linear_fc2"), Tag("owns", "moe.experts.*.linear_fc2")),
         recomputed_from=(MOE_ACT_INPUT, MOE_ROUTING), family="moe", needs=("moe",)),
    Site(MOE_ROUTING, "mlp.router", "moe", "experts", "float32", lambda x: (x.rows,), "int8", "mlp",
         (Tag("owns", "moe"), Tag("owns", "moe.router"), Tag("owns", "moe.experts"),
          Tag("input", "moe.experts.*", 1)), family="moe", needs=("moe",)),
    # after the blocks: the decoder's final norm (TransformerBlock.final_layernorm, on the last
    # pipeline stage) saves its input, the last block's output (the residual stream: under
    # sequence parallelism the rank's token shard), with exact per-row statistics
    Site(FINAL_NORM_INPUT, "final_layernorm", "norm", "replicated", "activation", _hid,
         "outlier_int4", "final", (Tag("input", "final_layernorm"), Tag("owns", "final_layernorm")),
         family="outer", needs=("last",), scope="model", linear_backward=False),
)

#: Ledger roles that store nothing of their own (what is saved there goes to "other").
SLOTS_WITHOUT_SITE: tuple[str, ...] = (_CORE,)

#: Counted by the ledger inside a block but not planned: what a choice at another site brings
#: with it (`ATTN_LSE`).
COUNTED_SITES: tuple[str, ...] = (ATTN_LSE,)

#: Counted by the ledger outside the blocks, not planned (the final norm's input is planned:
#: `MODEL_SITES`).
OUTER_SITES: tuple[str, ...] = (EMBEDDING_OUTPUT, EMBEDDING_DROPOUT_MASK, LOSS_LOGITS)

#: The block's checkpoint: kept or encoded, never recomputed (recomputation starts from it).
CHECKPOINT_SITE = LN1_INPUT

# ---- tables derived from BLOCK (`_derive`) --------------------------------------------------
SITE_OF: dict[str, Site]
SITES: tuple[str, ...]
#: Planned sites outside the blocks (`Site.scope` "model"): each stored once, after the last
#: layer, whose plan carries its choice; never recomputed, never part of a whole-block recompute.
MODEL_SITES: tuple[str, ...]
#: The attention's inputs after rotary (views of one QKV buffer in megatron-core).
QKV_SITES: tuple[str, ...]
#: What the core attention saves internally (Megatron's "selective" recompute re-runs it).
ATTENTION_INTERNAL_SITES: tuple[str, ...]
#: Sites only some blocks have (megatron-core `qk_layernorm=True`).
QK_NORM_SITES: tuple[str, ...]
#: Sites of a dense MLP and of an MoE layer: a block has one family or the other.
DENSE_MLP_SITES: tuple[str, ...]
MOE_SITES: tuple[str, ...]
MASK_SITES: frozenset[str]
#: Sites whose backward is linear in the stored tensor (`Site.linear_backward`).
LINEAR_BACKWARD: frozenset[str]
#: The "compress" plan (Adacc sec. 3.2): layer-specific default codec per site.
DEFAULT_CODECS: dict[str, str]
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
TP_LAYOUT: dict[str, str]
#: site -> the sites its producer reads when the layers rebuild it
PRODUCER_INPUTS: dict[str, tuple[str, ...]]
#: sites the planner may choose "recompute" for one by one (`LayerRecompute.bind` rebuilds
#: each from its producer's inputs)
RECOMPUTABLE: frozenset[str]
#: the block's backward stages in the order they run, each with the sites it consumes
BACKWARD_STAGES: tuple[tuple[str, tuple[str, ...]], ...]
#: sites whose decoded copies one backward op needs at once (any other site is its own group)
DECODE_GROUPS: tuple[frozenset[str], ...]


def sites_where(**fields) -> tuple[str, ...]:
    """The names of the sites whose fields equal `fields`, in block order."""
    return tuple(s.name for s in BLOCK if all(getattr(s, k) == v for k, v in fields.items()))


def _derive() -> None:
    """(Re)build every table above from `BLOCK`."""
    g = globals()
    g["SITE_OF"] = {site.name: site for site in BLOCK}
    g["SITES"] = tuple(SITE_OF)
    g["MODEL_SITES"] = sites_where(scope="model")
    g["QKV_SITES"] = sites_where(family="qkv")
    g["ATTENTION_INTERNAL_SITES"] = sites_where(family="attention_internal")
    g["QK_NORM_SITES"] = sites_where(family="qk_norm")
    g["DENSE_MLP_SITES"] = sites_where(family="dense_mlp")
    g["MOE_SITES"] = sites_where(family="moe")
    g["MASK_SITES"] = frozenset(s.name for s in BLOCK if s.dtype == "mask")
    g["DEFAULT_CODECS"] = {s.name: s.codec for s in BLOCK}
    g["LINEAR_BACKWARD"] = frozenset(s.name for s in BLOCK if s.linear_backward)
    g["TP_LAYOUT"] = {s.name: s.layout for s in BLOCK}
    g["PRODUCER_INPUTS"] = {s.name: s.recomputed_from for s in BLOCK if s.recomputed_from}
    g["RECOMPUTABLE"] = frozenset(s.name for s in BLOCK if s.alone)
    g["BACKWARD_STAGES"] = tuple((stage, sites_where(stage=stage)) for stage in ("mlp", "attention"))
    g["DECODE_GROUPS"] = tuple(frozenset(sites_where(decode_group=group)) for group in
                               dict.fromkeys(s.decode_group for s in BLOCK if s.decode_group))


_derive()


def declare(*sites: Site) -> None:
    """Add sites to the schema, as if `BLOCK` declared them (for a test of the schema; call
    it before importing the modules that derive from it)."""
    global BLOCK
    for site in sites:
        if site.name in SITE_OF:
            raise ValueError(f"site {site.name!r} is declared already")
    BLOCK = BLOCK + tuple(sites)
    _derive()


def present(site: str, *, dropout: bool, unfused_attention: bool, qk_layernorm: bool,
            moe: bool, last: bool = False) -> bool:
    """Whether a block with these features has `site` (`Site.needs`); `last`: the model's
    last layer, whose plan carries the sites after the blocks (`MODEL_SITES`)."""
    have = {"dropout": dropout, "unfused_attention": unfused_attention,
            "qk_layernorm": qk_layernorm, "dense": not moe, "moe": moe, "last": last}
    return all(have[n] for n in SITE_OF[check_site(site)].needs)


def tp_replicated(site: str, sequence_parallel: bool) -> bool:
    """Whether every rank of a tensor-parallel group stores the same tensor at `site`
    (`TP_LAYOUT`): only the "replicated" sites, and only without sequence parallelism.
    Where it is, the ranks' codecs must round alike (their replicated parameters'
    gradients must agree); everywhere else the ranks hold different data and need
    independent rounding noise (`llm_act.runtime.seeds.codec_seed`)."""
    return TP_LAYOUT[check_site(site)] == "replicated" and not sequence_parallel


def check_site(site: str) -> str:
    if site not in SITE_OF:
        raise ValueError(f"unknown site {site!r}; known sites: {', '.join(SITES)}")
    return site
