"""The per-block MILP (Adacc sec. 3.3, extended with codecs per site, a transient peak
and GACT's variance budget, sec. 4): for every saved tensor choose keep, a codec, or
recompute, at the least added step time that fits the memory budget.

Model, per distinct block k (blocks with equal (sites, inflight) share variables, their
counts add up) and site i, binary x[k,i,o] over o in {keep, codec..., recompute}:

    minimise   sum_k count_k * sum_i,o cost(i,o) x[k,i,o]
    s.t.       sum_o x[k,i,o] = 1
               peak >= sum_i nbytes_i x[k,i,recompute]
                       + sum_{j in G} nbytes_j * sum_{o codec} x[k,j,o]  for every k, group G
               sum_k count_k * inflight_k * sum_i,o stored(i,o) x[k,i,o] + peak <= budget - static
               sum_k count_k * sum_i,o sensitivity_i * S(o) x[k,i,o] <= variance_budget

cost: keep 0, codec encode+decode, recompute the producer's forward time (once: an input
that is itself recomputed is charged on its own site, never again by its readers).
stored: keep nbytes, codec option.nbytes, recompute 0. `peak` is the transient of the
block being backpropagated: its recomputed tensors (the region is rebuilt at once) plus
the largest group of tensors decoded together (`DECODE_GROUPS`: the attention's q, k, v
and output feed one backward; every other site is decoded by its own op's backward and
freed after it), at full precision. A recomputed site needs each input available in backward: kept, decoded,
or itself recomputed first (in the order of the input DAG, the block input always
there). Keep, recompute and value codecs all qualify; a few-bit codec does not (its
decode yields f'(x), not x), hence the row

               x[k,i,recompute] + sum_{o few-bit} x[k,j,o] <= 1      for every input j of i

Memory rows are written in MiB (a power-of-two scale, so byte counts stay exact in
floating point) and every plan the solver returns is re-checked in integer bytes.

Equal blocks share variables, so a uniform model is one small MILP whatever its depth.
Blocks that differ (per-layer sensitivities, pipeline stages) make a multiple-choice
knapsack whose LP bound is a few percent loose: the solver finds a good plan in well under
a second but can search for minutes to prove it optimal. `time_limit` caps the search;
the best plan found by then is used (verified like any other) and `Plan.optimal` says
that optimality was not proven. Many blocks that differ only in noise (>= FAST_MIN_CLASSES,
objective "time", a noise budget) take the fast path instead (`_fast_search`: the merged
MILP, then Lagrangian relaxation with exact per-block choices, `llm_act.planner.lagrange`):
a fraction of a second, within 0.05% of a 60 s search on 24-512 distinct layers.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from llm_act._imports import require
from llm_act.codecs.registry import FEWBIT_CODECS, KEEP, RECOMPUTE
from llm_act.plan import Plan, is_whole, whole_layer
from llm_act.planner.lagrange import blind_input, lagrange_plan
from llm_act.planner.profile import BlockProfile, SiteProfile, _byte_count
from llm_act.planner.transient import carries, decode_groups, stage_of, transient_bytes
from llm_act.sites import CHECKPOINT_SITE

log = logging.getLogger(__name__)

OBJECTIVES = ("time", "variance")
_MIB = float(2**20)
_GIB = float(2**30)
_TIE = 1e-6  # the tie-break term never weighs more than this fraction of a primary step
_VAR_RTOL = 1e-6  # relative tolerance of the variance budget
#: the `time_resolution` the adapter plans measured profiles with: times within 1% compare
#: equal, so such near-ties go to the lower noise. Measured (`llm-act bench planner`, 96
#: layers measured 8 times with every figure off by up to 2%): at 1% (or 0) the plans' true
#: added time agrees within 0.001%; at 2-5% the planner optimises the rounded times instead,
#: and the plans' true time spreads by 0.12%
TIME_RESOLUTION = 0.01
#: seconds `solve_plan` lets the solver search before it takes the best plan found so far
TIME_LIMIT_S = 10.0
#: from this many distinct blocks that differ only in noise (per-layer sensitivities), a
#: time-objective solve with a noise budget takes the fast path (`_fast_search`)
FAST_MIN_CLASSES = 16


class InfeasibleBudget(ValueError):
    """No plan fits the memory budget; `min_budget_bytes` is the smallest budget (static
    memory included) that some plan fits."""

    def __init__(self, budget_bytes: int, static_bytes: int, min_budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.static_bytes = static_bytes
        self.min_budget_bytes = min_budget_bytes
        super().__init__(
            f"budget_bytes={budget_bytes} ({budget_bytes / _GIB:.3f} GiB) cannot hold the "
            f"activations: with static_bytes={static_bytes} ({static_bytes / _GIB:.3f} GiB) the "
            f"smallest budget any plan fits is {min_budget_bytes} bytes "
            f"({min_budget_bytes / _GIB:.3f} GiB)"
        )


class SolverError(RuntimeError):
    """The MILP solvers could not decide a problem (neither a plan nor a proof that none
    exists). Not the user's doing: the adaptive planner keeps the plan in force."""


class InfeasibleVariance(ValueError):
    """No plan that fits the memory budget meets the variance budget; `min_variance` is
    the least summed noise any plan within the memory budget reaches."""

    def __init__(self, variance_budget: float, min_variance: float):
        self.variance_budget = variance_budget
        self.min_variance = min_variance
        super().__init__(
            f"variance_budget={variance_budget!r} cannot be met within the memory budget: "
            f"the least achievable summed noise is {min_variance!r}"
        )


@dataclass(slots=True)
class _Option:
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
class _Class:
    """Blocks with equal (sites, inflight, full_ms): one set of variables. `full`: the
    whole-block options (recompute everything from the checkpoint, kept or encoded), of
    which a plan takes an integer count of the class's blocks."""

    sites: tuple[SiteProfile, ...]
    inflight: int
    count: int = 0
    options: list[list[_Option]] = field(default_factory=list)
    full: list[_Option] = field(default_factory=list)
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


