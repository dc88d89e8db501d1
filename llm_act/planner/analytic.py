"""An analytic profile of a GPT block from its shape alone: no GPU, no model, no data.

`llm-act plan` needs a profile before anything runs (to size a job on paper), so this
module derives one from the model's shape and a device model. Which sites a block has,
their shapes and dtypes and what their producers read come from the block schema
(`llm_act.sites.BLOCK`); what is here is their cost (`_COSTS`), and a site the schema adds
without one is still counted, at its tensor's bytes, not recomputed.

- bytes: each site's tensor per tensor-parallel rank, as megatron-core stores it
  ([s, b, h] layout; heads, query groups and the FFN split over TP; the [s, b, h]
  tensors a norm or a dropout sees also split over TP along s under sequence
  parallelism); a codec's bytes come from its own `nbytes_for`. What stock megatron-core
  keeps beside a site's tensor is counted with it: a norm's fp32 statistics per row (with the
  norm's output, `attn.qkv_input` / `mlp.fc1_input`: recomputing it drops them), RoPE's
  cos/sin tables (with `attn.q`, as the ledger books them), and on the unfused
  ("stock") attention the probabilities probs @ V reads beside the softmax output (5as^2b in
  16 bits with dropout, Korthikanti et al.) and, under GQA, K and V repeated to every query
  head. With qk-layernorm the per-head norm inputs are sites (`attn.q_norm_input`,
  `attn.k_norm_input`). An MoE block (`num_experts`) has the `moe.*` sites instead of
  `mlp.*`, sized by the rows its experts receive on one rank (`ModelShape.moe_rows`: top-k
  rows per token, cut by the capacity factor, spread evenly over the experts; padding is
  never stored under a codec, and load imbalance is left to the measured profile).
  `DeviceModel` says what differs on CPU: no fused softmax kernel (an
  fp32 softmax and the bool causal mask are stored) and dropout masks in the model dtype.
  tests/planner/test_budget_analytic_ledger.py checks every site against the ledger.
- times: the producer op's forward time (what recomputing the site costs) from its FLOPs
  at `DeviceModel.matmul_tflops`, or from the bytes it moves at `DeviceModel.hbm_gbs`, plus
  one launch latency per op and the TP collective it contains at `DeviceModel.link_gbs`;
  a codec's encode and decode time from the bytes each pass reads and writes.
- noise: S(option) = the codec's `expected_error` on a unit-variance normal tensor of a
  small fixed shape. This is a *prior*: measured profiles (real activations, outlier
  rates, sensitivities) replace it during training.

Everything is per rank and per micro-batch. The bytes are exact for the stated layout;
the times are a roofline estimate, good for ranking options, not for a stopwatch.

One job: the block, and the planned site after the blocks (the final norm's input,
`outer_profile`: a block of its own on the last stage). The model's shape and the device
model it reads are in `llm_act.planner.model_shape`; what a rank holds outside its blocks
(the loss, the output layer's input, weights and optimizer state) is in
`llm_act.planner.static_memory`, which reads this module, never the other way round.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from llm_act import sites as schema  # BLOCK and its tables, as `declare` leaves them
from llm_act.codecs.registry import CODEC_NAMES, accepts, make_codec
from llm_act.planner.model_shape import DeviceModel, ModelShape  # ModelShape: public here too
from llm_act.planner.profile import BlockProfile, CodecOption, SiteProfile
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_HIDDEN_DROPOUT_MASK,
    ATTN_K,
    ATTN_K_NORM_INPUT,
    ATTN_OUT,
    ATTN_Q,
    ATTN_QKV_INPUT,
    ATTN_Q_NORM_INPUT,
    ATTN_SOFTMAX,
    ATTN_V,
    CHECKPOINT_SITE,
    FINAL_NORM_INPUT,
    LN2_INPUT,
    MLP_ACT_INPUT,
    MLP_FC1_INPUT,
    MLP_FC2_INPUT,
    MLP_HIDDEN_DROPOUT_MASK,
    MOE_ACT_INPUT,
    MOE_FC1_INPUT,
    MOE_FC2_INPUT,
    MOE_ROUTER_INPUT,
    MOE_ROUTING,
    Site,
    present,
)

#: the stored state of a CUDA philox generator (seed + offset), when no CUDA is here to ask
_PHILOX_STATE_BYTES = 16
#: the tensor on which each codec's noise prior S is measured
_PRIOR_SHAPE = (64, 512)


# ---- codecs: cached instances and noise priors ---------------------------------------------
@functools.lru_cache(maxsize=None)
def _codec(name: str, activation: str):
    return make_codec(name, activation=activation)


@functools.lru_cache(maxsize=None)
def codec_variance(name: str, activation: str = "gelu") -> float:
    """The prior S(option): `expected_error` of codec `name` on a unit-variance normal
    float32 tensor of shape (64, 512), drawn from a fixed seed (0 for lossless codecs).
    Measured profiles replace it; it only ranks codecs against each other."""
    codec = _codec(name, activation)
    if codec.lossless:
        return 0.0
    x = torch.randn(_PRIOR_SHAPE, generator=torch.Generator().manual_seed(0))
    return float(codec.expected_error(x))


def _allowed(site: str, name: str, shape: ModelShape) -> bool:
    """The schema's rule (`registry.accepts`) for the shape's MLP kind: a gated unit's
    backward needs f(a) itself for the gate's gradient, not only f'(a)."""
    return accepts(site, name, shape.mlp_kind)


def _codec_bytes(name: str, dims: tuple[int, ...], dtype: torch.dtype, shape: ModelShape,
                 device: DeviceModel, outlier_frac: float) -> int:
    codec = _codec(name, shape.activation)
    if name == "outlier_int4":  # its fixed outlier slots, whatever the data's outlier rate
        return codec.nbytes_for(dims, dtype)
    if name == "regen":
        try:
            return codec.nbytes_for(dims, dtype, device=device.rng_device)
        except RuntimeError:  # no CUDA here to ask: a philox state is its seed and offset
            return _PHILOX_STATE_BYTES
    return codec.nbytes_for(dims, dtype)


def _options(site: str, dims, dtype, extra: int, shape: ModelShape, device: DeviceModel,
             outlier_frac: float) -> tuple[CodecOption, ...]:
    """Every codec check_choice admits at `site`, with its bytes, times and noise prior.
    `extra` bytes stay uncompressed beside the codec's record (the logsumexp of attn.out)."""
    full = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    out = []
    for name in CODEC_NAMES:
        if not _allowed(site, name, shape):
            continue
        stored = _codec_bytes(name, dims, dtype, shape, device, outlier_frac)
        if name == "regen":  # nothing to write; backward draws the mask again
            enc, dec = 0.0, device.mem_ms(full)
        else:
            reads = 2 * full if name == "outlier_int4" else full  # + the column-sum pass
            enc, dec = device.mem_ms(reads + stored), device.mem_ms(stored + full)
        out.append(CodecOption(name, stored + extra, enc, dec, codec_variance(name, shape.activation)))
    return tuple(out)


