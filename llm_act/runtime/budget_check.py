"""The budget checks of a run's first iteration: a user budget that cannot work is refused.

One job: refuse, before training goes on, a user-given `ActConfig.budget` that no plan fits
(`BudgetTooSmall`, a ValueError naming the smallest budget that works, on every rank, as
`llm-act plan` refuses it) or that a fixed plan exceeds (`PlanOverBudget`: nothing would
re-plan it to fit). Checked once per run, after its first iteration:

- with a probe (`controller.step(probe=...)`, `set_probe`): a fixed plan is measured on
  the probe's batch (`check_fixed_budget`); plan "auto" is refused at its first tracking
  (`llm_act.runtime.solving`);
- without one (the DeepSpeed and Megatron-LM doors, a plain loop): from the real first step,
  through hooks the controller installs on the model (`FirstForward`): a fixed plan over
  the budget raises `PlanOverBudget`, a budget below the smallest any plan fits (analytic
  profile of the megatron-core layers at the observed shape) `BudgetTooSmall`. A budget that
  check accepted is not refused again at the first tracking (the measured minimum may be a
  little higher).

A budget above the GPU's total memory is warned about. The `Adapter`
(`llm_act.runtime.adapt`) owns a `FirstForward` and calls `check_user_budget`; both take what
they read as arguments (the controller as a `PlanOwner`, the static memory and the pins as
callables, the adapter's once-per-run warning), so this module never imports the adapter.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
from typing import Any, Callable, Optional

import torch

from llm_act.codecs.registry import KEEP, RECOMPUTE
from llm_act.ledger import current_ledger, SavedTensorLedger
from llm_act.measurement.measure import measure_profile
from llm_act.planner.analytic import block_profile, outer_profile
from llm_act.planner.budget import min_budget
from llm_act.planner.milp import InfeasibleBudget
from llm_act.planner.model_shape import DeviceModel, DTYPES, ModelShape
from llm_act.runtime import agreement, memory
from llm_act.runtime.plan_owner import PlanOwner
from llm_act.sites import MODEL_SITES

#: `warn_once(kind, msg, *args)`: log `msg` the first time a warning of `kind` is given in a run
WarnOnce = Callable[..., None]

log = logging.getLogger("llm_act.runtime.controller")  # the adapter speaks as its controller


class BudgetTooSmall(InfeasibleBudget):
    """A user-given activation budget that no plan fits, refused at the first tracking;
    the message names the setting and the smallest budget that works."""

    def __init__(self, budget_bytes: int, static_bytes: int, min_budget_bytes: int):
        super().__init__(budget_bytes, static_bytes, min_budget_bytes)
        gb_up = math.ceil(min_budget_bytes / 1e6) / 1e3  # rounded up to the MB: passing it back works
        self.args = (
            f"the activation budget of {budget_bytes} bytes ({budget_bytes / 1e9:.3f} GB) is "
            f"too small: with {static_bytes} bytes ({static_bytes / 2**30:.3f} GiB) of static memory "
            f"(parameters, gradients, optimizer state, tensors no site owns) the smallest budget any plan fits is "
            f"{min_budget_bytes} bytes = {min_budget_bytes / 1e9:.3f} GB = {min_budget_bytes / 2**30:.3f} GiB; "
            f"raise --act-compress-budget (the 'budget' key of the DeepSpeed 'activation_compression' "
            f"section, ActConfig.budget) to at least {gb_up:.3f}GB, or leave it unset",)


class PlanOverBudget(ValueError):
    """A fixed plan (not "auto") that holds more than the user-given budget, refused at the
    first iteration: nothing would re-plan it to fit."""

    def __init__(self, plan: str, budget_bytes: int, needed_bytes: int):
        self.budget_bytes, self.needed_bytes = budget_bytes, needed_bytes
        gb_up = math.ceil(needed_bytes / 1e6) / 1e3
        super().__init__(
            f"plan {plan!r} holds at least {needed_bytes} bytes ({needed_bytes / 1e9:.3f} GB, static "
            f"memory included), more than the activation budget of {budget_bytes} bytes "
            f"({budget_bytes / 1e9:.3f} GB): raise --act-compress-budget (ActConfig.budget) to at least "
            f"{gb_up:.3f}GB, or use plan 'auto', which chooses per site to fit the budget")


# ---- with a probe ---------------------------------------------------------------------------
def check_user_budget(c: PlanOwner, first: "FirstForward", probe: Optional[Callable[[], Any]],
                      static_bytes: Callable[[], int], warn_once: WarnOnce) -> None:
    """After the first iteration of a run, a user-given budget: a warning when it is more
    than the GPU's total memory; without a probe the first step's check (`first`), with one
    for a fixed plan `check_fixed_budget`."""
    budget = c.config.budget
    if not c.enabled or budget is None:
        return
    total = memory.device_memory_bytes()
    if total is not None and budget > total:
        log.warning("llm_act: the activation budget of %.3f GB (--act-compress-budget) is more than the "
                    "%.3f GB this GPU has; a plan made for it may run out of memory", budget / 1e9, total / 1e9)
    if probe is None:
        first.check_at_boundary()
    elif c.config.plan != "auto":
        check_fixed_budget(c, probe, static_bytes, warn_once)


def check_fixed_budget(c: PlanOwner, probe: Optional[Callable[[], Any]], static_bytes: Callable[[], int],
                       warn_once: WarnOnce) -> None:
    """Once, after the first iteration of a run: a fixed plan with a user budget is
    measured on this batch (no codec timing) and refused with `PlanOverBudget` when its
    static memory + stored bytes + backward transient (the planner's peak for "auto":
    `MeasuredProfile.transient_bytes`) exceed the budget. The measurement runs the
    memory-efficient attention, so for a plan on stock attention it is a lower bound:
    what it refuses surely does not fit."""
    cfg = c.config
    if probe is None:
        warn_once("no_probe_budget", "llm_act: the budget of plan %r is not checked without a "
                  "probe (pass controller.step(probe=fn) or controller.set_probe(fn))", cfg.plan)
        return
    names = {n for choice in c.plan.values() for n in choice.values()} - {KEEP, RECOMPUTE}
    g = agreement.groups()
    profile = agreement.agree_profile(measure_profile(c, probe, times_from={}, codecs=sorted(names)), g)
    # stored (all micro-batches in flight) + the backward transient, as "auto" counts it
    need = static_bytes() + profile.other_bytes + memory.inflight() * profile.predicted_bytes(
        c.plan, include_other=False) + profile.transient_bytes(c.plan)
    need = int(agreement.reduce_dict({"n": need}, "max", g.stage if g else None)["n"])
    if need > cfg.budget:
        raise PlanOverBudget(cfg.plan, int(cfg.budget), need)


# ---- without a probe: the first forward -----------------------------------------------------
def _outer_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (opening the ledger's would shadow them)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except Exception:  # an API of torch's internals: when it is gone, assume none
        return False


def _counting(ledger: Any) -> bool:
    """Whether an active ledger still counts live (no backward event froze it yet)."""
    return bool(getattr(ledger, "_active", False)) and getattr(ledger, "_snapshot", None) is None


class FirstForward:
    """The budget check of the doors that give no probe (DeepSpeed's `initialize`,
    Megatron-LM's `pretrain()` around `apply`, a plain PyTorch loop), measured on the real
    first training step through hooks the controller installs itself (`Controller.watch`).

    A forward pre-hook on each root module opens a `SavedTensorLedger` for the first forward
    of that root (only with a user budget and no probe) and a forward hook closes it, so the
    ledger holds what the plan in force stores for backward (compressed layers report their
    encoded bytes), per (layer, site). Where the loop has a ledger of its own open around the
    forward (our trainer measures its first iteration), ours would hide the tensors from it
    (only the innermost saved-tensor hooks fire), so the forward's share is read off that
    ledger as the difference of its live table; under other saved-tensor hooks (CPU offload)
    the forward is not measured and the next one is. A pre-hook on the first controlled
    megatron-core `TransformerLayer` records the [s, b, h] input it sees. Once every root has
    run one measured forward the hooks are removed: nothing runs on later steps.

    With a user budget (`ActConfig.budget`) and no probe, the check runs at the first step
    boundary (`engine.step()`, an attached optimizer's step, the exit of `controller.step()`)
    when something advances the controller, else at the end of the first forward (the
    Megatron-LM door, where nothing may ever advance it):

    - a fixed plan: static memory + the bytes outside the controlled layers + the layers'
      bytes x the micro-batches in flight, against the budget: `PlanOverBudget`;
    - plan "auto" on megatron-core layers: the smallest budget any plan fits, from the
      analytic profile (`llm_act.planner.analytic.block_profile`) of the layers'
      `TransformerConfig` at the observed s, b and dtype, with the same static memory and the
      measured bytes outside the layers: `BudgetTooSmall` below it. ("auto" cannot re-plan
      without a probe yet, so a budget above that edge but below what the plan in force
      holds is warned about once.)
    - plan "auto" on the generic path (no analytic model): an info line; the first tracking
      point, which follows at once, measures the blocks and refuses a budget no plan fits;
    - plan "auto" on megatron-core layers without an analytic model: a one-time warning that
      the smallest budget is not known, with what the plan in force holds.

    The figures are reduced (max, `llm_act.runtime.agreement`, with its timeouts) over every rank at a
    step boundary, so every rank of the job decides the same and raises together; inside the
    first forward (no boundary) over the ranks of this pipeline stage only (a world-wide
    collective there would wait for later stages that wait for this one), so under pipeline
    parallelism in that door the stage over budget stops and the launcher ends the others.
    On a GPU the static memory inside the first forward is what was allocated before it (no
    optimizer state yet): the refusal is then a lower bound.
    """

    def __init__(self, controller: PlanOwner, pins: Callable[[], dict[str, str]],
                 static_bytes: Callable[[], int], warn_once: WarnOnce):
        self.controller = controller
        self.pins = pins
        """the sites the user fixed (`ActConfig.codecs`): their bytes count as static"""
        self.static_bytes = static_bytes
        """memory that is not activations, now"""
        self.warn_once = warn_once
        self.handles: list[Any] = []
        self.roots: list[Any] = []
        self.layers: list[Any] = []
        self.by_site: dict[tuple[Optional[int], str], int] = {}
        self.measured_roots: set[int] = set()
        self.shape: Optional[tuple[int, ...]] = None
        self.dtype: Optional[torch.dtype] = None
        self.static_before: Optional[int] = None
        self.measured = False
        self.checked = False
        self.boundary_seen = False
        self.result: Optional[dict[str, Any]] = None
        """what the check found: need, static, min (for tests and logs)"""
        self._ledgers: dict[int, Any] = {}

    # ---- hooks ---------------------------------------------------------------------------
    def install(self, roots: list[Any], layers: Optional[list[Any]] = None) -> None:
        if self.handles or self.measured:
            return  # already watching (apply inside initialize) or done
        self.roots = [r for r in roots if isinstance(r, torch.nn.Module)]
        self.layers = list(layers or [])
        for root in self.roots:
            self.handles.append(root.register_forward_pre_hook(self._pre))
            self.handles.append(root.register_forward_hook(self._post, always_call=True))
        if self.layers:
            first = min(self.layers, key=lambda m: int(getattr(m, "layer_number", 0)))
            self.handles.append(first.register_forward_pre_hook(self._layer_pre, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module: Any, args: Any) -> None:
        key = id(module)
        if key in self.measured_roots or key in self._ledgers or not torch.is_grad_enabled():
            return
        c = self.controller
        if c.config.budget is None or c.probe_given:
            self.remove()  # nothing to check here (no budget, or the probe path checks it)
            return
        outer = current_ledger()
        if outer is None and _outer_saved_tensor_hooks():
            return  # saved-tensor hooks of the user's (CPU offload...): ours would hide them
        if outer is not None and not _counting(outer):
            return  # a ledger frozen by a backward: this forward cannot be told apart; the next one
        if self.static_before is None and torch.cuda.is_available():
            self.static_before = int(torch.cuda.memory_allocated())
        if outer is not None:
            # the loop counts this forward already (our trainer's ledger): opening ours would
            # hide the tensors from it, so this forward's share is read off it as a difference
            self._ledgers[key] = (outer, outer.by_site())
            return
        ledger = SavedTensorLedger()
        ledger.__enter__()
        self._ledgers[key] = ledger

    def _layer_pre(self, module: Any, args: Any, kwargs: Any = None) -> None:
        if self.shape is not None:
            return
        # torch calls a kwargs hook without kwargs when hooks are removed mid-iteration
        # (the root module is the first layer itself)
        x = args[0] if args else (kwargs or {}).get("hidden_states")
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            self.shape, self.dtype = tuple(int(n) for n in x.shape), x.dtype

    def _post(self, module: Any, args: Any, output: Any) -> None:
        ledger = self._ledgers.pop(id(module), None)
        if ledger is None:
            return
        if isinstance(ledger, tuple):
            outer, before = ledger
            if sys.exc_info()[0] is not None or not _counting(outer):
                return  # failed, or the outer ledger froze inside this forward: the next one
            table = {k: n - before.get(k, 0) for k, n in outer.by_site().items()}
        else:
            ledger.__exit__(None, None, None)
            if sys.exc_info()[0] is not None:
                return  # the forward itself failed: nothing measured
            table = ledger.by_site()
        for key, n in table.items():
            if n > 0:
                self.by_site[key] = self.by_site.get(key, 0) + int(n)
        self.measured_roots.add(id(module))
        if len(self.measured_roots) < len(self.roots):
            return
        self.measured = True
        self.remove()
        c = self.controller
        if self.checked:
            return  # the boundary check ran before this rank measured
        if c.probe_given:
            return  # the probe path checks (check_user_budget)
        if (c.boundary is not None or c.in_step) and not self.boundary_seen:
            return  # checked at the step boundary, where the static memory is complete
        self.check(self._static_now())

    # ---- the check -----------------------------------------------------------------------
    def _static_now(self) -> int:
        """Static memory (`static_bytes`); on a GPU before the first forward where no
        boundary was seen: what was allocated then (no optimizer state yet)."""
        if torch.cuda.is_available() and self.static_before is not None and not self.boundary_seen:
            return self.static_before
        return self.static_bytes()

    def check_at_boundary(self) -> None:
        """The first step boundary without a probe (see the class docstring)."""
        self.boundary_seen = True
        if not self.checked:
            # every rank joins, measured or not, so none waits for another
            self.check(self._static_now())

    def check(self, static: int) -> None:
        c = self.controller
        cfg = c.config
        self.checked = True
        self.remove()
        if not c.enabled or cfg.budget is None:
            return
        budget = int(cfg.budget)
        layers = set(c.layers)
        values: dict[str, float] = {}
        why = ""
        if self.measured:
            inner = sum(n for (layer, _), n in self.by_site.items() if layer in layers)
            outer = sum(n for (layer, _), n in self.by_site.items() if layer not in layers)
            inflight = memory.inflight()
            values = {"need": static + outer + inflight * inner, "static": static + outer}
            if cfg.plan == "auto":
                minimum, why = self.min_budget(static + outer, inflight)
                if minimum is not None:
                    values["min"] = minimum
        # at a step boundary every rank of the job is between iterations: reduce over all of
        # them (pipeline stages included: the budget is per device, the figure the largest
        # stage's), so every rank stops together; inside a forward (no boundary) only over
        # this stage's ranks, which run it in step (the next stage still waits for this one)
        g = agreement.groups()
        r = agreement.reduce_dict(values, "max", None if self.boundary_seen or g is None else g.stage)
        if "need" not in r:
            self.warn_once("first_unmeasured", "llm_act: the activation budget of %d bytes is not checked: "
                           "the first step's forward was not measured (it ran under another ledger or "
                           "saved-tensor hooks, or outside the model's own forward)", budget)
            return
        need, static_all = int(r["need"]), int(r["static"])
        minimum = int(r["min"]) if "min" in r else None
        self.result = {"need": need, "static": static_all, "min": minimum, "budget": budget}
        if cfg.plan != "auto":
            if need > budget:
                raise PlanOverBudget(cfg.plan, budget, need)
            log.info("llm_act: plan %r holds %d bytes (%.3f GB, static memory included) on the first "
                     "step, within the activation budget of %d bytes", cfg.plan, need, need / 1e9, budget)
            return
        if minimum is not None:
            if budget < minimum:
                raise BudgetTooSmall(budget, static_all, minimum)
            if need > budget:
                log.info("llm_act: plan 'auto' fits the activation budget of %d bytes (the smallest is %d "
                         "bytes); the plan in force holds %d bytes (static memory included) and is "
                         "re-planned at the first tracking point", budget, minimum, need)
            return
        if not self.layers:
            # the generic path: no analytic model, but the first tracking point (this
            # iteration) measures the blocks and refuses a budget no plan fits (`solving.solve`)
            log.info("llm_act: plan 'auto': the activation budget of %d bytes is checked against the "
                     "measured profile at the first tracking point; the plan in force holds %d bytes "
                     "(static memory included) on the first step", budget, need)
            return
        self.warn_once("auto_unchecked", "llm_act: plan 'auto': the smallest activation budget any plan "
                       "fits is not known here (%s), so the budget of %d bytes is not checked against it; "
                       "the plan in force holds %d bytes (%.3f GB, static memory included) on the first "
                       "step%s", why, budget, need, need / 1e9,
                       " -- more than the budget" if need > budget else "")

    def model_shape(self, layer: int, count: int) -> ModelShape:
        """The analytic `ModelShape` of `count` layers like `layer` at the observed input, from
        the layer's binder (`LayerBinder.model_shape`: the megatron integration reads its
        TransformerConfig); ValueError where the layer has no analytic model."""
        s_local, b, _ = self.shape
        dtype = next((k for k, v in DTYPES.items() if v == self.dtype), None)
        if dtype is None:
            raise ValueError(f"activations in {self.dtype}")
        rope = any(getattr(m, "position_embedding_type", None) == "rope"
                   for root in self.roots for m in root.modules())
        binder = self.controller.binder(layer)
        shape = None if binder is None else binder.model_shape(
            count=count, seq_length=s_local, micro_batch=b, dtype=dtype,
            position_embedding="rope" if rope else "learned_absolute", attention=self.controller.config.attention)
        if shape is None:
            raise ValueError(f"layer {layer} has no analytic model")
        return shape

    def min_budget(self, static: int, inflight: int) -> tuple[Optional[int], str]:
        """(the smallest budget any plan fits, static included; or None, why not)."""
        if not self.layers:
            return None, "the model has no megatron-core layers, and the generic path has no analytic model"
        if self.shape is None:
            return None, "the first layer's input was not seen"
        device = DeviceModel() if torch.cuda.is_available() else DeviceModel.cpu()
        pins = self.pins()
        controlled = set(self.controller.layers)
        counts: dict[int, list] = {}  # layers built from one config: [one of their indices, count]
        for layer in self.layers:
            index = int(layer.layer_number) - 1
            if index in controlled:
                counts.setdefault(id(layer.config), [index, 0])[1] += 1
        blocks, pinned = [], 0
        try:
            min_bits = self.controller.config.min_bits  # what plan "auto" may choose
            profiles = [block_profile(self.model_shape(index, count), device, count=count,
                                      inflight=inflight).with_min_bits(min_bits)
                        for index, count in counts.values()]
            # the final norm's input, when this stage drives it (a site of the last layer's plan)
            last = max(controlled)
            if any(site in MODEL_SITES for site in self.controller.sites(last)):
                outer = outer_profile(self.model_shape(last, 1), device, inflight=inflight)  # (on
                # the last stage: one micro-batch in flight)
                if outer is not None:
                    profiles.append(outer.with_min_bits(min_bits))
            for block in profiles:
                sites = []
                for st in block.sites:
                    if st.name in pins:
                        name = pins[st.name]
                        stored = st.nbytes if name == KEEP else 0 if name == RECOMPUTE else next(
                            (o.nbytes for o in st.codecs if o.name == name), st.nbytes)
                        pinned += block.count * inflight * stored
                        continue
                    sites.append(dataclasses.replace(st, inputs=tuple(i for i in st.inputs if i not in pins)))
                blocks.append(dataclasses.replace(block, sites=tuple(sites)))
            return int(min_budget(blocks, static + pinned, self.controller.config.variance_budget)), ""
        except ValueError as err:
            return None, f"no analytic model for these layers: {err}"