def _site_options(site: SiteProfile, resolution: float = 0.0) -> list[_Option]:
    """keep, each codec, recompute (where it can), their times rounded to `resolution`."""
    opts = [_Option(KEEP, site.nbytes, 0.0, 0.0)]
    opts += [_Option(c.name, c.nbytes, _rounded(c.cost_ms, resolution), site.sensitivity * c.variance)
             for c in site.codecs]
    if site.recomputable:
        opts.append(_Option(RECOMPUTE, 0, _rounded(float(site.forward_ms), resolution), 0.0))
    return opts


def _exact_ms(block: BlockProfile, choice: Sequence[str], whole: dict[str, int]) -> float:
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


def _full_options(block: BlockProfile, options: list[list[_Option]], resolution: float = 0.0
                  ) -> list[_Option]:
    """Whole-block recompute with the checkpoint kept or stored by each of its value codecs:
    stored the checkpoint's option, time the block's forward (+ the codec's), noise the
    codec's; while the block backpropagates, every other site is live at full precision
    (and the decoded checkpoint, when encoded)."""
    if block.full_ms is None:
        return []
    names = [s.name for s in block.sites]
    ci = names.index(CHECKPOINT_SITE)
    rest = sum(s.nbytes for s in block.sites if s.name != CHECKPOINT_SITE)
    return [_Option(full_name(o.name), o.stored, _rounded(block.full_ms, resolution) + o.cost_ms, o.noise,
                    rest + (block.sites[ci].nbytes if o.name != KEEP else 0))
            for o in options[ci] if o.name == KEEP or o.name in CHECKPOINT_CODECS]


def _rounded(ms: float, resolution: float) -> float:
    """`ms` on a geometric grid of ratio 1 + resolution (times that differ by less than their
    measurement noise compare equal, so near-ties are broken by noise, then order)."""
    if resolution <= 0 or not ms > 0 or math.isinf(ms):
        return ms
    step = math.log1p(resolution)
    return math.exp(round(math.log(ms) / step) * step)


def _classes(blocks: Sequence[BlockProfile], resolution: float = 0.0) -> tuple[list[_Class], list[int]]:
    """Blocks grouped into classes (equal blocks share variables), with every option's time
    rounded to `resolution` (relative; 0: exact)."""
    index: dict[tuple, int] = {}
    classes: list[_Class] = []
    owner: list[int] = []
    for block in blocks:
        key = (block.sites, block.inflight, block.full_ms, block.grad_bytes, block.stage_bytes)
        if key not in index:
            index[key] = len(classes)
            options = [_site_options(s, resolution) for s in block.sites]
            classes.append(_Class(block.sites, block.inflight, options=options,
                                  full=_full_options(block, options, resolution), grad=block.grad_bytes,
                                  stages=block.stage_bytes))
        classes[index[key]].count += block.count
        owner.append(index[key])
    return classes, owner


def _no_full(classes: Sequence[_Class]) -> list[list[int]]:
    return [[0] * len(c.full) for c in classes]


def _evaluate(classes: list[_Class], picks: list[list[int]],
              fulls: Optional[list[list[int]]] = None) -> tuple[int, int, float, float]:
    """Exact figures of a choice: (stored bytes, peak bytes, time ms, noise). `fulls[k]`:
    how many of class k's blocks take each whole-block option (the rest take `picks[k]`)."""
    stored, peak, ms, noise = 0, 0, 0.0, 0.0
    fulls = fulls or _no_full(classes)
    encoded = any(c.first and not c.floor and c.encodes_checkpoint(p, f) for c, p, f in zip(classes, picks, fulls))
    for cls, pick, full in zip(classes, picks, fulls):
        if cls.floor:
            peak = max(peak, cls.grad + (cls.input_bytes if encoded else 0))
            continue
        rest = cls.count - sum(full)
        if rest < 0:
            raise ValueError(f"{sum(full)} whole-block choices in a class of {cls.count} blocks")
        opts = [cls.options[i][o] for i, o in enumerate(pick)]
        stored += cls.inflight * (rest * sum(o.stored for o in opts)
                                  + sum(n * f.stored for n, f in zip(full, cls.full)))
        if rest:
            peak = max(peak, cls.transient([o.name for o in opts]))
        peak = max([peak] + [cls.grad + f.transient for n, f in zip(full, cls.full) if n])
        ms += rest * sum(o.cost_ms for o in opts) + sum(n * f.cost_ms for n, f in zip(full, cls.full))
        noise += rest * sum(o.noise for o in opts) + sum(n * f.noise for n, f in zip(full, cls.full))
    return stored, peak, ms, noise


@functools.lru_cache(maxsize=1)
def _solver_names() -> tuple[str, ...]:
    """The solvers to try, best first: HiGHS when highspy is installed, then a CBC on PATH
    or the CBC bundled with pulp < 4. More than one, so that a solver that fails on a
    problem (not "infeasible": a numerical "solve error") leaves another to decide it."""
    pulp = require("pulp", "the activation planner")
    available = pulp.listSolvers(onlyAvailable=True)
    names = tuple(n for n in ("HiGHS", "COIN_CMD", "PULP_CBC_CMD") if n in available)
    if not names:
        raise SolverError("no MILP solver is available: install highspy (pip install highspy) "
                          "or put a CBC on PATH")
    if names[0] == "HiGHS":
        _quiet_highs_banner()
    return names


def _quiet_highs_banner() -> None:
    """HiGHS prints its copyright banner to the process's stdout when the first solver object
    is built, whatever `msg` says; build that first one with stdout pointed at /dev/null so
    the banner never reaches a training log."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


#: per solver, the options of a second try after a "solve error" (presolve is where HiGHS
#: 1.16 fails on knapsack rows a byte below their edge)
_RETRY_OPTIONS = {"HiGHS": {"presolve": "off"}, "COIN_CMD": {"presolve": False},
                  "PULP_CBC_CMD": {"presolve": False}}


def _status(pulp, prob, status: int, deadline: float) -> Optional[str]:
    """`_solve`'s name for a pulp outcome, None when the solver decided nothing (an error)."""
    if status == pulp.LpStatusOptimal:
        return "feasible" if prob.sol_status == pulp.LpSolutionIntegerFeasible else "optimal"
    if status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible"
    if status == pulp.LpStatusNotSolved and time.perf_counter() >= deadline - 0.5:
        return "timeout"
    return None