# ---- the block ------------------------------------------------------------------------------
@dataclass
class _Site:
    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype
    forward_ms: Optional[float]
    inputs: tuple[str, ...] = ()
    extra: int = 0
    keep_bytes: Optional[int] = None
    """what keeping the site holds, when more than the tensor (a view keeping its base)"""


@dataclass(frozen=True)
class _Cost:
    """What the analytic model knows of a site beyond its tensor (the schema's `Site.dims` and
    `Site.dtype`)."""

    forward_ms: Optional[float] = None
    """the producer's forward time, what recomputing the site costs (None: not priced)"""
    extra: int = 0
    """bytes stored uncompressed beside the tensor, or beside a codec's record"""
    keep_bytes: Optional[int] = None
    """what keeping the site holds, when more than the tensor (a view keeping its base)"""
    inputs: Optional[tuple[str, ...]] = None
    """what the priced producer reads, where it is not the layers' rebuild (None: the schema's
    `recomputed_from + rebuild_reads`); sites the block lacks are dropped"""


def _collective_bytes(shape: ModelShape, full_bytes: int, kind: str) -> float:
    """Bytes one rank sends for a TP collective over a tensor of `full_bytes`."""
    t = shape.tp
    if t == 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (t - 1) / t * full_bytes


class _Terms:
    """The figures of one block of `shape` on `device` that several sites' costs share."""

    def __init__(self, shape: ModelShape, device: DeviceModel):
        self.shape, self.device = shape, device
        x = self.x = shape.block_dims
        self.e = shape.elem_bytes
        self.tokens = x.s * x.b
        self.n_hid = x.sl * x.b * x.h
        self.scores = x.b * x.a * x.s * x.s
        self.drop = shape.dropout > 0
        self.rope = shape.position_embedding == "rope"
        # a norm keeps fp32 statistics per row for its backward (LayerNorm mean and rstd, RMSNorm
        # rstd); booked with its output, whose recomputation re-runs the norm and drops them
        self.stats_per_row = (2 if shape.normalization == "LayerNorm" else 1) * 4
        self.norm_stats = self.stats_per_row * x.sl * x.b
        self.norm_ms = device.mem_ms(2 * self.n_hid * self.e)
        self.qkv_gather = self.gather(self.tokens * x.h * self.e)
        # the fused QKV output, and whether the stock attention under GQA saves K and V
        # repeated to every query head
        self.qkv_buffer = self.tokens * (x.a + 2 * x.g) * x.d * self.e
        self.repeated = not shape.fused_attention and x.a > x.g

    def gather(self, nbytes: int) -> float:
        """SP: the linear's input is all-gathered from the shards."""
        if self.shape.sequence_parallel and self.shape.tp > 1:
            return self.device.link_ms(_collective_bytes(self.shape, nbytes, "all_gather"))
        return 0.0

    def proj(self, heads: int) -> float:
        """This head group's share of the QKV GEMM (and of its input gather)."""
        x = self.x
        share = heads / (x.a + 2 * x.g)
        return self.device.gemm_ms(2 * self.tokens * x.h * heads * x.d) + share * self.qkv_gather

    def qk_ms(self, heads: int) -> float:
        """The elementwise passes over Q or K (RoPE, the qk-layernorm)."""
        passes = (1 if self.rope else 0) + (1 if self.shape.qk_layernorm else 0)
        return passes * self.device.mem_ms(2 * self.tokens * heads * self.x.d * self.e) if passes else 0.0


