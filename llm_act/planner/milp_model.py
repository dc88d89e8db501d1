"""The MILP itself (Adacc sec. 3.3, extended with codecs per site, a transient peak and
GACT's variance budget, sec. 4), and the solvers that decide it.

One job: build the model over the classes of `llm_act.planner.classes` (`_Model`), solve it
within the time a `solve_plan` allows (`TimeLimit`), and return a verified answer (`solve_verified`).

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
"""
from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from llm_act._imports import require
from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.planner.classes import BlockClass, Solution, checkpoint_of, counts_out_early, evaluate_choice
from llm_act.planner.transient import carries, decode_groups, stage_of
from llm_act.sites import CHECKPOINT_SITE

log = logging.getLogger(__name__)

_MIB = float(2**20)
_TIE = 1e-6  # the tie-break term never weighs more than this fraction of a primary step
VAR_RTOL = 1e-6  # relative tolerance of the variance budget


class SolverError(RuntimeError):
    """The MILP solvers could not decide a problem (neither a plan nor a proof that none
    exists). Not the user's doing: the adaptive planner keeps the plan in force."""


@functools.lru_cache(maxsize=1)
def solver_names() -> tuple[str, ...]:
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
#: options of every try: HiGHS 1.16's RINS heuristic can spin in the presolve of its sub-MIP
#: (`HPresolve::strengthenInequalities`), which no time limit interrupts: a 24-block search
#: with an 8 s limit ran for 16 minutes and more (tests/planner/test_depth.py), and a tracking
#: point would stall training the same way. Without RINS it ends within its limit.
_BASE_OPTIONS = {"HiGHS": {"mip_heuristic_run_rins": False}}


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
    for name in solver_names():
        base = _BASE_OPTIONS.get(name, {})
        for options in (base, {**base, **_RETRY_OPTIONS.get(name, {})}):
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
    per-site ones are searched around this model (`mixed_whole_blocks`): inside it, the product of a
    count and a choice made it 10-100x slower to solve."""

    def __init__(self, classes: list[BlockClass], objective: str,
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
        early_freed = counts_out_early(classes)
        # what the sites after the blocks store is freed before any block backpropagates: a
        # block's transient is held against peak + that (`classes.counts_out_early`, `evaluate_choice`)
        early = pulp.lpSum([cls.inflight * cls.count * o.stored / _MIB * v
                            for k, cls in enumerate(classes) if cls.freed_first and early_freed
                            for row, opts in zip(self.x[k], cls.options) for v, o in zip(row, opts)])
        encodes = []  # indicators: a first class stores its checkpoint encoded
        for k, cls in enumerate(classes):
            grad = cls.grad / _MIB
            if cls.floor:
                continue
            peak = self.peak if cls.freed_first else self.peak + early
            if cls.options:
                self._site_peak(k, cls, peak)
                names = [s.name for s in cls.sites]
                if cls.first and CHECKPOINT_SITE in names:
                    i = names.index(CHECKPOINT_SITE)
                    encodes += [v for v, o in zip(self.x[k][i], cls.options[i]) if o.name != KEEP]
            for c, (w, opt) in enumerate(zip(self.w[k], cls.full)):
                used = w
                if not cls.options:  # some of the given whole blocks take option c
                    used = _variable(self.prob, f"f_{k}_{c}", "Binary")
                    self.prob += w <= cls.count * used, f"fused_{k}_{c}"
                self.prob += peak >= (opt.transient / _MIB + grad) * used, f"fpeak_{k}_{c}"
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

    def _site_peak(self, k: int, cls: BlockClass, peak: Any) -> None:
        """`peak` >= class k's per-site transient (`transient.transient_bound`): per backward
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
            # the rebuilds of this stage, each with its indicator
            readers = [(i, rec[i]) for i in here if can[i]] + list(live.items())
            for g, group in enumerate(groups):
                d = pulp.lpSum(nb[i] * dec[i] for i in group)
                if any(i in here for i in group):
                    self.prob += peak >= base + d, f"peak_{k}_{t}_{g}"
                    continue
                # decoded while a rebuild in this stage reads it: big-M on that rebuild
                for i, on in readers:
                    if any(names[m] in cls.sites[i].inputs for m in group):
                        self.prob += (peak >= base + d - sum(nb[m] for m in group) * (1 - on),
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

        def primary(c: BlockClass, o: ChoiceOption) -> float:
            return o.cost_ms if objective == "time" else o.noise / noise_max

        def secondary(c: BlockClass, o: ChoiceOption) -> float:
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


@dataclass
class TimeLimit:
    """The time `solve_plan` allows, shared by the solver calls of one solve."""

    seconds: float
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.perf_counter() + self.seconds


def solve_verified(classes, objective, mem_limit, var_limit, limit: TimeLimit, bounds: Optional[list] = None
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
        stored, peak, _ms, noise = evaluate_choice(classes, *sol)
        over_mem = mem_limit is not None and stored + peak > mem_limit
        over_var = var_limit is not None and noise > var_limit * (1 + VAR_RTOL)
        if not over_mem and not over_var:
            return sol, nvars, status
        if over_mem:
            model.set_rhs(model.mem_row, (mem_limit - 0.5) / _MIB)
        if over_var and model.var_row is not None:
            model.set_rhs(model.var_row, 1.0 - VAR_RTOL)
    return None, nvars, "infeasible"