def _solve(prob, deadline: float) -> str:
    """Solve in place until `deadline` (perf_counter seconds): "optimal"; "feasible" (the
    time limit stopped the proof); "infeasible"; "timeout" (no plan found in time); or
    "error" when every solver, each tried as is and then without presolve, ended without
    deciding (HiGHS's "solve error" on a budget a byte below its edge). Callers treat
    "error" as "no plan found": `solve_plan` then decides feasibility from the least-memory
    problem, so a solver's hiccup is classified, never passed on as a crash."""
    pulp = require("pulp", "the activation planner")
    for name in _solver_names():
        for options in ({}, _RETRY_OPTIONS.get(name, {})):
            seconds = max(1.0, deadline - time.perf_counter())  # the solvers take whole seconds
            with warnings.catch_warnings():
                # pulp 3.x announces the bundled CBC's removal in 4.0; it is still the fallback
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = getattr(pulp, name)(msg=False, gapRel=0.0, timeLimit=seconds, **options)
                try:
                    status = prob.solve(solver)
                except Exception as err:  # noqa: BLE001 -- pulp's HiGHS reader raises IndexError
                    # on some infeasible models: a try that decided nothing, like a solver error
                    log.debug("llm_act: the MILP solver %s failed: %s: %s", name, type(err).__name__, err)
                    continue
            outcome = _status(pulp, prob, status, deadline)
            if outcome is not None:
                return outcome
            log.debug("llm_act: the MILP solver %s%s ended with status %r", name,
                      f" {options}" if options else "", pulp.LpStatus[status])
            if time.perf_counter() >= deadline:
                return "timeout"
    return "error"


def _dual_bound(prob) -> Optional[float]:
    """The lower bound the solver proved on `prob`'s objective (HiGHS), else None."""
    try:
        bound = float(prob.solverModel.getInfo().mip_dual_bound)
    except Exception:  # noqa: BLE001 -- another solver, or no MIP info
        return None
    return bound if math.isfinite(bound) else None


def _variable(prob, name: str, cat: str, low: float = 0):
    """A variable of `prob` (pulp >= 3.3 attaches it to the model; older pulp cannot)."""
    pulp = require("pulp", "the activation planner")
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, upBound=1 if cat == "Binary" else None, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