def _unpriced(blk: _Terms) -> _Cost:
    """The checkpoint, and what only the whole block recomputes (the MoE dispatcher's output)."""
    return _Cost()


def _norm_output(blk: _Terms) -> _Cost:
    """A norm's output, with the norm's statistics (re-running the norm drops them)."""
    return _Cost(blk.norm_ms, extra=blk.norm_stats)


def _q(blk: _Terms) -> _Cost:
    """RoPE's cos and sin tables [s, 1, 1, d] for Q and for K, saved by the rotation whatever Q
    and K store (gone only when the whole block is recomputed); the ledger books them with Q."""
    x = blk.x
    tables = 4 * x.s * x.d * blk.e if blk.rope else 0
    return _Cost(blk.proj(x.a) + blk.qk_ms(x.a), extra=tables, inputs=(ATTN_QKV_INPUT,))


def _k(blk: _Terms) -> _Cost:
    """The stock attention under GQA saves K repeated to every query head."""
    x = blk.x
    keep = blk.tokens * x.a * x.d * blk.e if blk.repeated else None
    return _Cost(blk.proj(x.g) + blk.qk_ms(x.g), keep_bytes=keep, inputs=(ATTN_QKV_INPUT,))


def _v(blk: _Terms) -> _Cost:
    """With RoPE or qk-layernorm, Q and K are new tensors and V is the last view of the fused
    QKV output: keeping V keeps that whole buffer (a codec or recompute stores V's share only).
    Repeated under GQA, the view of V is not saved, but the qk-layernorm's saved K input holds it."""
    x, qk_norm = blk.x, blk.shape.qk_layernorm
    if blk.repeated:
        keep = blk.tokens * x.a * x.d * blk.e + (blk.qkv_buffer if qk_norm else 0)
    else:
        keep = blk.qkv_buffer if blk.rope or qk_norm else None
    return _Cost(blk.proj(x.g), keep_bytes=keep, inputs=(ATTN_QKV_INPUT,))


def _q_norm_input(blk: _Terms) -> _Cost:
    """The per-head input of SelfAttention's q norm, with the norm's fp32 statistics per (token,
    head) row (kept beside a codec's record too). A view of the fused QKV output, which `attn.v`
    already books whole, except under GQA with several query groups, where megatron's reshape
    of a group's query slice copies."""
    x = blk.x
    stats = blk.stats_per_row * blk.tokens * x.a
    copied = blk.tokens * x.a * x.d * blk.e if 1 < x.g < x.a else 0
    return _Cost(blk.proj(x.a), extra=stats, keep_bytes=copied + stats, inputs=(ATTN_QKV_INPUT,))


