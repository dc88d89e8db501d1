"""`ActConfig`: the one configuration object behind every door.

Every field is a key of the DeepSpeed `"activation_compression"` section and an
`--act-compress-<field-with-dashes>` flag. `from_dict` rejects unknown keys and bad
values with a `ValueError` that names the key.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from llm_act.codecs.registry import check_choice
from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS

PLAN_MODES = ("auto", "keep", "compress", "recompute", "selective")
ATTENTION_MODES = ("auto", "stock", "sdpa", "chunked")
#: plan "auto"'s default noise budget, as a fraction of the measured sampling noise
#: (`llm-act bench convergence`, docs/benchmarks.md, is the evidence behind it)
NOISE_FRACTION = 0.25
#: plan "auto"'s default floor on the bits per stored value (`ActConfig.min_bits`)
DEFAULT_MIN_BITS = 4
#: how plan "auto" treats a biased codec under a noise budget: "charge" its noise at the
#: coherent error measured on the real gradient, or "exclude" it
BIASED_MODES = ("charge", "exclude")
#: the output layer and its loss: megatron's own ("stock"), the chunked linear + cross-entropy
#: that never holds the [tokens, vocab] logits ("chunked"), or the planner's choice ("auto")
OUTPUT_LOSS_MODES = ("auto", "stock", "chunked")

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: Union[int, float, str], key: str = "budget") -> int:
    """'60GB' -> 60e9, '60GiB' -> 60 * 2**30, 123 -> 123. Raises ValueError naming `key`."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a byte count or a size like '60GB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(
                f"{key}: cannot read {value!r} as a size; write bytes or a number with "
                f"one of the units {', '.join(u for u in _UNITS if u)} (e.g. '60GB', '60GiB')"
            )
        number, unit = float(m.group(1)), m.group(2).upper()
    else:
        raise ValueError(f"{key}: expected a byte count or a size like '60GB', got {value!r}")
    nbytes = number * _UNITS[unit]
    if not nbytes > 0 or nbytes != nbytes or nbytes == float("inf"):
        raise ValueError(f"{key}: must be a positive size, got {value!r}")
    return int(nbytes)