class _Model:
    """The MILP over `classes`, with an objective in {"time", "variance", "memory"} and
    optional memory / variance rows.

    Per class, binary x picks one option per site for all its blocks, or binary w one of its
    whole-block options for all of them (sum_o x + sum w = 1 on every site's row). A class
    with no sites is a given number of whole blocks (`_whole_part`): integer counts per
    whole-block option summing to its count. Identical layers split between whole blocks and
    per-site ones are searched around this model (`_mix`): inside it, the product of a
    count and a choice made it 10-100x slower to solve."""

    def __init__(self, classes: list[_Class], objective: str,
                 mem_limit: Optional[int], var_limit: Optional[float]):
        pulp = require("pulp", "the activation planner")
        self.classes = classes
        self.prob = pulp.LpProblem("llm_act_plan", pulp.LpMinimize)
        self.x: list[list[list[Any]]] = []
        self.w: list[list[Any]] = []  # the variables of the whole-block options
        self.n: list[list[Any]] = []  # blocks per whole-block option
        for k, cls in enumerate(classes):
            forced = not cls.options
            ws = [_variable(self.prob, f"w_{k}_{c}", "Integer" if forced else "Binary")
                  for c in range(len(cls.full))]
            if forced:
                self.prob += pulp.lpSum(ws) == cls.count, f"whole_{k}"
            xs = []
            for i, opts in enumerate(cls.options):
                row = [_variable(self.prob, f"x_{k}_{i}_{o}", "Binary") for o in range(len(opts))]
                self.prob += pulp.lpSum(row) + pulp.lpSum(ws) == 1, f"one_{k}_{i}"
                xs.append(row)
            if var_limit is not None and var_limit == 0:
                for row, opts in zip(xs + [ws], cls.options + [cls.full]):
                    for v, opt in zip(row, opts):
                        if opt.noise > 0:
                            v.upBound = 0
            self.x.append(xs)
            self.w.append(ws)
            self.n.append(ws if forced else [cls.count * v for v in ws])
        for k, cls in enumerate(classes):
            where = {s.name: i for i, s in enumerate(cls.sites)}
            for i, (site, opts) in enumerate(zip(cls.sites, cls.options)):
                if opts[-1].name != RECOMPUTE:
                    continue
                for dep in site.inputs:
                    j = where[dep]
                    blind = [v for v, o in zip(self.x[k][j], cls.options[j]) if not o.gives_value]
                    if blind:
                        self.prob += self.x[k][i][-1] + pulp.lpSum(blind) <= 1, f"dep_{k}_{i}_{j}"
        self.peak = _variable(self.prob, "peak", "Continuous")
        encodes = []  # indicators: a first class stores its checkpoint encoded
        for k, cls in enumerate(classes):
            grad = cls.grad / _MIB
            if cls.floor:
                continue
            if cls.options:
                self._site_peak(k, cls)
                names = [s.name for s in cls.sites]
                if cls.first and CHECKPOINT_SITE in names:
                    i = names.index(CHECKPOINT_SITE)
                    encodes += [v for v, o in zip(self.x[k][i], cls.options[i]) if o.name != KEEP]
            for c, (w, opt) in enumerate(zip(self.w[k], cls.full)):
                used = w
                if not cls.options:  # some of the given whole blocks take option c
                    used = _variable(self.prob, f"f_{k}_{c}", "Binary")
                    self.prob += w <= cls.count * used, f"fused_{k}_{c}"
                self.prob += self.peak >= (opt.transient / _MIB + grad) * used, f"fpeak_{k}_{c}"
                if cls.first and checkpoint_of(opt.name) != KEEP:
                    encodes.append(used)
        encoded = 0
        if encodes and any(c.floor and c.input_bytes for c in classes):
            encoded = _variable(self.prob, "encoded_input", "Continuous")
            for e, v in enumerate(encodes):
                self.prob += encoded >= v, f"encoded_{e}"
        for k, cls in enumerate(classes):
            if cls.floor:
                self.prob += self.peak >= cls.grad / _MIB + (cls.input_bytes / _MIB) * encoded, f"floor_{k}"
        self.memory = self._sum(lambda c, o: c.inflight * o.stored / _MIB) + self.peak
        self.mem_row = self.var_row = None
        if mem_limit is not None:
            self.mem_row = "memory"
            self.prob += self.memory <= mem_limit / _MIB, self.mem_row
        if var_limit is not None and var_limit > 0:
            self.var_row = "variance"
            self.prob += self._sum(lambda c, o: o.noise / var_limit) <= 1.0, self.var_row
        self._objective(objective)

    def _site_peak(self, k: int, cls: _Class) -> None:
        """peak >= class k's per-site transient (`transient.transient_bound`): per backward
        stage its gradients, its recomputed sites, the sites a rebuild there brings forward
        (z >= both recomputed - 1, chain by chain) and each decode group it touches (one
        reached only by a rebuild counts when that rebuild happens: big-M on its z)."""
        pulp = require("pulp", "the activation planner")
        names = [s.name for s in cls.sites]
        nb = [s.nbytes / _MIB for s in cls.sites]
        can = [opts[-1].name == RECOMPUTE for opts in cls.options]
        rec = [pulp.lpSum(v for v, o in zip(row, opts) if o.name == RECOMPUTE)
               for row, opts in zip(self.x[k], cls.options)]
        dec = [pulp.lpSum(v for v, o in zip(row, opts) if o.name not in (KEEP, RECOMPUTE))
               for row, opts in zip(self.x[k], cls.options)]
        groups = decode_groups(names)
        stages = cls.stages or ((None, cls.grad),)
        links = carries(names, [s.inputs for s in cls.sites]) if cls.stages else []
        for t, (stage, grad) in enumerate(stages):
            here = [i for i in range(len(names)) if stage is None or stage_of(names[i]) in (stage, None)]
            live = {}  # site -> its z at this stage
            for s, j, i in links:
                if s != stage or i in live or not can[i] or not (j in live or can[j]):
                    continue
                z = _variable(self.prob, f"z_{k}_{t}_{i}", "Continuous")
                z.lowBound, z.upBound = 0, 1
                self.prob += z >= rec[i] + (live[j] if j in live else rec[j]) - 1, f"carry_{k}_{t}_{i}"
                live[i] = z
            base = pulp.lpSum([nb[i] * rec[i] for i in here] + [nb[i] * z for i, z in live.items()]) + grad / _MIB
            for g, group in enumerate(groups):
                d = pulp.lpSum(nb[i] * dec[i] for i in group)
                if any(i in here for i in group):
                    self.prob += self.peak >= base + d, f"peak_{k}_{t}_{g}"
                    continue
                # decoded while a rebuild in this stage reads it: big-M on that rebuild
                readers = [(i, rec[i]) for i in here if can[i]] + list(live.items())
                for i, on in readers:
                    if any(names[m] in cls.sites[i].inputs for m in group):
                        self.prob += (self.peak >= base + d - sum(nb[m] for m in group) * (1 - on),
                                      f"peakz_{k}_{t}_{g}_{i}")

    def _sum(self, coef):
        """sum over classes of coef(class, option) per block, times the blocks taking it."""
        pulp = require("pulp", "the activation planner")
        return pulp.lpSum(
            [cls.count * coef(cls, o) * v for k, cls in enumerate(self.classes)
             for row, opts in zip(self.x[k], cls.options) for v, o in zip(row, opts)]
            + [coef(cls, o) * n for k, cls in enumerate(self.classes) for n, o in zip(self.n[k], cls.full)])

    def _objective(self, objective: str) -> None:
        """The primary objective plus a tie-break too small to outweigh any primary step:
        under "time" prefer keep, then less noise; under "variance" prefer keep, then less
        time (so a zero-noise site is kept rather than recomputed when memory allows). A
        whole-block option counts as leaving every site unkept."""
        if objective == "memory":
            self.prob += self.memory
            return
        every = [(c, o) for c in self.classes for o in [o for site in c.options for o in site] + c.full]
        noise_max = max(o.noise for _, o in every) or 1.0
        cost_max = max(o.cost_ms for _, o in every) or 1.0

        def primary(c: _Class, o: _Option) -> float:
            return o.cost_ms if objective == "time" else o.noise / noise_max

        def secondary(c: _Class, o: _Option) -> float:
            other = o.noise / noise_max if objective == "time" else o.cost_ms / cost_max
            unkept = len(c.sites) if o in c.full else (o.name != KEEP)
            return unkept + other

        steps = [primary(c, o) for c, o in every if primary(c, o) > 0]
        total = sum(c.count * max(secondary(c, o) for o in site) for c in self.classes for site in c.options)
        total += sum(c.count * secondary(c, o) for c in self.classes for o in c.full)
        eps = _TIE * (min(steps) if steps else 1.0) / (total + 1.0)
        self.prob += self._sum(lambda c, o: primary(c, o) + eps * secondary(c, o))

    def picks(self) -> tuple[list[list[int]], list[list[int]]]:
        """(per-site option per class, blocks per whole-block option per class)."""
        sites = [[max(range(len(row)), key=lambda o: row[o].varValue or 0.0) for row in xs]
                 for xs in self.x]
        pulp = require("pulp", "the activation planner")
        return sites, [[int(round(pulp.value(n) or 0.0)) for n in ns] for ns in self.n]

    def set_rhs(self, row: str, rhs: float) -> None:
        get = getattr(self.prob, "get_constraint_by_name", None)
        c = get(row) if get else self.prob.constraints[row]
        c.constant = -rhs  # the row reads expr + constant <= 0


def _limits(budget_bytes, static_bytes) -> tuple[int, int]:
    return (_byte_count(budget_bytes, "budget_bytes"), _byte_count(static_bytes, "static_bytes"))