def _k_norm_input(blk: _Terms) -> _Cost:
    """The k norm's input, a view of the QKV output `attn.v` books: keeping it adds the statistics."""
    stats = blk.stats_per_row * blk.tokens * blk.x.g
    return _Cost(blk.proj(blk.x.g), extra=stats, keep_bytes=stats, inputs=(ATTN_QKV_INPUT,))


def _softmax(blk: _Terms) -> _Cost:
    """Stock megatron keeps the softmax output (fp32 on the unfused torch path) and the
    probabilities probs @ V reads: the dropped ones under dropout, else the 16-bit copy of an
    fp32 softmax (Korthikanti et al.: 5as^2b in 16 bits with dropout and the fused kernel). A
    codec stores the probabilities alone. (The memory-efficient kernel has no softmax site.)"""
    x, e, dev, scores = blk.x, blk.e, blk.device, blk.scores
    softmax_bytes = e if dev.fused_softmax else 4
    copy = blk.drop or softmax_bytes != e  # probs @ V reads another tensor: dropped, or the 16-bit cast
    kept = scores * (softmax_bytes + (e if copy else 0))
    if not dev.fused_softmax:
        kept += x.s * x.s  # the torch path's masked_fill keeps megatron's [s, s] bool causal mask
    return _Cost(dev.gemm_ms(2 * scores * x.d) + dev.mem_ms(3 * scores * e), keep_bytes=kept,
                 inputs=(ATTN_Q, ATTN_K))


def _attention_mask(blk: _Terms) -> _Cost:
    """The stock attention's dropout mask (the memory-efficient kernel draws it inside)."""
    return _Cost(blk.device.mem_ms(blk.scores))


def _attn_out(blk: _Terms) -> _Cost:
    """The flash-style kernel: QK^T and PV, half of them skipped under the causal mask; it
    stores its output and the fp32 logsumexp [b, a, s]. The stock attention: probs @ V."""
    x, dev, scores = blk.x, blk.device, blk.scores
    if blk.shape.fused_attention:
        return _Cost(dev.gemm_ms(4 * scores * x.d / 2), extra=x.b * x.a * x.s * 4,
                     inputs=(ATTN_Q, ATTN_K, ATTN_V))
    pv = dev.gemm_ms(2 * scores * x.d)
    if blk.drop:
        pv += dev.mem_ms((2 * blk.e + 1) * scores)
    return _Cost(pv, inputs=(ATTN_SOFTMAX, ATTN_V, ATTN_DROPOUT_MASK))


def _hidden_mask(blk: _Terms) -> _Cost:
    return _Cost(blk.device.mem_ms(blk.n_hid))


def _ln2_input(blk: _Terms) -> _Cost:
    """linear_proj, its TP reduction, and the bias-dropout-add (read projection and residual,
    and the mask under dropout, write the sum)."""
    x, e, dev, shape = blk.x, blk.e, blk.device, blk.shape
    bda = 3 * blk.n_hid * e
    if blk.drop:
        bda += blk.n_hid
    reduce_kind = "reduce_scatter" if shape.sequence_parallel else "all_reduce"
    reduce = dev.link_ms(_collective_bytes(shape, blk.tokens * x.h * e, reduce_kind)) if shape.tp > 1 else 0.0
    return _Cost(dev.gemm_ms(2 * blk.tokens * x.a * x.d * x.h) + reduce + dev.mem_ms(bda),
                 inputs=(CHECKPOINT_SITE, ATTN_OUT, ATTN_HIDDEN_DROPOUT_MASK))


def _mlp_act_input(blk: _Terms) -> _Cost:
    x = blk.x
    return _Cost(blk.device.gemm_ms(2 * blk.tokens * x.h * x.f1) + blk.gather(blk.tokens * x.h * blk.e))


def _mlp_fc2_input(blk: _Terms) -> _Cost:
    return _Cost(blk.device.mem_ms(blk.tokens * (blk.x.f1 + blk.x.f2) * blk.e))


