"""An analytic profile of a GPT block from its shape alone: no GPU, no model, no data.

`llm-act plan` needs a profile before anything runs (to size a job on paper), so this
module derives one from the model's shape and a device model:

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
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from llm_act.codecs.fewbit import ACTIVATIONS
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, check_choice, make_codec
from llm_act.config import ATTENTION_MODES  # ModelShape.attention ("stock" stores the softmax)
from llm_act.planner.profile import BlockProfile, CodecOption, SiteProfile
from llm_act.sites import MASK_SITES

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: Megatron-LM's --make-vocab-size-divisible-by default
VOCAB_DIVISOR = 128
#: the stored state of a CUDA philox generator (seed + offset), when no CUDA is here to ask
_PHILOX_STATE_BYTES = 16
#: the tensor on which each codec's noise prior S is measured
_PRIOR_SHAPE = (64, 512)


@dataclass(frozen=True)
class DeviceModel:
    """A roofline model of one accelerator. Default: H100-like (bf16 dense 790 TFLOP/s at
    60% efficiency, 3000 GB/s achieved copy bandwidth, 80 GB)."""

    name: str = "H100-like"
    matmul_tflops: float = 790.0 * 0.6
    """achieved dense matmul throughput, TFLOP/s"""
    hbm_gbs: float = 3000.0
    """achieved memory bandwidth (bytes read + written per second), GB/s"""
    link_gbs: float = 300.0
    """achieved per-rank bandwidth of tensor-parallel collectives (NVLink), GB/s"""
    launch_ms: float = 0.005
    """fixed cost of one kernel launch"""
    memory_bytes: int = 80 * 10**9
    rng_device: str = "cuda"
    """where dropout runs: the size of a regenerable mask's generator state, and the dtype of
    a stored mask (CUDA's dropout keeps a bool mask, torch's CPU dropout one in the model dtype)"""
    fused_softmax: bool = True
    """megatron's fused scale-mask-softmax kernel (apex/TE on a GPU) stores the 16-bit
    probabilities once; without it the torch path stores its fp32 softmax and the 16-bit
    copy the probs @ V product reads. In backward the fused kernel turns the probabilities'
    16-bit gradient into the scores' in place; the torch path holds both in fp32"""
    wgrad_temporaries: bool = False
    """whether a linear's weight gradient is made whole before it is added to the parameter's
    gradient (autograd's `.grad += new`, as on CPU), so that one weight-sized temporary is live
    in backward; False: megatron's fused accumulation into `main_grad` (a GPU with
    gradient_accumulation_fusion) writes it in place"""

    def __post_init__(self) -> None:
        for f in ("matmul_tflops", "hbm_gbs", "link_gbs"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0 or math.isinf(v):
                raise ValueError(f"DeviceModel.{f}: expected a positive number, got {v!r}")
        if isinstance(self.launch_ms, bool) or not isinstance(self.launch_ms, numbers.Real) \
                or not self.launch_ms >= 0:
            raise ValueError(f"DeviceModel.launch_ms: expected a number >= 0, got {self.launch_ms!r}")
        for f in ("fused_softmax", "wgrad_temporaries"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"DeviceModel.{f}: expected True or False, got {getattr(self, f)!r}")
        if self.rng_device not in ("cuda", "cpu"):
            raise ValueError(f"DeviceModel.rng_device: expected 'cuda' or 'cpu', got {self.rng_device!r}")

    @classmethod
    def cpu(cls) -> "DeviceModel":
        """A many-core server CPU: ~1 TFLOP/s bf16 matmul, 50 GB/s, gloo between ranks."""
        return cls(name="CPU-like", matmul_tflops=1.0, hbm_gbs=50.0, link_gbs=5.0,
                   launch_ms=0.02, memory_bytes=256 * 10**9, rng_device="cpu", fused_softmax=False,
                   wgrad_temporaries=True)

    def describe(self) -> str:
        return (f"{self.name}: {self.matmul_tflops:g} TFLOP/s matmul, {self.hbm_gbs:g} GB/s memory, "
                f"{self.link_gbs:g} GB/s TP link, {self.memory_bytes / 1e9:g} GB")

    def gemm_ms(self, flops: float) -> float:
        return flops / (self.matmul_tflops * 1e12) * 1e3 + self.launch_ms

    def mem_ms(self, nbytes: float) -> float:
        return nbytes / (self.hbm_gbs * 1e9) * 1e3 + self.launch_ms

    def link_ms(self, nbytes: float) -> float:
        return nbytes / (self.link_gbs * 1e9) * 1e3 + self.launch_ms


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what}: expected a positive integer, got {value!r}")
    return int(value)