def _check_blocks(blocks) -> tuple[BlockProfile, ...]:
    if isinstance(blocks, BlockProfile):
        blocks = (blocks,)
    try:
        blocks = tuple(blocks)
    except TypeError:
        raise TypeError(f"blocks: expected a sequence of BlockProfile, got {blocks!r}") from None
    if not blocks:
        raise ValueError("blocks: expected at least one BlockProfile, got none")
    for b in blocks:
        if not isinstance(b, BlockProfile):
            raise TypeError(f"blocks: expected BlockProfile items, got {b!r}")
    return blocks


@dataclass
class _Limit:
    """The time `solve_plan` allows, shared by the solver calls of one solve."""

    seconds: float
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.perf_counter() + self.seconds


#: a solution: (per class, the option index per site; per class, the blocks per whole-block option)
Solution = tuple[list[list[int]], list[list[int]]]


def _run(classes, objective, mem_limit, var_limit, limit: _Limit, bounds: Optional[list] = None
         ) -> tuple[Optional[Solution], int, str]:
    """(solution or None, variable count, `_solve`'s status). The answer is verified in
    exact arithmetic (integer bytes; noise within a relative 1e-6): a plan that passed a row
    only within the solver's tolerance is cut away once by moving that row's bound in by
    less than one byte (resp. 1e-6). `bounds`: gets the solver's proven lower bound on the
    objective, where it reports one (HiGHS)."""
    model = _Model(classes, objective, mem_limit, var_limit)
    nvars = len(model.prob.variables())
    for _ in range(2):
        status = _solve(model.prob, limit.deadline)
        if status in ("infeasible", "timeout", "error"):
            return None, nvars, status
        sol = model.picks()
        if bounds is not None:
            bounds.append(_dual_bound(model.prob))
        stored, peak, _ms, noise = _evaluate(classes, *sol)
        over_mem = mem_limit is not None and stored + peak > mem_limit
        over_var = var_limit is not None and noise > var_limit * (1 + _VAR_RTOL)
        if not over_mem and not over_var:
            return sol, nvars, status
        if over_mem:
            model.set_rhs(model.mem_row, (mem_limit - 0.5) / _MIB)
        if over_var and model.var_row is not None:
            model.set_rhs(model.var_row, 1.0 - _VAR_RTOL)
    return None, nvars, "infeasible"


def _split(classes: list[_Class], k: int, whole: int) -> list[_Class]:
    """`classes` with `whole` blocks of class k recomputed whole: class k keeps its other
    blocks (per-site choices only) and a class without sites holds the whole ones, last."""
    cls = classes[k]
    rest = _Class(cls.sites, cls.inflight, cls.count - whole, cls.options, grad=cls.grad, stages=cls.stages,
                  first=cls.first)
    part = _Class((), cls.inflight, whole, [], cls.full, grad=cls.grad, first=cls.first)
    return classes[:k] + [rest] + classes[k + 1:] + [part]


def _unsplit(classes: list[_Class], k: int, sol: Solution) -> Solution:
    """A solution of `_split(classes, k, ...)` as one of `classes`."""
    picks, fulls = [list(p) for p in sol[0][:len(classes)]], [list(f) for f in sol[1][:len(classes)]]
    fulls[k] = list(sol[1][-1])
    return picks, fulls


_GOLDEN = (5 ** 0.5 - 1) / 2


def _mix(classes, objective, mem_limit, var_limit, limit: _Limit, best: Solution) -> Solution:
    """`best` improved by splitting identical layers between whole-block recompute and
    per-site choices: per class of several blocks with whole-block options, the number W of
    whole blocks is searched over [1, count - 1] (the model itself decides 0 or all): the
    least W that fits (bisection: more whole blocks never need more memory), then a golden-
    section search above it, each W an exact solve of `_split`. The best plan by exact
    figures wins, `best` on ties. Relaxed, the best figure is convex in W, so one solve
    beside the model's own W (0 or count) usually settles it; a plan found fits exactly."""
    if objective == "memory":
        return best
    for k, cls in enumerate(classes):
        if cls.count < 2 or not cls.full or not cls.options:
            continue
        found: dict[int, Optional[Solution]] = {}

        def at(whole: int) -> float:
            if whole not in found:
                sol = None
                if time.perf_counter() < limit.deadline:
                    sol, _, _ = _run(_split(classes, k, whole), objective, mem_limit, var_limit, limit)
                found[whole] = None if sol is None else _unsplit(classes, k, sol)
            sol = found[whole]
            return math.inf if sol is None else _score(classes, objective, sol)

        lo, hi = 1, cls.count - 1
        if objective == "time":
            # W whole blocks cost at least W times the cheapest whole-block option
            cheapest = min(o.cost_ms for o in cls.full)
            if cheapest > 0:
                hi = min(hi, math.floor(_score(classes, objective, best) / cheapest))
        if hi < lo:
            continue
        # f(W), the best time with W whole blocks, is convex in W when relaxed: when the
        # model's own answer (W = 0 or count) is no worse than its neighbour, it stands
        taken = sum(best[1][k])
        edge = {0: lo, cls.count: cls.count - 1}.get(taken)
        if edge is not None and edge <= hi and at(edge) >= _score(classes, objective, best):
            continue
        if math.isinf(at(hi)):
            continue
        if math.isinf(at(lo)):
            while hi - lo > 1:  # at(hi) fits, at(lo) does not
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if not math.isinf(at(mid)) else (mid, hi)
            lo = hi
        a, b = lo, hi
        while b - a > 3:
            c, d = b - round(_GOLDEN * (b - a)), a + round(_GOLDEN * (b - a))
            if at(c) <= at(d):
                b = d
            else:
                a = c
        for whole in range(a, b + 1):
            at(whole)
        for whole in sorted(found):
            sol = found[whole]
            if sol is not None and _score(classes, objective, sol) < _score(classes, objective, best):
                best = sol
    return best


