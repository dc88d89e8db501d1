"""The planner's problem data: the options of every site and the classes of equal blocks.

One job: turn `BlockProfile`s into what the MILP (`llm_act.planner.milp_model`) and the
searches around it choose among, and price a choice exactly. Per site the options are keep,
each codec and recompute (`site_options`); per block the whole-block recomputes, with the
checkpoint kept or encoded (`whole_block_options`). Blocks with equal (sites, inflight) share one
`BlockClass` and its variables, their counts added up (`block_classes`). `evaluate_choice` gives the exact
bytes, peak, time and noise of a `Solution` in integer bytes: every plan a solver returns is
checked with it, so the tolerances of floating point never decide whether a plan fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from llm_act.codecs.registry import FEWBIT_CODECS, KEEP, RECOMPUTE
from llm_act.planner.profile import BlockProfile, SiteProfile, byte_count
from llm_act.planner.transient import transient_bytes, whole_block_bytes
from llm_act.sites import CHECKPOINT_SITE, MODEL_SITES


@dataclass(slots=True)
class ChoiceOption:
    name: str
    stored: int
    cost_ms: float
    noise: float  # sensitivity * S(option)
    transient: int = 0  # a whole-block option: what the rebuilt block holds while it backpropagates

    @property
    def gives_value(self) -> bool:
        """Can a recomputation read this site? Not from a few-bit code (it holds f'(x))."""
        return self.name not in FEWBIT_CODECS


@dataclass
class BlockClass:
    """Blocks with equal (sites, inflight, full_ms): one set of variables. `full`: the
    whole-block options (recompute everything from the checkpoint, kept or encoded), of
    which a plan takes an integer count of the class's blocks."""

    sites: tuple[SiteProfile, ...]
    inflight: int
    count: int = 0
    options: list[list[ChoiceOption]] = field(default_factory=list)
    full: list[ChoiceOption] = field(default_factory=list)
    grad: int = 0
    """bytes added to the transient while one of its blocks backpropagates (`grad_bytes`: the
    whole-block options', and the per-site choices' when `stages` is empty); a class with no
    sites and no whole-block options is only a floor under the peak (the end of forward:
    `solve_plan`'s `loss_bytes`)"""
    stages: tuple[tuple[str, int], ...] = ()
    """`BlockProfile.stage_bytes`: the per-site choices' transient is priced per backward
    stage (`llm_act.planner.transient`)"""
    first: bool = False
    """holds the stage's first block: when it encodes its checkpoint, the raw stage input the
    model holds until its forward returns is live beside the code at the end of forward
    (a floor's `input_bytes`)"""
    input_bytes: int = 0
    """a floor: bytes added to it when a `first` class encodes its checkpoint"""

    def encodes_checkpoint(self, pick: Sequence[int], full: Sequence[int]) -> bool:
        """Whether a block of this class stores its checkpoint encoded under per-site `pick`
        (its rest) and whole-block counts `full`."""
        names = [s.name for s in self.sites]
        if self.count > sum(full) and CHECKPOINT_SITE in names:
            i = names.index(CHECKPOINT_SITE)
            if self.options[i][pick[i]].name != KEEP:
                return True
        return any(n and checkpoint_of(f.name) != KEEP for n, f in zip(full, self.full))

    def transient(self, names: Sequence[str]) -> int:
        """The per-site choices' transient under option names `names`, gradients included."""
        nbytes = [s.nbytes for s in self.sites]
        sites = [s.name for s in self.sites]
        inputs = [s.inputs for s in self.sites]
        if self.stages:
            return transient_bytes(nbytes, names, sites, inputs, self.stages)
        return self.grad + transient_bytes(nbytes, names, sites)

    @property
    def floor(self) -> bool:
        return not self.options and not self.full

    @property
    def freed_first(self) -> bool:
        """Holds only sites after the blocks (`MODEL_SITES`: the final norm's input), whose
        backward runs before any block's: what they store is live at the end of forward and
        freed before a block backpropagates (`counts_out_early`)."""
        return bool(self.sites) and all(s.name in MODEL_SITES for s in self.sites)


def counts_out_early(classes: Sequence[BlockClass]) -> bool:
    """Whether the blocks' transients count out what the sites after the blocks store
    (`BlockClass.freed_first`): where the end of forward is its own event (a floor class:
    `solve_plan`'s `loss_bytes` / `input_bytes`), those bytes are live there and freed before
    any block backpropagates. Without it (the runtime's measured model, which holds what lies
    outside the blocks through the whole step) they are counted like any stored tensor."""
    return any(c.floor for c in classes)


def site_options(site: SiteProfile, resolution: float = 0.0) -> list[ChoiceOption]:
    """keep, each codec, recompute (where it can), their times rounded to `resolution`."""
    opts = [ChoiceOption(KEEP, site.nbytes, 0.0, 0.0)]
    opts += [ChoiceOption(c.name, c.nbytes, _rounded(c.cost_ms, resolution), site.sensitivity * c.variance)
             for c in site.codecs]
    if site.recomputable:
        opts.append(ChoiceOption(RECOMPUTE, 0, _rounded(float(site.forward_ms), resolution), 0.0))
    return opts


def exact_added_ms(block: BlockProfile, choice: Sequence[str], whole: dict[str, int]) -> float:
    """The added time of `block` under per-site `choice` (names in site order) for the layers
    not recomputed whole, and `whole` ({checkpoint choice: layers}), from its exact times."""
    def cost(site: SiteProfile, name: str) -> float:
        if name == KEEP:
            return 0.0
        if name == RECOMPUTE:
            return float(site.forward_ms)
        return next(c.cost_ms for c in site.codecs if c.name == name)

    ckpt = next((s for s in block.sites if s.name == CHECKPOINT_SITE), None)
    rest = block.count - sum(whole.values())
    ms = rest * sum(cost(s, n) for s, n in zip(block.sites, choice)) if rest else 0.0
    return ms + sum(n * (block.full_ms + cost(ckpt, c)) for c, n in whole.items())


#: the codec a whole-block checkpoint may be stored with besides keep: 8 bits with stochastic
#: rounding (GACT's compressed checkpoint, 1 byte per element instead of 2, unbiased); fewer
#: bits would put their error into every tensor the block recomputes from it, which the
#: checkpoint site's own sensitivity does not see
CHECKPOINT_CODECS = ("int8",)


def full_name(checkpoint: str) -> str:
    """The name of a whole-block option: "full" with the block input kept, "full:<codec>"
    with it encoded."""
    return "full" if checkpoint == KEEP else f"full:{checkpoint}"


def checkpoint_of(name: str) -> str:
    """The block input's choice in the whole-block option `name` (`full_name`'s inverse)."""
    return KEEP if name == "full" else name.split(":", 1)[1]


def whole_block_options(block: BlockProfile, options: list[list[ChoiceOption]], resolution: float = 0.0
                  ) -> list[ChoiceOption]:
    """Whole-block recompute with the checkpoint kept or stored by each of its value codecs:
    stored the checkpoint's option, time the block's forward (+ the codec's), noise the
    codec's; while the block backpropagates, every other site is live at full precision
    (and the decoded checkpoint, when encoded)."""
    if block.full_ms is None:
        return []
    names = [s.name for s in block.sites]
    nbytes = [s.nbytes for s in block.sites]
    ci = names.index(CHECKPOINT_SITE)
    held = block.checkpoint_bytes
    return [ChoiceOption(full_name(o.name), checkpoint_stored(o.stored, nbytes[ci], held),
                         _rounded(block.full_ms, resolution) + o.cost_ms, o.noise,
                         whole_block_bytes(nbytes, names, o.name, held))
            for o in options[ci] if o.name == KEEP or o.name in CHECKPOINT_CODECS]


def checkpoint_stored(stored: int, site_bytes: int, held: Optional[int]) -> int:
    """What a whole-block checkpoint stores under an option storing `stored` bytes of the
    whole checkpoint site (`site_bytes`): the same share of it as the checkpoint holds of the
    site (`held`, `BlockProfile.checkpoint_bytes`; None: all of it), rounded up -- a codec's
    bytes scale with the values it encodes."""
    if held is None or held >= site_bytes or not site_bytes:
        return stored
    return -(-stored * held // site_bytes)


def _rounded(ms: float, resolution: float) -> float:
    """`ms` on a geometric grid of ratio 1 + resolution (times that differ by less than their
    measurement noise compare equal, so near-ties are broken by noise, then order)."""
    if resolution <= 0 or not ms > 0 or math.isinf(ms):
        return ms
    step = math.log1p(resolution)
    return math.exp(round(math.log(ms) / step) * step)


def block_classes(blocks: Sequence[BlockProfile], resolution: float = 0.0) -> tuple[list[BlockClass], list[int]]:
    """Blocks grouped into classes (equal blocks share variables), with every option's time
    rounded to `resolution` (relative; 0: exact)."""
    index: dict[tuple, int] = {}
    classes: list[BlockClass] = []
    owner: list[int] = []
    for block in blocks:
        key = (block.sites, block.inflight, block.full_ms, block.grad_bytes, block.stage_bytes,
               block.checkpoint_bytes)
        if key not in index:
            index[key] = len(classes)
            options = [site_options(s, resolution) for s in block.sites]
            classes.append(BlockClass(block.sites, block.inflight, options=options,
                                  full=whole_block_options(block, options, resolution), grad=block.grad_bytes,
                                  stages=block.stage_bytes))
        classes[index[key]].count += block.count
        owner.append(index[key])
    return classes, owner


def no_whole_blocks(classes: Sequence[BlockClass]) -> list[list[int]]:
    return [[0] * len(c.full) for c in classes]


#: a solution: (per class, the option index per site; per class, the blocks per whole-block option)
Solution = tuple[list[list[int]], list[list[int]]]


def evaluate_choice(classes: list[BlockClass], picks: list[list[int]],
              fulls: Optional[list[list[int]]] = None, ordered: bool = False) -> tuple[int, int, float, float]:
    """Exact figures of a choice: (stored bytes, peak bytes, time ms, noise). `fulls[k]`:
    how many of class k's blocks take each whole-block option (the rest take `picks[k]`).
    `ordered`: the classes are blocks in layer order (`evaluate_plan(ordered=True)`): a block
    backpropagates after every later one has freed what it stores (one micro-batch's)."""
    stored, peak, ms, noise = 0, 0, 0.0, 0.0
    fulls = fulls or no_whole_blocks(classes)
    early = counts_out_early(classes)
    # what one micro-batch of each class stores (a floor: nothing)
    batch = [(c.count - sum(f)) * sum(c.options[i][o].stored for i, o in enumerate(p))
             + sum(n * opt.stored for n, opt in zip(f, c.full)) for c, p, f in zip(classes, picks, fulls)]
    # ordered: what the later blocks store, freed before a block backpropagates (the sites
    # after the blocks count in `gone_early` where the end of forward is its own event)
    later = [0 if early and c.freed_first else b for c, b in zip(classes, batch)]
    behind = [sum(later[k + 1:]) if ordered else 0 for k in range(len(classes))]
    encoded = any(c.first and not c.floor and c.encodes_checkpoint(p, f) for c, p, f in zip(classes, picks, fulls))
    # what the sites after the blocks store: freed before any block backpropagates (`counts_out_early`)
    gone_early = sum(c.inflight * b for c, b in zip(classes, batch) if c.freed_first) if early else 0
    for cls, pick, full, one, freed in zip(classes, picks, fulls, batch, behind):
        if cls.floor:
            peak = max(peak, cls.grad + (cls.input_bytes if encoded else 0))
            continue
        rest = cls.count - sum(full)
        if rest < 0:
            raise ValueError(f"{sum(full)} whole-block choices in a class of {cls.count} blocks")
        opts = [cls.options[i][o] for i, o in enumerate(pick)]
        stored += cls.inflight * one
        gone = (0 if cls.freed_first else gone_early) + freed
        if rest:
            peak = max(peak, cls.transient([o.name for o in opts]) - gone)
        peak = max([peak] + [cls.grad + f.transient - gone for n, f in zip(full, cls.full) if n])
        ms += rest * sum(o.cost_ms for o in opts) + sum(n * f.cost_ms for n, f in zip(full, cls.full))
        noise += rest * sum(o.noise for o in opts) + sum(n * f.noise for n, f in zip(full, cls.full))
    return stored, peak, ms, noise


def end_of_forward_class(classes: list[BlockClass], owner: list[int], loss_bytes: int,
                         input_bytes: int) -> list[BlockClass]:
    """The end of forward as a class (none when it holds nothing), the first block's class
    marked (`BlockClass.first`)."""
    loss_bytes = byte_count(loss_bytes, "loss_bytes")
    input_bytes = byte_count(input_bytes, "input_bytes")
    if owner:
        classes[owner[0]].first = True
    return [BlockClass((), 1, 0, grad=loss_bytes, input_bytes=input_bytes)] if loss_bytes or input_bytes else []