def _moe_act_input(blk: _Terms) -> _Cost:
    """Keeping it holds what stock SequentialMLP experts keep after fc1: fc1's output, and the
    activation's output that the probability multiply reads (a gated unit also keeps its
    gate's output and the linear half)."""
    x = blk.x
    after_fc1 = x.rows * (x.moe_f1 + (3 if blk.shape.gated_linear_unit else 1) * x.moe_f2) * blk.e
    return _Cost(blk.device.gemm_ms(2 * x.rows * x.h * x.moe_f1), keep_bytes=after_fc1)


def _moe_fc2_input(blk: _Terms) -> _Cost:
    x = blk.x
    return _Cost(blk.device.mem_ms(x.rows * (x.moe_f1 + 2 * x.moe_f2) * blk.e))


def _final_norm_input(blk: _Terms) -> _Cost:
    """The final norm's input (the last block's output) with the norm's fp32 statistics per
    row, kept exactly beside a codec's record; not recomputed (it is the blocks' output)."""
    return _Cost(extra=blk.norm_stats)


def _moe_routing(blk: _Terms) -> _Cost:
    """The per-row probabilities; the router's fp32 scores, the routing map and the top-k and
    permutation indices stay exact beside them. Out of the token dispatcher: only the whole
    block recomputes it."""
    shape, rows = blk.shape, blk.x.rows
    tokens = shape.moe_tokens
    indices = tokens * shape.num_experts * (4 + 1) + tokens * shape.moe_topk * 8 + rows * 8
    return _Cost(extra=indices)


#: site -> its cost in the analytic model; the order is the profile's (a site of the schema
#: missing here comes last, its tensor's bytes alone, not recomputed)
_COSTS: dict[str, Callable[[_Terms], _Cost]] = {
    CHECKPOINT_SITE: _unpriced,
    ATTN_QKV_INPUT: _norm_output,
    ATTN_Q: _q,
    ATTN_K: _k,
    ATTN_V: _v,
    ATTN_Q_NORM_INPUT: _q_norm_input,
    ATTN_K_NORM_INPUT: _k_norm_input,
    ATTN_SOFTMAX: _softmax,
    ATTN_DROPOUT_MASK: _attention_mask,
    ATTN_OUT: _attn_out,
    ATTN_HIDDEN_DROPOUT_MASK: _hidden_mask,
    LN2_INPUT: _ln2_input,
    MLP_FC1_INPUT: _norm_output,
    MLP_ACT_INPUT: _mlp_act_input,
    MLP_FC2_INPUT: _mlp_fc2_input,
    MOE_ROUTER_INPUT: _norm_output,
    MOE_FC1_INPUT: _unpriced,
    MOE_ACT_INPUT: _moe_act_input,
    MOE_FC2_INPUT: _moe_fc2_input,
    MOE_ROUTING: _moe_routing,
    MLP_HIDDEN_DROPOUT_MASK: _hidden_mask,
    FINAL_NORM_INPUT: _final_norm_input,
}


def mask_dtype(shape: ModelShape, device: DeviceModel) -> torch.dtype:
    """A stored dropout mask: bool from CUDA's dropout, the model dtype from torch's CPU dropout."""
    return torch.bool if device.rng_device == "cuda" else shape.torch_dtype


def _site_dtype(site: Site, shape: ModelShape, device: DeviceModel) -> torch.dtype:
    """`Site.dtype` for a model of `shape` on `device`."""
    if site.dtype == "mask":
        return mask_dtype(shape, device)
    return {"activation": shape.torch_dtype, "float32": torch.float32}[site.dtype]


def _block_sites(shape: ModelShape, scope: str = "layer") -> list[Site]:
    """The schema's sites a block of `shape` has (`present`), in the profile's order (`_COSTS`);
    `scope="model"`: the sites after the blocks the model has (the final norm's input)."""
    have = [site for site in schema.BLOCK if site.scope == scope and present(
        site.name, dropout=shape.dropout > 0, unfused_attention=not shape.fused_attention,
        qk_layernorm=shape.qk_layernorm, moe=shape.is_moe, last=scope == "model")]
    rank = {name: i for i, name in enumerate(_COSTS)}
    return sorted(have, key=lambda site: rank.get(site.name, len(rank)))