def _merged(classes: list[_Class]) -> tuple[list[_Class], list[int]]:
    """Classes that differ only in measured figures (per-layer sensitivities, times that
    differ by their measurement noise) merged into one with the count-weighted mean noise
    and time of every option, and the merged index of every class. A plan of the merged
    problem, given to all its members (`_spread`), has exactly the same bytes, time and
    summed noise in the original one (the means are count-weighted): a feasible answer found
    in a fraction of the time."""
    index: dict[tuple, int] = {}
    merged: list[_Class] = []
    member: list[int] = []

    def bare(opts):
        return [_Option(o.name, o.stored, 0.0, 0.0, o.transient) for o in opts]

    for cls in classes:
        key = (cls.inflight, tuple((s.name, s.inputs, tuple((o.name, o.stored) for o in opts))
                                   for s, opts in zip(cls.sites, cls.options)),
               tuple((o.name, o.stored, o.transient) for o in cls.full), cls.grad, cls.stages, cls.floor,
               cls.input_bytes)
        if key not in index:
            index[key] = len(merged)
            merged.append(_Class(cls.sites, cls.inflight, 0, [bare(opts) for opts in cls.options],
                                 bare(cls.full), cls.grad, cls.stages, input_bytes=cls.input_bytes))
        m = merged[index[key]]
        m.first = m.first or cls.first
        for mine, theirs in zip(m.options + [m.full], cls.options + [cls.full]):
            for o, t in zip(mine, theirs):
                o.noise += cls.count * t.noise
                o.cost_ms += cls.count * t.cost_ms
        m.count += cls.count
        member.append(index[key])
    for m in merged:
        for opts in m.options + [m.full]:
            for o in opts:
                o.noise /= max(m.count, 1)
                o.cost_ms /= max(m.count, 1)
    return merged, member


def _spread(classes: list[_Class], member: list[int], sol: Solution) -> Solution:
    """A merged problem's solution given to its member classes: each takes its merged
    class's per-site choice, and the merged class's whole-block counts go to the members
    whose per-site choice adds the most noise (moving those blocks saves the most), then
    whose whole block costs the least over it, ties to the lower class index."""
    picks = [list(sol[0][m]) for m in member]
    fulls = _no_full(classes)

    def order(k: int, c: int):
        opts = [classes[k].options[i][o] for i, o in enumerate(picks[k])]
        return (-sum(o.noise for o in opts), classes[k].full[c].cost_ms - sum(o.cost_ms for o in opts), k)

    for m, counts in enumerate(sol[1]):
        mine = [k for k, owner in enumerate(member) if owner == m]
        for c, n in enumerate(counts):
            for k in sorted(mine, key=lambda k: order(k, c)):
                take = min(n, classes[k].count - sum(fulls[k]))
                fulls[k][c] += take
                n -= take
    return picks, fulls


def _score(classes, objective: str, sol: Solution) -> float:
    """The objective's own figure of a solution, exact."""
    stored, peak, ms, noise = _evaluate(classes, *sol)
    return {"time": ms, "variance": noise}.get(objective, stored + peak)


def _search(classes, objective, mem_limit, var_limit, limit: _Limit, bounds: Optional[list] = None
            ) -> tuple[Optional[Solution], int, bool]:
    """(solution or None when infeasible, variable count, proven optimal): the full MILP
    within the time limit, and, when classes differ only in noise, the merged MILP first
    as a fallback (taken when the full search found nothing better in time)."""
    merged, member = _merged(classes)
    fallback = None
    if len(merged) < len(classes):
        sol, _, status = _run(merged, objective, mem_limit, var_limit, limit)
        if sol is not None:
            fallback = _spread(classes, member, sol)
            stored, peak, _ms, noise = _evaluate(classes, *fallback)
            if var_limit is not None and noise > var_limit * (1 + _VAR_RTOL):
                fallback = None
    sol, nvars, status = _run(classes, objective, mem_limit, var_limit, limit, bounds)
    if sol is not None:
        sol = _mix(classes, objective, mem_limit, var_limit, limit, sol)
    if status in ("optimal", "infeasible"):  # optimal: over whole classes; the split is searched
        return sol, nvars, status == "optimal"
    if fallback is not None and (sol is None or _score(classes, objective, fallback)
                                 < _score(classes, objective, sol)):
        sol = fallback
    if sol is None and status == "timeout":
        raise SolverError(f"the MILP solver found no plan within time_limit={limit.seconds:g} s "
                          f"({len(classes)} distinct blocks); give solve_plan a larger time_limit")
    if sol is None:
        raise SolverError(f"the MILP solvers ({', '.join(_solver_names())}) ended without deciding "
                          f"the problem ({len(classes)} distinct blocks), also without presolve")
    return sol, nvars, False


def _fast_search(classes, mem_limit, var_limit, limit: _Limit) -> Optional[Solution]:
    """The fast path for many distinct blocks differing only in noise: the merged (uniform)
    MILP solved exactly, then Lagrangian relaxation of both budget rows with exact per-block
    choices (`llm_act.planner.lagrange`) from it, for the blocks the uniform plan does not
    recompute whole (those stay, their bytes, noise and transient held fixed); the better of
    the two by exact figures (ties: the uniform plan). None when the uniform problem has no
    plan (the caller then runs the full search, which decides feasibility)."""
    merged, member = _merged(classes)
    sol, _, status = _run(merged, "time", mem_limit, var_limit, limit)
    if sol is None:
        return None
    sol = _mix(merged, "time", mem_limit, var_limit, limit, sol)
    uniform = _spread(classes, member, sol)
    best = uniform
    picks, fulls = uniform
    part = [k for k, c in enumerate(classes) if not c.floor and c.count > sum(fulls[k])]
    held = [_Class(c.sites, c.inflight, c.count if c.floor else sum(n), c.options, c.full, c.grad, c.stages,
                   c.first, c.input_bytes)
            for c, n in zip(classes, fulls)]
    held_fulls = [list(n) for n in fulls]
    stored, peak, _ms, noise = _evaluate(held, [picks[k] for k in range(len(classes))], held_fulls)
    sub = [_Class(classes[k].sites, classes[k].inflight, classes[k].count - sum(fulls[k]),
                  classes[k].options, grad=classes[k].grad, stages=classes[k].stages) for k in part]
    # Lagrangian relaxation from the uniform plan, its transient bound (the sites the plan
    # keeps stay kept) as is and with its partly decoded groups opened (q kept beside an
    # encoded k, v, out may be encoded too): the best of these by exact figures
    ref = [picks[k] for k in part]
    hint: dict = {}  # the second variant's prices start from the first's
    for open_groups in ((False, True) if sub else ()):
        try:
            lag = lagrange_plan(sub, mem_limit - stored, var_limit - noise if var_limit else var_limit,
                                ref, peak_floor=peak, open_groups=open_groups, hint=hint)
        except Exception as err:  # the fast path never fails a solve: the best plan stands
            log.debug("llm_act: the Lagrangian fast path failed: %r", err)
            break
        if lag is None:
            continue
        trial = [list(p) for p in best[0]]
        for k, row in zip(part, lag):
            trial[k] = list(row)
        cand = (trial, fulls)
        c_stored, c_peak, ms, c_noise = _evaluate(classes, *cand)
        if (c_stored + c_peak <= mem_limit and c_noise <= var_limit * (1 + _VAR_RTOL)
                and ms < _evaluate(classes, *best)[2] * (1 - 1e-12)):
            best = cand
    return best


