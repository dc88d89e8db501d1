"""What the planner knows about one transformer block: per saved tensor, its size, the
forward time of the op that produces it, and what each codec would store and cost.

The profiles are frozen and hashable so that identical blocks (the usual case: every
layer of a GPT) can be recognised and share one set of MILP variables (Adacc sec. 3.3).
Lists given for tuple fields are turned into tuples.
"""
from __future__ import annotations

import dataclasses

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from llm_act.codecs.registry import has_bits
from llm_act.sites import BACKWARD_STAGES
from llm_act.sites import CHECKPOINT_SITE


def byte_count(value, what: str) -> int:
    """An exact non-negative byte count (ints, or floats that hold an integer)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected an integer byte count, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif math.isfinite(value) and float(value).is_integer():
        value = int(value)
    else:
        raise ValueError(f"{what}: expected an integer byte count, got {value!r}")
    if value < 0:
        raise ValueError(f"{what}: must be >= 0, got {value}")
    return value


def _non_negative(value, what: str, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected a number, got {value!r}")
    value = float(value)
    if value != value or value < 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{what}: must be a finite number >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class CodecOption:
    """One codec a site may use: stored bytes, encode/decode time (ms) and the noise
    S(option) it adds per unit of the site's sensitivity (GACT sec. 4; 0 = lossless)."""

    name: str
    nbytes: int
    encode_ms: float
    decode_ms: float
    variance: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"CodecOption.name: expected a non-empty string, got {self.name!r}")
        if self.name in ("keep", "recompute"):
            raise ValueError(f"CodecOption.name: {self.name!r} is not a codec (it is always an option)")
        object.__setattr__(self, "nbytes", byte_count(self.nbytes, f"CodecOption {self.name!r} nbytes"))
        for f in ("encode_ms", "decode_ms", "variance"):
            object.__setattr__(self, f, _non_negative(getattr(self, f), f"CodecOption {self.name!r} {f}"))

    @property
    def cost_ms(self) -> float:
        return self.encode_ms + self.decode_ms


@dataclass(frozen=True)
class SiteProfile:
    """One tensor a block saves for backward.

    `forward_ms` is the forward time of the producer op, paid once if the site is
    recomputed; None or math.inf means the site cannot be recomputed (the site named
    `ln1.input`, the block's checkpoint, never can). `inputs` names the sites of the same
    block that the producer reads (empty: computed from the block input, always there).
    """

    name: str
    nbytes: int
    forward_ms: Optional[float]
    inputs: tuple[str, ...] = ()
    codecs: tuple[CodecOption, ...] = ()
    sensitivity: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"SiteProfile.name: expected a non-empty string, got {self.name!r}")
        object.__setattr__(self, "nbytes", byte_count(self.nbytes, f"site {self.name!r} nbytes"))
        if self.forward_ms is not None:
            object.__setattr__(
                self, "forward_ms",
                _non_negative(self.forward_ms, f"site {self.name!r} forward_ms", allow_inf=True),
            )
        inputs = (self.inputs,) if isinstance(self.inputs, str) else tuple(self.inputs)
        for dep in inputs:
            if not isinstance(dep, str):
                raise TypeError(f"site {self.name!r} inputs: expected site names, got {dep!r}")
        if self.name in inputs:
            raise ValueError(f"site {self.name!r} lists itself among its inputs")
        object.__setattr__(self, "inputs", inputs)
        codecs = tuple(self.codecs)
        names = set()
        for c in codecs:
            if not isinstance(c, CodecOption):
                raise TypeError(f"site {self.name!r} codecs: expected CodecOption, got {c!r}")
            if c.name in names:
                raise ValueError(f"site {self.name!r} lists codec {c.name!r} twice")
            names.add(c.name)
        object.__setattr__(self, "codecs", codecs)
        object.__setattr__(
            self, "sensitivity", _non_negative(self.sensitivity, f"site {self.name!r} sensitivity")
        )

    @property
    def recomputable(self) -> bool:
        return (
            self.forward_ms is not None
            and math.isfinite(self.forward_ms)
            and self.name != CHECKPOINT_SITE
        )


def _stage_bytes(value: Any) -> tuple[tuple[str, int], ...]:
    known = [name for name, _ in BACKWARD_STAGES]
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)
    out = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] in known):
            raise ValueError(f"BlockProfile.stage_bytes: expected (stage, bytes) pairs with a stage "
                             f"in {known}, got {pair!r}")
        out.append((pair[0], byte_count(pair[1], f"BlockProfile.stage_bytes[{pair[0]!r}]")))
    if len({name for name, _ in out}) != len(out):
        raise ValueError(f"BlockProfile.stage_bytes: a stage appears twice in {value!r}")
    return tuple(out)