def _sites(shape: ModelShape, device: DeviceModel, scope: str = "layer") -> list[_Site]:
    """The block's sites (`scope="model"`: those after the blocks): shape, dtype and producer
    inputs from the schema, cost from `_COSTS`."""
    blk = _Terms(shape, device)
    sites = _block_sites(shape, scope)
    names = {site.name for site in sites}
    out = []
    for site in sites:
        cost = _COSTS[site.name](blk) if site.name in _COSTS else _Cost()
        inputs = site.recomputed_from + site.rebuild_reads if cost.inputs is None else cost.inputs
        out.append(_Site(site.name, site.dims(blk.x), _site_dtype(site, shape, device), cost.forward_ms,
                         tuple(i for i in inputs if i in names), cost.extra, cost.keep_bytes))
    return out


def block_profile(shape: ModelShape, device: Optional[DeviceModel] = None, *,
                  count: int = 1, inflight: int = 1, outlier_frac: float = 0.01,
                  sensitivity: Optional[Mapping[str, float]] = None,
                  gradients: bool = False) -> BlockProfile:
    """The saved tensors of one block of `shape` on one TP rank, with every codec the
    registry admits at each site. `outlier_frac`: the share of channels the data
    is expected to have as outliers (default 1%; checked, no longer priced: outlier_int4
    stores its fixed slots, 1/64 of the channels, whatever the data). `sensitivity`: per-site c_i (default 1.0 for
    value sites, 0 for dropout masks), a prior until measured.

    `gradients`: set `BlockProfile.grad_bytes` and `stage_bytes` (`grad_bytes`, `stage_bytes`),
    the gradients in flight while the block backpropagates (issue 27's peak: plan with
    `loss_bytes` as well). False (default for now): 0, the stored-plus-transient figures the
    existing callers and their tests assume; tests/planner/test_peak_vs_measured.py checks
    the full model against a measurement."""
    device = device or DeviceModel()
    if isinstance(outlier_frac, bool) or not isinstance(outlier_frac, numbers.Real) \
            or not 0.0 <= outlier_frac <= 1.0:
        raise ValueError(f"outlier_frac: expected a fraction in [0, 1], got {outlier_frac!r}")
    if not isinstance(gradients, bool):
        raise ValueError(f"gradients: expected True or False, got {gradients!r}")
    sens = dict(sensitivity or {})
    profiles = _site_profiles(_sites(shape, device), shape, device, outlier_frac, sens)
    if sens:
        raise ValueError(f"sensitivity: sites {sorted(sens)} are not in this block "
                         f"({', '.join(p.name for p in profiles)})")
    stages = stage_bytes(shape, device) if gradients else ()
    return BlockProfile(tuple(profiles), count=count, inflight=inflight,
                        full_ms=layer_forward_ms(shape, device),
                        grad_bytes=_whole_grad(shape, stages) if gradients else 0,
                        stage_bytes=stages)


def _site_profiles(sites: list[_Site], shape: ModelShape, device: DeviceModel, outlier_frac: float,
                   sens: dict[str, float]) -> list[SiteProfile]:
    """The planner's view of `sites`, each with every codec it admits; the sensitivities
    used are taken out of `sens` (default 1.0 for value sites, 0 for dropout masks)."""
    profiles = []
    for st in sites:
        itemsize = torch.empty((), dtype=st.dtype).element_size()
        default_c = 0.0 if st.name in schema.MASK_SITES else 1.0
        profiles.append(SiteProfile(
            st.name, st.keep_bytes if st.keep_bytes is not None else math.prod(st.dims) * itemsize + st.extra,
            st.forward_ms, st.inputs,
            _options(st.name, st.dims, st.dtype, st.extra, shape, device, outlier_frac),
            sens.pop(st.name, default_c),
        ))
    return profiles


def outer_profile(shape: ModelShape, device: Optional[DeviceModel] = None, *, inflight: int = 1,
                  outlier_frac: float = 0.01, sensitivity: Optional[Mapping[str, float]] = None
                  ) -> Optional[BlockProfile]:
    """The sites after the blocks (`llm_act.sites.MODEL_SITES`: the final norm's input, with
    its fp32 statistics) on the last pipeline stage, as a block of their own for
    `solve_plan` (count 1: stored once; no whole-block option, nothing recomputed); the plan
    carries its choice in the last layer's (`llm_act.plan.Plan.layer_plans`). None when the
    model has none. `sensitivity`: per-site c_i (default 1.0)."""
    device = device or DeviceModel()
    sens = dict(sensitivity or {})
    profiles = _site_profiles(_sites(shape, device, scope="model"), shape, device, outlier_frac, sens)
    if sens:
        raise ValueError(f"sensitivity: sites {sorted(sens)} are not after the blocks "
                         f"({', '.join(p.name for p in profiles)})")
    return BlockProfile(tuple(profiles), count=1, inflight=inflight) if profiles else None