def _divides(part: int, whole: int, msg: str) -> None:
    if whole % part:
        raise ValueError(msg)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a GPT-style model and how it is split, which is all the analytic
    profile needs. `ffn_hidden_size` None = 4 * hidden; `num_query_groups` None = one per
    head (no GQA); `gated_linear_unit` = SwiGLU-style MLP (fc1 emits 2 * ffn); `dropout`
    is both the hidden and the attention dropout; `attention` as in ActConfig;
    `qk_layernorm` = per-head norms on the queries and keys before rotary (Qwen3, OLMo 2).
    MoE (every layer): `num_experts` routed experts of width `moe_ffn_hidden_size` (None =
    ffn_hidden_size), top-`moe_topk` routing, `moe_capacity_factor` (None = dropless), split
    over `ep` expert-parallel ranks (expert tensor parallelism 1, as llm_act supports)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    vocab_size: int = 50257
    gated_linear_unit: bool = False
    activation: str = "gelu"
    dtype: str = "bf16"
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    dropout: float = 0.0
    bias: bool = True
    normalization: str = "LayerNorm"
    position_embedding: str = "learned_absolute"
    tie_embeddings: bool = True
    attention: str = "auto"
    qk_layernorm: bool = False
    num_experts: Optional[int] = None
    moe_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_capacity_factor: Optional[float] = None
    ep: int = 1

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                  "micro_batch_size", "vocab_size", "tp", "pp"):
            object.__setattr__(self, f, _positive_int(getattr(self, f), f))
        h, a = self.hidden_size, self.num_attention_heads
        object.__setattr__(self, "ffn_hidden_size", _positive_int(
            4 * h if self.ffn_hidden_size is None else self.ffn_hidden_size, "ffn_hidden_size"))
        object.__setattr__(self, "num_query_groups", _positive_int(
            a if self.num_query_groups is None else self.num_query_groups, "num_query_groups"))
        for f in ("gated_linear_unit", "sequence_parallel", "bias", "tie_embeddings", "qk_layernorm"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f}: expected True or False, got {getattr(self, f)!r}")
        for f, allowed in (("activation", ACTIVATIONS), ("dtype", tuple(DTYPES)),
                           ("normalization", NORMALIZATIONS),
                           ("position_embedding", POSITION_EMBEDDINGS), ("attention", ATTENTION_MODES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"{f}: expected one of {', '.join(allowed)}, got {getattr(self, f)!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout!r}")
        g, t = self.num_query_groups, self.tp
        _divides(a, h, f"hidden_size={h} is not a multiple of num_attention_heads={a}")
        _divides(g, a, f"num_query_groups={g} does not divide num_attention_heads={a}")
        _divides(t, a, f"tp={t} does not divide num_attention_heads={a}")
        _divides(t, g, f"tp={t} does not divide num_query_groups={g}")
        _divides(t, self.ffn_hidden_size, f"tp={t} does not divide ffn_hidden_size={self.ffn_hidden_size}")
        _divides(self.pp, self.num_layers, f"pp={self.pp} does not divide num_layers={self.num_layers}")
        if self.sequence_parallel:
            _divides(t, self.seq_length,
                     f"tp={t} does not divide seq_length={self.seq_length} (sequence parallel)")
        self._check_moe()

    def _check_moe(self) -> None:
        object.__setattr__(self, "ep", _positive_int(self.ep, "ep"))
        if self.num_experts is None:
            if self.ep != 1:
                raise ValueError(f"ep: expert parallelism (ep={self.ep}) needs an MoE model "
                                 "(num_experts), got a dense one")
            if self.moe_capacity_factor is not None:
                raise ValueError("moe_capacity_factor: a capacity factor needs an MoE model "
                                 "(num_experts), got a dense one")
            return
        e = _positive_int(self.num_experts, "num_experts")
        object.__setattr__(self, "num_experts", e)
        k = _positive_int(self.moe_topk, "moe_topk")
        if k > e:
            raise ValueError(f"moe_topk: expected at most num_experts={e}, got {k}")
        object.__setattr__(self, "moe_ffn_hidden_size", _positive_int(
            self.ffn_hidden_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size,
            "moe_ffn_hidden_size"))
        c = self.moe_capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 0):
            raise ValueError(f"moe_capacity_factor: expected a number > 0 or None (dropless), got {c!r}")
        _divides(self.ep, e, f"ep={self.ep} does not divide num_experts={e}")

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def fc1_width(self) -> int:
        """fc1's output width (both halves under a gated linear unit)."""
        return self.ffn_hidden_size * (2 if self.gated_linear_unit else 1)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def moe_fc1_width(self) -> int:
        """An expert's fc1 output width (both halves under a gated linear unit)."""
        return self.moe_ffn_hidden_size * (2 if self.gated_linear_unit else 1)

    @property
    def moe_tokens(self) -> int:
        """Tokens entering the MoE layer on one rank (its sequence shard under SP)."""
        return self.local_seq * self.micro_batch_size

    @property
    def moe_rows(self) -> int:
        """Rows the rank's experts receive per micro-batch: top-k per token, and with a
        capacity factor c at most c * T * k / E per expert (megatron's `get_capacity`), the
        rest dropped. Balanced: the all-to-all brings as many rows as the rank sends."""
        tk = self.moe_tokens * self.moe_topk
        if self.moe_capacity_factor is None:
            return tk
        per_expert = math.ceil(self.moe_tokens * self.moe_topk / self.num_experts * self.moe_capacity_factor)
        return min(tk, self.num_experts * per_expert)

    @property
    def tokens_per_expert(self) -> float:
        """Rows one local expert receives per micro-batch (balanced routing)."""
        return self.moe_rows / (self.num_experts // self.ep)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def fused_attention(self) -> bool:
        """Memory-efficient attention (no softmax site) unless the stock unfused path."""
        return self.attention != "stock"

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def padded_vocab_size(self) -> int:
        """Megatron pads the vocabulary to a multiple of 128 * tp."""
        m = VOCAB_DIVISOR * self.tp
        return -(-self.vocab_size // m) * m

    @property
    def local_seq(self) -> int:
        """Rows of an [s, b, h] norm/dropout tensor on one rank (split under SP)."""
        return self.seq_length // self.tp if self.sequence_parallel else self.seq_length

    def with_(self, **changes) -> "ModelShape":
        """A copy with fields replaced (resolved defaults such as ffn_hidden_size carry over)."""
        return dataclasses.replace(self, **changes)


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
    try:
        check_choice(site, name)
    except ValueError:
        return False
    # a gated unit's backward needs f(a) itself for the gate's gradient, not only f'(a)
    return not (name in FEWBIT_CODECS and shape.gated_linear_unit)


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


def _collective_bytes(shape: ModelShape, full_bytes: int, kind: str) -> float:
    """Bytes one rank sends for a TP collective over a tensor of `full_bytes`."""
    t = shape.tp
    if t == 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (t - 1) / t * full_bytes


def _sites(shape: ModelShape, device: DeviceModel) -> list[_Site]:
    s, b, h = shape.seq_length, shape.micro_batch_size, shape.hidden_size
    t, d, e = shape.tp, shape.head_dim, shape.elem_bytes
    a, g = shape.num_attention_heads // t, shape.num_query_groups // t  # per rank
    f1, f2 = shape.fc1_width // t, shape.ffn_hidden_size // t
    dt, tokens, sl = shape.torch_dtype, s * b, shape.local_seq
    hid = (sl, b, h)
    n_hid = sl * b * h
    drop = shape.dropout > 0
    gemm, mem, link = device.gemm_ms, device.mem_ms, device.link_ms
    mask_dt = torch.bool if device.rng_device == "cuda" else dt
    # a norm keeps fp32 statistics per row for its backward (LayerNorm mean and rstd, RMSNorm
    # rstd); booked with its output, whose recomputation re-runs the norm and drops them
    stats_per_row = (2 if shape.normalization == "LayerNorm" else 1) * 4
    norm_stats = stats_per_row * sl * b

    def gather(nbytes):  # SP: the linear's input is all-gathered from the shards
        return link(_collective_bytes(shape, nbytes, "all_gather")) if shape.sequence_parallel and t > 1 else 0.0

    norm_ms = mem(2 * n_hid * e)
    qkv_gather = gather(tokens * h * e)
    rope = shape.position_embedding == "rope"

    def proj(heads):  # this head group's share of the QKV GEMM (and of its input gather)
        share = heads / (a + 2 * g)
        return gemm(2 * tokens * h * heads * d) + share * qkv_gather

    # with RoPE or qk-layernorm, Q and K are new tensors and V is the last view of the fused
    # QKV output: keeping V keeps that whole buffer (a codec or recompute stores V's share
    # only). The stock attention under GQA saves K and V repeated to every query head
    # instead (the view of V is not saved, but the qk-layernorm's saved K input holds it).
    buffer = tokens * (a + 2 * g) * d * e
    repeated = not shape.fused_attention and a > g
    if repeated:
        k_keep, v_keep = tokens * a * d * e, tokens * a * d * e + (buffer if shape.qk_layernorm else 0)
    else:
        k_keep, v_keep = None, buffer if rope or shape.qk_layernorm else None
    qk_ops = (1 if rope else 0) + (1 if shape.qk_layernorm else 0)  # elementwise passes over Q, K

    def qk_ms(heads):
        return qk_ops * mem(2 * tokens * heads * d * e) if qk_ops else 0.0
    # RoPE's cos and sin tables [s, 1, 1, d] for Q and for K, saved by the rotation whatever
    # Q and K store (gone only when the whole block is recomputed); the ledger books them with Q
    rope_tables = 4 * s * d * e if rope else 0
    sites = [
        _Site("ln1.input", hid, dt, None),
        _Site("attn.qkv_input", hid, dt, norm_ms, ("ln1.input",), extra=norm_stats),
        _Site("attn.q", (s, b, a, d), dt, proj(a) + qk_ms(a), ("attn.qkv_input",), extra=rope_tables),
        _Site("attn.k", (s, b, g, d), dt, proj(g) + qk_ms(g), ("attn.qkv_input",), keep_bytes=k_keep),
        _Site("attn.v", (s, b, g, d), dt, proj(g), ("attn.qkv_input",), keep_bytes=v_keep),
    ]
    if shape.qk_layernorm:
        sites += _qk_norm_sites(shape, stats_per_row, proj)
    scores = b * a * s * s
    # the memory-efficient kernel draws its attention-dropout mask from the RNG inside the
    # kernel (a generator state, no tensor): no softmax and no attn.dropout_mask site
    if shape.fused_attention:
        # flash-style kernel: QK^T and PV, half of them skipped under the causal mask;
        # it stores its output and the fp32 logsumexp [b, a, s]
        sites.append(_Site("attn.out", (s, b, a * d), dt, gemm(4 * scores * d / 2),
                           ("attn.q", "attn.k", "attn.v"), extra=b * a * s * 4))
    else:
        # stock megatron keeps the softmax output (fp32 on the unfused torch path) and the
        # probabilities probs @ V reads: the dropped ones under dropout, else the 16-bit copy
        # of an fp32 softmax (Korthikanti et al.: 5as^2b in 16 bits with dropout and the
        # fused kernel). A codec stores the probabilities alone.
        softmax_bytes = e if device.fused_softmax else 4
        copy = drop or softmax_bytes != e  # probs @ V reads another tensor: dropped, or the 16-bit cast
        kept = scores * (softmax_bytes + (e if copy else 0))
        if not device.fused_softmax:
            kept += s * s  # the torch path's masked_fill keeps megatron's [s, s] bool causal mask
        sites.append(_Site("attn.softmax", (b, a, s, s), dt,
                           gemm(2 * scores * d) + mem(3 * scores * e), ("attn.q", "attn.k"), keep_bytes=kept))
        out_inputs = ("attn.softmax", "attn.v")
        pv = gemm(2 * scores * d)
        if drop:
            sites.append(_Site("attn.dropout_mask", (b, a, s, s), mask_dt, mem(scores)))
            out_inputs += ("attn.dropout_mask",)
            pv += mem((2 * e + 1) * scores)
        sites.append(_Site("attn.out", (s, b, a * d), dt, pv, out_inputs))
    ln2_inputs = ("ln1.input", "attn.out")
    bda = 3 * n_hid * e  # bias-dropout-add: read projection and residual, write the sum
    if drop:
        sites.append(_Site("attn.hidden_dropout_mask", hid, mask_dt, mem(n_hid)))
        ln2_inputs += ("attn.hidden_dropout_mask",)
        bda += n_hid
    reduce_kind = "reduce_scatter" if shape.sequence_parallel else "all_reduce"
    reduce = link(_collective_bytes(shape, tokens * h * e, reduce_kind)) if t > 1 else 0.0
    sites.append(_Site("ln2.input", hid, dt, gemm(2 * tokens * a * d * h) + reduce + mem(bda), ln2_inputs))
    if shape.is_moe:
        sites += _moe_sites(shape, device, hid, norm_ms, norm_stats)
    else:
        sites += [
            _Site("mlp.fc1_input", hid, dt, norm_ms, ("ln2.input",), extra=norm_stats),
            _Site("mlp.act_input", (s, b, f1), dt, gemm(2 * tokens * h * f1) + gather(tokens * h * e),
                  ("mlp.fc1_input",)),
            _Site("mlp.fc2_input", (s, b, f2), dt, mem(tokens * (f1 + f2) * e), ("mlp.act_input",)),
        ]
    if drop:
        sites.append(_Site("mlp.hidden_dropout_mask", hid, mask_dt, mem(n_hid)))
    return sites


def _moe_sites(shape: ModelShape, device: DeviceModel, hid, norm_ms: float, norm_stats: int) -> list[_Site]:
    """The `moe.*` sites of an MoE block on one rank (what `patches/megatron/moe.py` stores).

    Keeping `moe.act_input` holds what stock SequentialMLP experts keep after fc1: fc1's
    output, and the activation's output that the probability multiply reads (a gated unit
    also keeps its gate's output and the linear half). `moe.routing` codes the per-row
    probabilities; the router's fp32 scores, the routing map and the top-k and permutation
    indices stay exact beside them. `moe.fc1_input` and `moe.routing` come out of the token
    dispatcher: no producer the planner may re-run (only the whole block recomputes them)."""
    h, e, dt = shape.hidden_size, shape.elem_bytes, shape.torch_dtype
    rows, tokens, k, n_exp = shape.moe_rows, shape.moe_tokens, shape.moe_topk, shape.num_experts
    f1, f2 = shape.moe_fc1_width, shape.moe_ffn_hidden_size
    after_fc1 = rows * (f1 + (3 if shape.gated_linear_unit else 1) * f2) * e
    indices = tokens * n_exp * (4 + 1) + tokens * k * 8 + rows * 8
    return [
        _Site("moe.router_input", hid, dt, norm_ms, ("ln2.input",), extra=norm_stats),
        _Site("moe.fc1_input", (rows, h), dt, None),
        _Site("moe.act_input", (rows, f1), dt, device.gemm_ms(2 * rows * h * f1), ("moe.fc1_input",),
              keep_bytes=after_fc1),
        _Site("moe.fc2_input", (rows, f2), dt, device.mem_ms(rows * (f1 + 2 * f2) * e),
              ("moe.act_input", "moe.routing")),
        _Site("moe.routing", (rows,), torch.float32, None, extra=indices),
    ]


def _qk_norm_sites(shape: ModelShape, stats_per_row: int, proj) -> list[_Site]:
    """`attn.q_norm_input`, `attn.k_norm_input`: the per-head inputs [s, b, heads, d] of
    SelfAttention's q/k norms, with the norms' fp32 statistics per (token, head) row (kept beside
    a codec's record too: `extra`). K's input is a view of the fused QKV output, which `attn.v`
    already books whole (keeping it adds the statistics alone); so is Q's, except under GQA
    with several query groups, where megatron's reshape of a group's query slice copies."""
    s, b, d, e = shape.seq_length, shape.micro_batch_size, shape.head_dim, shape.elem_bytes
    a, g = shape.num_attention_heads // shape.tp, shape.num_query_groups // shape.tp
    dt, tokens = shape.torch_dtype, s * b
    q_stats, k_stats = stats_per_row * tokens * a, stats_per_row * tokens * g
    q_copied = 1 < g < a
    return [
        _Site("attn.q_norm_input", (s, b, a, d), dt, proj(a), ("attn.qkv_input",), extra=q_stats,
              keep_bytes=(tokens * a * d * e if q_copied else 0) + q_stats),
        _Site("attn.k_norm_input", (s, b, g, d), dt, proj(g), ("attn.qkv_input",), extra=k_stats,
              keep_bytes=k_stats),
    ]


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
    profiles = []
    for st in _sites(shape, device):
        itemsize = torch.empty((), dtype=st.dtype).element_size()
        default_c = 0.0 if st.name in MASK_SITES else 1.0
        profiles.append(SiteProfile(
            st.name, st.keep_bytes if st.keep_bytes is not None else math.prod(st.dims) * itemsize + st.extra,
            st.forward_ms, st.inputs,
            _options(st.name, st.dims, st.dtype, st.extra, shape, device, outlier_frac),
            sens.pop(st.name, default_c),
        ))
    if sens:
        raise ValueError(f"sensitivity: sites {sorted(sens)} are not in this block "
                         f"({', '.join(p.name for p in profiles)})")
    stages = stage_bytes(shape, device) if gradients else ()
    return BlockProfile(tuple(profiles), count=count, inflight=inflight,
                        full_ms=layer_forward_ms(shape, device),
                        grad_bytes=_whole_grad(shape, stages) if gradients else 0,
                        stage_bytes=stages)


def stage_blocks(shape: ModelShape, stage: int, device: Optional[DeviceModel] = None,
                 **kwargs) -> list[BlockProfile]:
    """The blocks of pipeline stage `stage` (0-based) for `solve_plan`: one entry holding
    the stage's layers, with pp - stage micro-batches in flight (1F1B)."""
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    return [block_profile(shape, device, count=shape.layers_per_stage,
                          inflight=shape.pp - int(stage), **kwargs)]


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


# ---- outside the blocks, and static memory ---------------------------------------------------
def outer_bytes(shape: ModelShape, stage: int, output_loss: str = "stock") -> dict[str, int]:
    """Activation bytes a stage holds outside its blocks (counted, not planned), all
    micro-batches in flight included: the embedding's dropout mask on the first stage; on
    the last stage the final norm's input, the output layer's input (with the final norm's
    fp32 statistics per token), and the loss under `output_loss`:

    - "stock": megatron's vocab-parallel cross entropy keeps the fp32 softmax [tokens,
      vocab/tp] and per token a bool target mask and an int64 masked target
      (`llm_act.output.stock_logits_bytes`), as `loss.logits`;
    - "chunked": the chunked linear + cross-entropy keeps one fp32 log-sum-exp per token
      (`loss.logsumexp`; with the output layer's input that is `llm_act.output.stored_bytes`).
      Not under sequence parallelism (the op refuses it)."""
    from llm_act.output.chunked_loss import stock_logits_bytes, stored_bytes

    if not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if output_loss not in ("stock", "chunked"):
        raise ValueError(f"output_loss: expected 'stock' or 'chunked', got {output_loss!r}")
    if output_loss == "chunked" and shape.sequence_parallel:
        raise ValueError("output_loss: the chunked loss does not support sequence parallelism yet")
    b, e, inflight = shape.micro_batch_size, shape.elem_bytes, shape.pp - stage
    n_hid = shape.local_seq * b * shape.hidden_size
    out: dict[str, int] = {}
    if stage == 0 and shape.dropout > 0:
        out["embedding.dropout_mask"] = inflight * n_hid
    if stage == shape.pp - 1:
        stats = (2 if shape.normalization == "LayerNorm" else 1) * 4 * shape.local_seq * b
        tokens = shape.seq_length * b  # the loss sees the whole sequence
        out["final_norm.input"] = inflight * n_hid * e
        out["output_layer.input"] = inflight * (n_hid * e + stats)
        if output_loss == "stock":
            out["loss.logits"] = inflight * stock_logits_bytes(tokens, shape.padded_vocab_size // shape.tp)
        else:
            out["loss.logsumexp"] = inflight * (stored_bytes(tokens, shape.hidden_size, e) - n_hid * e)
    return out


#: megatron-core 0.16.1's `vocab_parallel_cross_entropy` forward, per token, besides what it
#: saves (`llm_act.output.stock_logits_bytes`): GPTModel's int64 copy of the labels [s, b] (8),
#: the int64 row index (8), the fp32 max logit (4), the gathered target logit (4) and its
#: clone (4), all live at its peak
_CE_BOOKKEEPING = 8 + 8 + 4 + 4 + 4
#: what the step holds through every block's backward besides the blocks: the fp32 per-token
#: losses (4 bytes a token), the scalar loss and its gradient seed (4 + 4)
_LOSS_PER_TOKEN, _LOSS_SCALARS = 4, 8


def _mask_bytes(shape: ModelShape, device: DeviceModel) -> int:
    """Bytes per element of a stored dropout mask: bool from CUDA's dropout, the model dtype
    from torch's CPU dropout (as `_sites` prices the block's masks)."""
    return 1 if device.rng_device == "cuda" else shape.elem_bytes


def loss_bytes(shape: ModelShape, stage: Optional[int] = None, device: Optional[DeviceModel] = None,
               output_loss: str = "stock", chunk_tokens: Optional[int] = None) -> int:
    """`solve_plan`'s / `evaluate_plan`'s `loss_bytes` for pipeline stage `stage` (None: the
    last): what the step holds outside the blocks while every block's stored tensors are live
    and none has backpropagated yet (the loss, and the output layer's backward), all
    micro-batches in flight included. The peak is at least the stored bytes plus this.

    `outer_bytes` (the final norm's and the output layer's inputs, what the loss saves; the
    embedding's dropout mask priced for `device`: bool on CUDA, the model dtype on CPU), and
    on the last stage the larger of two events, T = s*b the tokens the loss sees, V the
    padded vocabulary per rank, e bytes per element:

    - "stock" loss, its forward: the logits in the model dtype T*V*e (the output layer's
      result, held by GPTModel while the cross entropy turns its fp32 copy into the softmax)
      and the cross entropy's per-token bookkeeping (`_CE_BOOKKEEPING`, 28 bytes);
    - "stock", the output layer's backward, the loss's softmax freed: the logits' gradient
      T*V*e, the weight's gradient V*h*e (when `DeviceModel.wgrad_temporaries`), the input's
      gradient T*h*e and the per-token losses with the loss and its seed (4T + 8);
    - "chunked" (`llm_act.output.chunked_linear_cross_entropy`, `chunk_tokens` tokens at a
      time), its backward, the larger: the fp32 weight-gradient accumulator V*h*4 and, in
      16 bits, each chunk's partial V*h*e; one chunk's softmax c*V*4 and its 16-bit copy c*V*e
      and the chunk's indices (9 bytes a token); the input's gradient T*h*e; the labels'
      int64 copy, the fp32 incoming gradient, its upcast and the per-token losses (20T), and
      the loss with its seed (8).

    Exact for megatron-core 0.16.1's GPTModel on CPU (tests/planner/test_peak_vs_measured.py).
    Not counted: the stage's input (the embedding output, which GPTModel holds until its
    forward returns): when the first layer keeps its input raw it is that stored `ln1.input`;
    a plan that encodes it has both alive at the loss, `input_bytes` more (the planner's
    `input_bytes`)."""
    from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS

    device = device or DeviceModel()
    stage = shape.pp - 1 if stage is None else stage
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if output_loss not in ("stock", "chunked"):
        raise ValueError(f"output_loss: expected 'stock' or 'chunked', got {output_loss!r}")
    chunk = _positive_int(DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens, "chunk_tokens")
    stage = int(stage)
    outer = outer_bytes(shape, stage) if output_loss == "stock" else outer_bytes(shape, stage, output_loss)
    b, e, h, inflight = shape.micro_batch_size, shape.elem_bytes, shape.hidden_size, shape.pp - stage
    n_hid = shape.local_seq * b * h
    total = sum(n for k, n in outer.items() if k != "embedding.dropout_mask")
    if "embedding.dropout_mask" in outer:
        total += inflight * n_hid * _mask_bytes(shape, device)
    if stage != shape.pp - 1:
        return total
    tokens, vocab = shape.seq_length * b, shape.padded_vocab_size // shape.tp
    losses = _LOSS_PER_TOKEN * tokens + _LOSS_SCALARS
    if output_loss == "stock":
        forward = tokens * (vocab * e + _CE_BOOKKEEPING)
        wgrad = vocab * h * e if device.wgrad_temporaries else 0
        backward = tokens * vocab * e + wgrad + tokens * h * e + losses - outer["loss.logits"]
        return total + max(forward, backward)
    c, half = min(chunk, tokens), (e if e != 4 else 0)  # fp32 weights: no 16-bit copies
    backward = (vocab * h * (4 + half) + c * vocab * (4 + half) + 9 * c + tokens * h * e
                + (8 + 4 + 4) * tokens + losses)
    return total + backward


def input_bytes(shape: ModelShape) -> int:
    """`solve_plan`'s / `evaluate_plan`'s `input_bytes`: the stage's input per rank (the
    embedding output, or the activations received from the previous stage), [s/tp under
    sequence parallelism, b, h] in the model dtype, which the model holds until its forward
    returns: live beside the first block's code at the end of forward when that block
    encodes its checkpoint."""
    return shape.local_seq * shape.micro_batch_size * shape.hidden_size * shape.elem_bytes


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
    (`llm_act.planner.transient.BACKWARD_STAGES`) besides the stored, rebuilt and decoded
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
    output and its gradient in place of the losses. Measured against
    `llm_act.measurement.peak_memory` on CPU by tests/planner/test_peak_vs_measured.py."""
    device = device or DeviceModel()
    s, b, h, e = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.elem_bytes
    t, d = shape.tp, shape.head_dim
    a = shape.num_attention_heads // t
    tokens = s * b
    n_hid = shape.local_seq * b * h
    loss = _LOSS_PER_TOKEN * tokens + _LOSS_SCALARS
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
    after = names[names.index("attn.softmax") + 1:]
    freed = 0
    for st in sites:
        if st.name in after:
            itemsize = torch.empty((), dtype=st.dtype).element_size()
            freed += st.keep_bytes if st.keep_bytes is not None else math.prod(st.dims) * itemsize + st.extra
    softmax_bytes = e if device.fused_softmax else 4
    if shape.dropout > 0 or softmax_bytes != e:  # the 16-bit probabilities probs @ V reads
        freed += scores * e
    return (("mlp", mlp), ("attention", max(0, live - freed)))


def parameters_per_rank(shape: ModelShape, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds (Megatron's layout: column/row
    parallel linears split over TP, norms and row-parallel biases replicated)."""
    h, t, d = shape.hidden_size, shape.tp, shape.head_dim
    a, g = shape.num_attention_heads, shape.num_query_groups
    norm = (2 if shape.normalization == "LayerNorm" else 1) * h
    qkv_out = (a + 2 * g) * d // t
    bias = shape.bias
    layer = (2 * norm
             + h * qkv_out + (qkv_out if bias else 0)
             + a * d // t * h + (h if bias else 0)
             + h * (shape.fc1_width // t) + (shape.fc1_width // t if bias else 0)
             + shape.ffn_hidden_size // t * h + (h if bias else 0))
    if shape.is_moe:  # the router and this rank's experts (no biases) instead of the MLP
        layer -= (h * (shape.fc1_width // t) + (shape.fc1_width // t if bias else 0)
                  + shape.ffn_hidden_size // t * h + (h if bias else 0))
        layer += h * shape.num_experts + shape.num_experts // shape.ep * (
            h * shape.moe_fc1_width + shape.moe_ffn_hidden_size * h)
    if shape.qk_layernorm:  # the q and k norms over head_dim, replicated
        layer += 2 * norm // h * d
    total = shape.layers_per_stage * layer
    emb = shape.padded_vocab_size // t * h
    if stage == 0:
        total += emb + (shape.seq_length * h if shape.position_embedding == "learned_absolute" else 0)
    if stage == shape.pp - 1:
        total += norm
        if not shape.tie_embeddings or shape.pp > 1:  # its own output weight, or the tied copy
            total += emb
    return total


def static_bytes(shape: ModelShape, zero_stage: int = 0, dp: int = 1,
                 stage: Optional[int] = None) -> int:
    """Weights, gradients, fp32 master weights and Adam moments held by one rank.

    Per parameter: weights in the model dtype; gradients in fp32 for bf16 (Megatron's
    main_grad) else in the model dtype; an fp32 master copy unless the model is fp32;
    Adam's two fp32 moments. ZeRO over `dp` ranks shards the optimizer state (stage 1),
    then the gradients (2), then the weights (3). `stage` None: the largest pipeline stage.

    An MoE model's experts (`expert_parameters_per_rank`) shard over their own
    data-parallel group instead, as megatron-core's distributed optimizer does: the `dp`
    data-parallel ranks of the dense parameters hold `ep` different expert shards, so each
    expert parameter is replicated over dp / ep ranks only (1 at dp = ep: nothing to shard).
    """
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, got {zero_stage!r}")
    dp = _positive_int(dp, "dp")
    if stage is None:
        return max(static_bytes(shape, zero_stage, dp, k) for k in range(shape.pp))
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if shape.ep > 1 and dp % shape.ep:
        raise ValueError(f"dp={dp} is not a multiple of ep={shape.ep}: megatron-core takes the "
                         f"expert-parallel ranks from the data-parallel ones (set dp to a multiple of ep)")
    experts = expert_parameters_per_rank(shape, int(stage))
    e = shape.elem_bytes

    def held(n: int, group: int) -> int:
        weights = n * e
        grads = n * (4 if shape.dtype == "bf16" else e)
        optim = n * ((0 if shape.dtype == "fp32" else 4) + 8)

        def shard(nbytes: int, from_stage: int) -> int:
            return -(-nbytes // group) if zero_stage >= from_stage else nbytes

        return shard(optim, 1) + shard(grads, 2) + shard(weights, 3)

    return held(parameters_per_rank(shape, int(stage)) - experts, dp) + held(experts, dp // shape.ep)


def expert_parameters_per_rank(shape: ModelShape, stage: int) -> int:
    """The share of `parameters_per_rank` in this rank's experts (0 for a dense model): what
    shards over the expert data-parallel group (`static_bytes`)."""
    if not shape.is_moe:
        return 0
    h = shape.hidden_size
    return shape.layers_per_stage * shape.num_experts // shape.ep * (
        h * shape.moe_fc1_width + shape.moe_ffn_hidden_size * h)
