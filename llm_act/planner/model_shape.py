"""The model's shape and the device it runs on, validated: what the analytic model reads.

One job: `ModelShape` (a GPT-style model and how it is split over tensor, pipeline and expert
parallelism, with the sizes derived from it: head width, padded vocabulary, the rows an MoE
layer's experts receive, one rank's `BlockDims`) and `DeviceModel` (a roofline model of one
accelerator). They have a module of their own because more than the block's cost model
(`llm_act.planner.analytic`) reads them: the presets, the budget search, `llm-act plan`, the
memory outside the blocks (`llm_act.planner.static_memory`) and the runtime's budget check,
which describes the layers it observes as a `ModelShape`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from llm_act.codecs.fewbit import ACTIVATIONS
from llm_act.config import ATTENTION_MODES  # ModelShape.attention ("stock" stores the softmax)
from llm_act.sites import BlockDims

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
#: Megatron-LM's --make-vocab-size-divisible-by default
VOCAB_DIVISOR = 128


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


def positive_int(value, what: str) -> int:
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
            object.__setattr__(self, f, positive_int(getattr(self, f), f))
        h, a = self.hidden_size, self.num_attention_heads
        object.__setattr__(self, "ffn_hidden_size", positive_int(
            4 * h if self.ffn_hidden_size is None else self.ffn_hidden_size, "ffn_hidden_size"))
        object.__setattr__(self, "num_query_groups", positive_int(
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
        object.__setattr__(self, "ep", positive_int(self.ep, "ep"))
        if self.num_experts is None:
            if self.ep != 1:
                raise ValueError(f"ep: expert parallelism (ep={self.ep}) needs an MoE model "
                                 "(num_experts), got a dense one")
            if self.moe_capacity_factor is not None:
                raise ValueError("moe_capacity_factor: a capacity factor needs an MoE model "
                                 "(num_experts), got a dense one")
            return
        e = positive_int(self.num_experts, "num_experts")
        object.__setattr__(self, "num_experts", e)
        k = positive_int(self.moe_topk, "moe_topk")
        if k > e:
            raise ValueError(f"moe_topk: expected at most num_experts={e}, got {k}")
        object.__setattr__(self, "moe_ffn_hidden_size", positive_int(
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
    def mlp_kind(self) -> str:
        """What the MLP's activation lets backward keep (`llm_act.codecs.registry.refusal`):
        a gated unit needs x itself, ReLU a 1-bit mask, any other fitted activation f'(x)."""
        from llm_act.codecs.registry import MLP_FEWBIT, MLP_MASK, MLP_VALUE

        if self.gated_linear_unit:
            return MLP_VALUE
        return MLP_MASK if self.activation == "relu" else MLP_FEWBIT

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
    def block_dims(self) -> BlockDims:
        """One rank's dimensions of a block, for the schema's shape formulas (`Site.dims`)."""
        t = self.tp
        experts = dict(rows=self.moe_rows, moe_f1=self.moe_fc1_width,
                       moe_f2=self.moe_ffn_hidden_size) if self.is_moe else {}
        return BlockDims(s=self.seq_length, sl=self.local_seq, b=self.micro_batch_size,
                         h=self.hidden_size, a=self.num_attention_heads // t,
                         g=self.num_query_groups // t, d=self.head_dim, f1=self.fc1_width // t,
                         f2=self.ffn_hidden_size // t, **experts)

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