def _fast_applies(classes, objective, mem_limit, var_limit, fast: Optional[bool]) -> bool:
    if fast is False or objective != "time" or var_limit is None or not var_limit > 0:
        return False
    if fast is None and len(classes) < FAST_MIN_CLASSES:
        return False
    return len(_merged(classes)[0]) == 1


def _floor(classes: list[_Class], owner: list[int], loss_bytes: int, input_bytes: int) -> list[_Class]:
    """The end of forward as a class (none when it holds nothing), the first block's class
    marked (`_Class.first`)."""
    loss_bytes = _byte_count(loss_bytes, "loss_bytes")
    input_bytes = _byte_count(input_bytes, "input_bytes")
    if owner:
        classes[owner[0]].first = True
    return [_Class((), 1, 0, grad=loss_bytes, input_bytes=input_bytes)] if loss_bytes or input_bytes else []


def solve_plan(
    blocks: Sequence[BlockProfile],
    budget_bytes: int,
    static_bytes: int = 0,
    variance_budget: Optional[float] = None,
    objective: str = "time",
    time_limit: float = TIME_LIMIT_S,
    fast: Optional[bool] = None,
    time_resolution: float = 0.0,
    loss_bytes: int = 0,
    input_bytes: int = 0,
) -> Plan:
    """The cheapest plan for one device whose activations fit `budget_bytes - static_bytes`
    (and whose summed noise stays within `variance_budget`, when given).

    objective="time" minimises the added step time; "variance" minimises the summed noise
    under the memory budget (GACT's allocation). Raises InfeasibleBudget when no plan fits
    the memory, InfeasibleVariance when none that fits meets the variance budget.
    `time_limit` (seconds) bounds the search: past it the best plan found is returned with
    `optimal=False` (it still fits both budgets exactly).

    `fast`: None (default) plans many distinct blocks that differ only in noise
    (>= FAST_MIN_CLASSES of them: per-layer sensitivities, objective "time", a noise budget
    > 0) by the fast path, Lagrangian relaxation with exact per-block choices, in a fraction
    of a second and within a fraction of a percent of a long MILP search (`llm-act bench
    planner` measures the gap), with `optimal=False`; True forces that path wherever it
    applies, False the full MILP. Smaller or other problems always get the full MILP.

    `time_resolution`: the relative noise of the measured times (e.g. 0.05). Planned times
    are rounded to a geometric grid of that ratio, so profiles whose times differ by less
    (the same run measured twice) choose the same plan: near-ties go to the lower noise, then
    to a fixed order. The plan's figures use the exact times.

    `loss_bytes`: what the end of forward holds besides the blocks' stored tensors (the
    logits and the loss's bookkeeping, freed before any block backpropagates): the peak is
    the larger of it and the largest block's transient (`BlockProfile.grad_bytes` included),
    one definition for every plan (`evaluate_plan` takes it too). `input_bytes`: the stage's
    input, which the model holds until its forward returns (GPTModel's embedding output):
    added to `loss_bytes` when the first block stores its checkpoint encoded (kept, it is that
    stored tensor); `analytic.input_bytes` gives both for a model shape.
    """
    start = time.perf_counter()
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) \
            or not time_limit > 0 or math.isinf(time_limit):
        raise ValueError(f"time_limit: expected a finite number of seconds > 0, got {time_limit!r}")
    limit = _Limit(float(time_limit))
    blocks = _check_blocks(blocks)
    budget, static = _limits(budget_bytes, static_bytes)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if variance_budget is not None:
        if isinstance(variance_budget, bool) or not isinstance(variance_budget, (int, float)) \
                or not variance_budget >= 0 or math.isinf(variance_budget):
            raise ValueError(
                f"variance_budget: expected a finite number >= 0 or None, got {variance_budget!r}"
            )
        variance_budget = float(variance_budget)
    if isinstance(time_resolution, bool) or not isinstance(time_resolution, (int, float)) \
            or not 0 <= time_resolution < 1:
        raise ValueError(f"time_resolution: expected a fraction in [0, 1), got {time_resolution!r}")
    classes, owner = _classes(blocks, float(time_resolution))
    classes += _floor(classes, owner, loss_bytes, input_bytes)
    mem_limit = budget - static
    undecided: Optional[SolverError] = None
    picks, nvars, optimal, quick = None, 0, True, False
    bounds: list = []
    if mem_limit >= 0 and _fast_applies(classes, objective, mem_limit, variance_budget, fast):
        picks = _fast_search(classes, mem_limit, variance_budget, limit)
        quick = picks is not None
        optimal = not quick
        nvars = sum(len(opts) for c in classes for opts in c.options) + 1 if quick else 0
    try:
        if not quick:
            picks, nvars, optimal = (None, 0, True) if mem_limit < 0 else _search(
                classes, objective, mem_limit, variance_budget, limit, bounds)
    except SolverError as err:  # decided below: a budget under the edge is the user's error
        picks, nvars, optimal, undecided = None, 0, False, err
    if picks is None:
        # the smallest footprint and the least noise are easy problems: their own limit
        least = _search(classes, "memory", None, None, _Limit(limit.seconds))[0]
        min_act = sum(_evaluate(classes, *least)[:2])
        if mem_limit < min_act:
            raise InfeasibleBudget(budget, static, min_act + static)
        if variance_budget is not None:  # the least noise within the memory budget decides
            # (at the very edge of the budget the solver's tolerances may miss the plan the
            # memory search found: that one then stands for the least noise)
            quiet = _search(classes, "variance", mem_limit, None, _Limit(limit.seconds))[0] or least
            least_noise = _evaluate(classes, *quiet)[3]
            if least_noise > variance_budget * (1 + _VAR_RTOL):
                raise InfeasibleVariance(variance_budget, least_noise)
            if undecided is None:
                picks, optimal = quiet, False
        if picks is None and undecided is not None:
            raise undecided
        if picks is None:
            raise SolverError("the MILP solver found no plan although one fits the memory budget")
    plan = _plan(blocks, classes, owner, picks, exact=time_resolution > 0)
    plan.num_variables = nvars
    plan.objective = objective
    plan.optimal = optimal
    if objective == "time" and bounds and bounds[-1] is not None and not quick:
        plan.bound_ms = bounds[-1]
    plan.solve_seconds = time.perf_counter() - start
    if quick:
        log.debug("llm_act: %d distinct blocks planned by the fast path in %.3f s", len(classes),
                  plan.solve_seconds)
    elif not optimal:
        log.warning("llm_act: the planner stopped at time_limit=%g s with a plan that fits but is not "
                    "proven optimal (%d distinct blocks)", limit.seconds, len(classes))
    return plan