@dataclass(frozen=True)
class BlockProfile:
    """The saved tensors of one block, repeated `count` times (layers) with `inflight`
    micro-batches alive at once (pipeline stage k of p under 1F1B holds p - k).

    `full_ms`: the forward time of the whole block, what recomputing all of it from its
    input (`ln1.input`, kept or encoded) costs; None when the whole-block choice is not
    offered. Whole-block recompute reaches what no per-site choice can: it also drops what a
    site's own recompute leaves behind (RoPE tables, the MoE dispatcher's outputs)."""

    sites: tuple[SiteProfile, ...]
    count: int = 1
    inflight: int = 1
    full_ms: Optional[float] = None
    grad_bytes: int = 0
    """what is live only while the block backpropagates, besides its rebuilt and decoded
    tensors: the gradients in flight (the block's input and output gradients, weight-gradient
    temporaries, the attention's score gradients). It adds to the block's transient: to a
    whole-block recompute's, and to the per-site choices' when `stage_bytes` is empty."""
    stage_bytes: tuple[tuple[str, int], ...] = ()
    """the same per backward stage (`llm_act.sites.BACKWARD_STAGES`), for the
    per-site choices: ((stage, bytes), ...). Empty: one stage holding every site, with
    `grad_bytes`."""
    checkpoint_bytes: Optional[int] = None
    """what whole-block recompute keeps of its checkpoint (`CHECKPOINT_SITE`): the block's
    input alone, where the site also holds what the block's first op saves of it (a Hugging
    Face RMSNorm's normalised copy, rebuilt with the block); None: the whole site. The whole-block
    options store that share of the site's bytes and rebuild the rest."""

    def __post_init__(self) -> None:
        sites = tuple(self.sites)
        seen: dict[str, SiteProfile] = {}
        for s in sites:
            if not isinstance(s, SiteProfile):
                raise TypeError(f"BlockProfile.sites: expected SiteProfile, got {s!r}")
            if s.name in seen:
                raise ValueError(f"BlockProfile.sites: site {s.name!r} appears twice")
            seen[s.name] = s
        for s in sites:
            for dep in s.inputs:
                if dep not in seen:
                    raise ValueError(
                        f"site {s.name!r} reads {dep!r}, which is not a site of the block "
                        f"(sites: {', '.join(seen)})"
                    )
        _check_acyclic(seen)
        object.__setattr__(self, "sites", sites)
        for f in ("count", "inflight"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"BlockProfile.{f}: expected an int, got {v!r}")
            if v < 1:
                raise ValueError(f"BlockProfile.{f}: must be >= 1, got {v}")
            object.__setattr__(self, f, int(v))
        object.__setattr__(self, "grad_bytes", byte_count(self.grad_bytes, "BlockProfile.grad_bytes"))
        object.__setattr__(self, "stage_bytes", _stage_bytes(self.stage_bytes))
        if self.checkpoint_bytes is not None:
            object.__setattr__(self, "checkpoint_bytes",
                               byte_count(self.checkpoint_bytes, "BlockProfile.checkpoint_bytes"))
            site = seen.get(CHECKPOINT_SITE)
            if site is None or self.checkpoint_bytes > site.nbytes:
                raise ValueError(f"BlockProfile.checkpoint_bytes: {self.checkpoint_bytes} must be at most "
                                 f"the bytes of {CHECKPOINT_SITE!r} (a site of the block), which it is part of")
        if self.full_ms is not None:
            if CHECKPOINT_SITE not in seen:
                raise ValueError(f"BlockProfile.full_ms: whole-block recompute starts from "
                                 f"{CHECKPOINT_SITE!r}, which is not a site of the block")
            object.__setattr__(self, "full_ms", _non_negative(self.full_ms, "BlockProfile.full_ms"))

    def recomputing_only(self, names) -> "BlockProfile":
        """This block with "recompute" offered only at the sites in `names` (what the layers
        can rebuild alone); the whole-block option stays."""
        return dataclasses.replace(self, sites=tuple(
            s if s.name in names else dataclasses.replace(s, forward_ms=None) for s in self.sites))

    def with_min_bits(self, min_bits: int) -> "BlockProfile":
        """This block with only the codecs that store at least `min_bits` bits per value
        (`codecs.registry.has_bits`: `ActConfig.min_bits`, plan "auto"'s floor)."""
        return dataclasses.replace(self, sites=tuple(
            dataclasses.replace(s, codecs=tuple(o for o in s.codecs if has_bits(o.name, min_bits)))
            for s in self.sites))

    def scaled(self, factor: float) -> "BlockProfile":
        """This block with every site's sensitivity times `factor`: a layer whose
        compression noise matters more (> 1) or less (< 1) to the gradient."""
        factor = _non_negative(factor, "factor")
        return dataclasses.replace(self, sites=tuple(
            dataclasses.replace(s, sensitivity=s.sensitivity * factor) for s in self.sites))


def _check_acyclic(sites: dict[str, SiteProfile]) -> None:
    """Producer ops form a DAG; a cycle could never be recomputed in any order."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = path[path.index(name):] + [name]
            raise ValueError(f"site inputs form a cycle: {' -> '.join(cycle)}")
        state[name] = 1
        for dep in sites[name].inputs:
            visit(dep, path + [name])
        state[name] = 2

    for name in sites:
        visit(name, [])