def stage_blocks(shape: ModelShape, stage: int, device: Optional[DeviceModel] = None,
                 **kwargs) -> list[BlockProfile]:
    """The blocks of pipeline stage `stage` (0-based) for `solve_plan`: one entry holding
    the stage's layers, with pp - stage micro-batches in flight (1F1B), and on the last stage
    the sites after the blocks (`outer_profile`: the final norm's input), planned with them."""
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    sens = dict(kwargs.pop("sensitivity", None) or {})
    outer_sens = {name: sens.pop(name) for name in schema.MODEL_SITES if name in sens}
    blocks = [block_profile(shape, device, count=shape.layers_per_stage,
                            inflight=shape.pp - int(stage), sensitivity=sens, **kwargs)]
    outer = outer_profile(shape, device, inflight=shape.pp - int(stage), sensitivity=outer_sens,
                          **{k: v for k, v in kwargs.items() if k == "outlier_frac"}) \
        if stage == shape.pp - 1 else None
    return blocks + ([outer] if outer is not None else [])


def stage_layers(shape: ModelShape, stage: int) -> tuple[int, int]:
    """(first, last) global layer numbers of a stage, inclusive."""
    n = shape.layers_per_stage
    return stage * n, stage * n + n - 1


def layer_forward_ms(shape: ModelShape, device: Optional[DeviceModel] = None) -> float:
    """Estimated forward time of one block: its GEMMs, attention and memory-bound ops."""
    device = device or DeviceModel()
    sites = _sites(shape, device)
    fwd = sum(st.forward_ms for st in sites if st.forward_ms is not None)
    t, tokens = shape.tp, shape.seq_length * shape.micro_batch_size
    fc2 = device.gemm_ms(2 * tokens * shape.ffn_hidden_size // t * shape.hidden_size)
    if shape.is_moe:  # the experts' fc2, the router's GEMM, dispatch and combine over EP
        h, rows = shape.hidden_size, shape.moe_rows
        a2a = (shape.ep - 1) / shape.ep * rows * h * shape.elem_bytes
        fc2 = (device.gemm_ms(2 * rows * shape.moe_ffn_hidden_size * h)
               + device.gemm_ms(2 * shape.moe_tokens * h * shape.num_experts) + 2 * device.link_ms(a2a))
    return fwd + fc2 + device.mem_ms(3 * shape.local_seq * shape.micro_batch_size
                                     * shape.hidden_size * shape.elem_bytes)  # MLP residual add


# ---- the block's backward: its gradients in flight ------------------------------------------
#: what the step holds through every block's backward besides the blocks: the fp32 per-token
#: losses (4 bytes a token), the scalar loss and its gradient seed (4 + 4)
LOSS_BYTES_PER_TOKEN, LOSS_SCALAR_BYTES = 4, 8


def grad_bytes(shape: ModelShape, device: Optional[DeviceModel] = None) -> int:
    """`BlockProfile.grad_bytes` of a block of `shape`: the gradients in flight while a block
    recomputed whole backpropagates, at its heaviest stage (`stage_bytes`): the MLP's fc2
    stage, where the rebuild has also re-run the block's output, n*e more (n = the rows of an
    [s, b, h] tensor times h, e bytes per element), or the stock attention's softmax stage."""
    return _whole_grad(shape, stage_bytes(shape, device))


def _whole_grad(shape: ModelShape, stages) -> int:
    """`grad_bytes` from the block's `stage_bytes`."""
    stages = dict(stages)
    n_hid = shape.local_seq * shape.micro_batch_size * shape.hidden_size
    return max(stages["mlp"] + n_hid * shape.elem_bytes, stages["attention"])


def stage_bytes(shape: ModelShape, device: Optional[DeviceModel] = None) -> tuple[tuple[str, int], ...]:
    """`BlockProfile.stage_bytes` of a block of `shape`: what is live in each backward stage
    (`llm_act.sites.BACKWARD_STAGES`) besides the stored, rebuilt and decoded
    tensors the planner counts. Per rank, T = s*b tokens, e bytes per element, h hidden, f the
    FFN width per rank, a heads per rank of d channels, n = the rows of an [s, b, h] tensor
    times h; throughout backward the step holds the per-token losses and the loss with its
    seed, 4T + 8.

    - "mlp", at the fc2 backward, the stage's largest: T*f*e (fc2's input gradient) + f*h*e
      (its weight gradient, when `DeviceModel.wgrad_temporaries`) + n*e (the incoming
      gradient) + 4T + 8. An MoE block: one expert's fc2 at a time, its rows (not measured
      yet).
    - "attention", the memory-efficient attention: dq, dk, dv and the context's gradient,
      4*T*a*d*e, + linear_proj's weight gradient h*a*d*e (when `wgrad_temporaries`) + n*e (the
      residual gradient) + 4T + 8 -- an upper bound: the MLP half has freed its sites by then.
    - "attention", the stock attention: the core attention's softmax backward, where a
      recomputed softmax is rebuilt: the scores' gradients (unfused, `DeviceModel.
      fused_softmax` False: the fp32 gradients of the probabilities and of the scores, 8 bytes
      a score; fused: the 16-bit probabilities' gradient, overwritten in place, and the
      dropout's one) + h*a*d*e (linear_proj's weight gradient, when `wgrad_temporaries`) +
      n*e (the residual gradient) + 2*T*a*d*e (the context's gradient, and the context the
      re-run attention rebuilt) + 4T + 8, net of what the stage has freed whatever the plan
      stores: the bytes of every site after the softmax (attn.out, ln2.input, the MLP's:
      backpropagated) and the 16-bit probabilities probs @ V read (part of `attn.softmax`,
      consumed by its backward). Exact when those sites are kept or recomputed (keep,
      selective); a plan that encodes them frees only their codes, and is under by the
      difference.

    Not counted: the embedding's dropout mask, live through every block's backward on the
    first stage (`loss_bytes` counts it at the loss), and on other pipeline stages the stage's
    output and its gradient in place of the losses. Measured against the live-storage oracle
    (`llm_act/bench/live_storage.py`) on CPU by `llm-act bench peak` and
    tests/planner/test_peak_vs_measured.py."""
    device = device or DeviceModel()
    s, b, h, e = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.elem_bytes
    t, d = shape.tp, shape.head_dim
    a = shape.num_attention_heads // t
    tokens = s * b
    n_hid = shape.local_seq * b * h
    loss = LOSS_BYTES_PER_TOKEN * tokens + LOSS_SCALAR_BYTES
    if shape.is_moe:  # one expert's fc2 at a time: its rows' input gradient, its weight's
        rows = math.ceil(shape.tokens_per_expert)
        f = shape.moe_ffn_hidden_size
    else:
        rows, f = tokens, shape.ffn_hidden_size // t
    mlp = rows * f * e + (f * h * e if device.wgrad_temporaries else 0) + n_hid * e + loss
    proj_wgrad = h * a * d * e if device.wgrad_temporaries else 0
    if shape.fused_attention:
        return (("mlp", mlp), ("attention", 4 * tokens * a * d * e + proj_wgrad + n_hid * e + loss))
    scores = b * a * s * s
    if device.fused_softmax:
        score_grads = scores * e * (2 if shape.dropout > 0 else 1)
    else:
        score_grads = scores * 8
    live = score_grads + proj_wgrad + n_hid * e + 2 * tokens * a * d * e + loss
    sites = _sites(shape, device)
    names = [st.name for st in sites]
    after = names[names.index(ATTN_SOFTMAX) + 1:]
    freed = 0
    for st in sites:
        if st.name in after:
            itemsize = torch.empty((), dtype=st.dtype).element_size()
            freed += st.keep_bytes if st.keep_bytes is not None else math.prod(st.dims) * itemsize + st.extra
    softmax_bytes = e if device.fused_softmax else 4
    if shape.dropout > 0 or softmax_bytes != e:  # the 16-bit probabilities probs @ V reads
        freed += scores * e
    return (("mlp", mlp), ("attention", max(0, live - freed)))