def _plan(blocks, classes, owner, sol: Solution, exact: bool = False) -> Plan:
    """The Plan of a solution; a class's whole-block counts go to its blocks in order. Its
    figures are those of `classes`, or of `blocks` themselves (`exact`: the classes hold
    rounded times)."""
    picks, fulls = sol
    left = [list(f) for f in fulls]
    choice, full, block_fulls = [], [], []
    for block, k in zip(blocks, owner):
        cls = classes[k]
        mine: dict[str, int] = {}
        counts = [0] * len(cls.full)
        room = block.count
        for c, opt in enumerate(cls.full):
            take = min(left[k][c], room)
            if take:
                mine[checkpoint_of(opt.name)] = take
                counts[c] = take
                left[k][c] -= take
                room -= take
        per_site = {s.name: cls.options[i][o].name for i, (s, o) in enumerate(zip(cls.sites, picks[k]))}
        if room == 0 and mine:
            per_site = whole_layer(block, min(mine))
        choice.append(per_site)
        full.append(mine)
        block_fulls.append(counts)
    stored, peak, ms, noise = _evaluate(classes, picks, fulls)
    if exact:  # only the times were rounded: bytes and noise are the classes' own
        ms = sum(_exact_ms(b, [classes[k].options[i][o].name for i, o in enumerate(picks[k])], mine)
                 for b, k, mine in zip(blocks, owner, full))
    return Plan(blocks=tuple(blocks), choice=choice, activation_bytes=stored + peak, overhead_ms=ms,
                variance=noise, peak_bytes=peak, full=full)


def evaluate_plan(blocks: Sequence[BlockProfile], choice: Sequence[dict[str, str]],
                  loss_bytes: int = 0, input_bytes: int = 0) -> Plan:
    """The figures of a given choice (e.g. the fixed "keep"/"compress"/"recompute" plans)
    under the same cost model; a site missing from a choice is kept. A choice that
    recomputes every site but the checkpoint is whole-block recompute where the block
    offers it (`BlockProfile.full_ms`), as the layers run it."""
    blocks = _check_blocks(blocks)
    choice = list(choice)
    if len(choice) != len(blocks):
        raise ValueError(f"choice: expected {len(blocks)} entries (one per block), got {len(choice)}")
    classes = []
    for b in blocks:
        options = [_site_options(s) for s in b.sites]
        classes.append(_Class(b.sites, b.inflight, b.count, options, _full_options(b, options), b.grad_bytes,
                              b.stage_bytes))
    floor = _floor(classes, list(range(len(classes))), loss_bytes, input_bytes)
    picks, fulls = [], _no_full(classes)
    for n, (cls, block, ch) in enumerate(zip(classes, blocks, choice)):
        if cls.full and is_whole(ch, block):
            name = full_name(ch.get(CHECKPOINT_SITE, KEEP))
            names = [o.name for o in cls.full]
            if name not in names:
                raise ValueError(f"choice[{n}][{CHECKPOINT_SITE!r}]: {ch.get(CHECKPOINT_SITE)!r} is not "
                                 f"an option for the block input here ({', '.join(names)})")
            fulls[n][names.index(name)] = cls.count
            picks.append([0] * len(cls.sites))
            continue
        unknown = set(ch) - {s.name for s in cls.sites}
        if unknown:
            raise ValueError(f"choice[{n}]: sites {sorted(unknown)} are not in the block")
        pick = []
        for s, opts in zip(cls.sites, cls.options):
            name = ch.get(s.name, KEEP)
            names = [o.name for o in opts]
            if name not in names:
                raise ValueError(
                    f"choice[{n}][{s.name!r}]: {name!r} is not an option here ({', '.join(names)})"
                )
            pick.append(names.index(name))
        blind = blind_input(cls, pick)
        if blind is not None:
            i, j = blind
            raise ValueError(
                f"choice[{n}]: {cls.sites[i].name!r} is recomputed from {cls.sites[j].name!r}, whose "
                f"codec {cls.options[j][pick[j]].name!r} does not keep the value"
            )
        picks.append(pick)
    return _plan(blocks, classes + floor, list(range(len(blocks))),
                 (picks + [[] for _ in floor], fulls + [[] for _ in floor]))