@dataclass
class ActConfig:
    """How llm_act stores the activations a transformer block saves for backward."""

    enabled: bool = True
    """Turn activation compression on; when False the model is left untouched."""

    plan: str = "auto"
    """"auto" (the planner decides under `budget`), "keep" (exactly stock megatron-core,
    stock attention included), "compress" (every site at its default codec), "recompute"
    (Megatron-style full block recompute), or a path to a JSON plan."""

    budget: Optional[Union[int, str]] = None
    """Activation memory budget: bytes, or a size such as "60GB" (1e9) / "60GiB" (2**30).
    None: on a GPU the free memory after the first iteration minus a margin, on CPU the
    memory of the "compress" plan. Normalised to an int of bytes."""

    codecs: dict[str, str] = field(default_factory=dict)
    """Per-site overrides {site: codec name or "keep"/"recompute"}."""

    attention: str = "auto"
    """"stock", "sdpa", "chunked", or "auto": stock under plan "keep", memory-efficient otherwise."""

    adapt: bool = True
    """Re-profile and re-plan during training at exponentially growing intervals."""

    adapt_interval_max: int = 1024
    """The longest interval (iterations) between two re-planning points."""

    sensitivity: bool = True
    """Measure GACT gradient sensitivity per site and spend bits where they matter."""

    variance_budget: Optional[float] = None
    """Upper bound on the summed gradient noise sum_i c_i * S_i (in the units of the
    squared gradient norm); None: `noise_fraction` of the measured sampling noise."""

    seed: int = 1234
    """Seed of the codecs' private generator for stochastic rounding."""

    noise_fraction: Optional[float] = NOISE_FRACTION
    """Plan "auto"'s noise budget when `variance_budget` is None: this fraction of the
    gradient's own mini-batch sampling variance, measured during training (GACT sec. 4:
    below it, compression noise is lost in sampling noise). None: no noise budget."""

    biased_codecs: str = "exclude"
    """Under a noise budget, how plan "auto" treats codecs whose error does not average out
    (nearest rounding, fp8, few-bit tables; and at a site whose backward is not linear in
    the stored tensor -- Q and K, the norms' and the activation's inputs -- every lossy
    codec, stochastic rounding too: `codecs.registry.unbiased_at`): "exclude" (only
    stochastic roundings and exact codecs are chosen; the default) or "charge" (their noise
    is scaled by the coherence measured on the real gradient,
    `llm_act.measurement.sensitivity`). Why "exclude" by default: on 30 paired seeds over
    three bench models it lost no loss against "charge" (-0.20% on average), its plans
    settled (0-0.3 changes per 100 iterations against 1.1-1.8) and it measures no coherence
    rounds (docs/benchmarks.md, issue 42's second part)."""

    min_bits: int = DEFAULT_MIN_BITS
    """The fewest bits per value a codec plan "auto" chooses may store (`codecs.registry.
    VALUE_BITS`: INT1 1, INT2 and dual2 2, the INT4 family 4, INT8 and FP8 8; the few-bit
    derivative tables and the masks store no value and always qualify). 4 by default: on
    the Llama-style bench model stochastic INT2 at q/k/v alone cost +3.2% and +4.2% in
    validation loss (seeds 1234-1235), 4-bit codecs alone at any site no measurable loss,
    and the default plan's worst runs ended with INT1/INT2 at q/k/v (docs/benchmarks.md,
    issue 42). 1 offers every codec. Fixed plans and `codecs` pins are not limited."""

    fidelity_every: int = 250
    """Report the gradient fidelity (compressed against exact gradient on one
    micro-batch, `llm_act.measurement.fidelity`) every this many iterations; 0: only on request."""

    output_loss: str = "stock"
    """The output layer and its loss (megatron-core GPTModel; a Hugging Face causal LM called with
    labels under the DeepSpeed door, `patches.deepspeed.hf_output`): "stock" (megatron's own output
    layer and `vocab_parallel_cross_entropy`, which keeps the fp32 [tokens, vocab/tp] logits
    for backward), "chunked" (`llm_act.output.chunked_linear_cross_entropy`: the same loss,
    `output_chunk_tokens` tokens at a time, never the whole logits; one more logits GEMM in
    backward), or "auto": under plan "auto" the planner chooses between the two at each
    tracking point, under every fixed plan ("keep", "compress", "recompute", a JSON plan) it
    means "stock"."""

    output_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Tokens per chunk of the chunked output loss (its transient is one chunk's logits)."""

    def __post_init__(self) -> None:
        self._check_bool("enabled")
        self._check_bool("adapt")
        self._check_bool("sensitivity")
        if not isinstance(self.plan, str) or not self.plan:
            raise ValueError(f"plan: expected one of {PLAN_MODES} or a JSON plan path, got {self.plan!r}")
        if self.plan not in PLAN_MODES and not (self.plan.endswith(".json") or os.path.exists(self.plan)):
            raise ValueError(
                f"plan: {self.plan!r} is neither one of {', '.join(PLAN_MODES)} "
                "nor the path of a JSON plan file"
            )
        if self.budget is not None:
            self.budget = parse_bytes(self.budget, "budget")
        if not isinstance(self.codecs, dict):
            raise ValueError(f"codecs: expected a mapping site -> codec name, got {self.codecs!r}")
        for site, name in self.codecs.items():
            try:
                check_choice(site, name)
            except ValueError as err:
                raise ValueError(f"codecs: {err}") from None
        if self.attention not in ATTENTION_MODES:
            raise ValueError(
                f"attention: expected one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}"
            )
        if isinstance(self.adapt_interval_max, bool) or not isinstance(self.adapt_interval_max, int) \
                or self.adapt_interval_max < 1:
            raise ValueError(
                f"adapt_interval_max: expected a positive integer, got {self.adapt_interval_max!r}"
            )
        if self.variance_budget is not None:
            if isinstance(self.variance_budget, bool) or not isinstance(self.variance_budget, (int, float)) \
                    or not self.variance_budget >= 0:
                raise ValueError(
                    f"variance_budget: expected a non-negative number or None, got {self.variance_budget!r}"
                )
            self.variance_budget = float(self.variance_budget)
        if self.noise_fraction is not None:
            if isinstance(self.noise_fraction, bool) or not isinstance(self.noise_fraction, (int, float)) \
                    or not 0 < self.noise_fraction < math.inf:
                raise ValueError(
                    f"noise_fraction: expected a positive number (a fraction of the sampling noise, "
                    f"e.g. {NOISE_FRACTION}) or None, got {self.noise_fraction!r}"
                )
            self.noise_fraction = float(self.noise_fraction)
        if self.biased_codecs not in BIASED_MODES:
            raise ValueError(f"biased_codecs: expected one of {', '.join(BIASED_MODES)}, got {self.biased_codecs!r}")
        if isinstance(self.min_bits, bool) or not isinstance(self.min_bits, int) or not 1 <= self.min_bits <= 8:
            raise ValueError(f"min_bits: expected an integer from 1 to 8 (the fewest bits per value plan "
                             f"'auto' may store; 1: every codec), got {self.min_bits!r}")
        if isinstance(self.fidelity_every, bool) or not isinstance(self.fidelity_every, int) \
                or self.fidelity_every < 0:
            raise ValueError(
                f"fidelity_every: expected an integer >= 0 (0: reports only on request), got {self.fidelity_every!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
        if not isinstance(self.output_loss, str) or self.output_loss not in OUTPUT_LOSS_MODES:
            raise ValueError(
                f"output_loss: expected one of {', '.join(OUTPUT_LOSS_MODES)} (stock: megatron's output "
                f"layer and loss; chunked: never the full logits; auto: the planner's choice under plan "
                f"'auto', stock under a fixed plan), got {self.output_loss!r}"
            )
        if isinstance(self.output_chunk_tokens, bool) or not isinstance(self.output_chunk_tokens, int) \
                or self.output_chunk_tokens < 1:
            raise ValueError(
                f"output_chunk_tokens: expected an integer >= 1 (tokens per chunk of the chunked output "
                f"loss), got {self.output_chunk_tokens!r}"
            )

    def output_loss_mode(self) -> str:
        """`output_loss` resolved against the plan: "stock" or "chunked" where fixed; "auto"
        only under plan "auto" (the planner decides); "auto" under a fixed plan is "stock"."""
        if self.output_loss == "auto" and self.plan != "auto":
            return "stock"
        return self.output_loss

    def _check_bool(self, key: str) -> None:
        if not isinstance(getattr(self, key), bool):
            raise ValueError(f"{key}: expected true or false, got {getattr(self, key)!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ActConfig":
        """Build from a mapping (e.g. the DeepSpeed section); unknown keys raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"activation_compression: expected a mapping, got {type(d).__name__}")
        known = cls.field_names()
        for key in d:
            if key not in known:
                raise ValueError(
                    f"unknown key {key!r} in the activation compression config; "
                    f"known keys: {', '.join(known)}"
                )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
