"""`Controller`: owns the plan and the codecs, and switches plans only between iterations.

The compressed modules (the `ActModule` protocol) each hold a site -> codec table; the
Controller fills those tables from its plan. It builds every codec itself (one instance per
layer, site and codec name, seeded from `ActConfig.seed`, the layer and the site) and hands
the same instance to the module, so each codec's random stream lives in exactly one place
and `state_dict()` captures it. A plan asked for with `set_plan` is applied at the next
step boundary (entering or leaving `with controller.step():`, or after `optimizer.step()`
when `attach_optimizer` was used), never in the middle of an iteration: a forward and its
backward always see the same codecs.

A megatron-core layer converted by `apply` binds its whole choice at once through its
`LayerRecompute` (the "recompute" choices: regions, hooks, regenerated masks), and its
core attention runs in the mode `attention_mode()` names ("auto": stock under a plan that
keeps everything, memory-efficient otherwise).

Under plan "auto" the Controller re-plans during training (`llm_act.runtime.adapt`): at tracking
iterations 1, 2, 4, ... (up to `adapt_interval_max` apart, back to 1 after a sharp shift in
the statistics) it measures the sites on the current batch, reduces the statistics over
the ranks, solves the MILP on one rank, broadcasts the plan and switches at that step
boundary on every rank. It measures from the training step itself: `watch(model)` (called
by `apply` and by the DeepSpeed door) installs hooks that record the forward of a tracking
iteration and the gradient its backward sends into the output (`llm_act.measurement.replay`); a probe
(`with controller.step(probe=fn)`, `set_probe(fn)`) may be given instead. The same hooks
measure the first forward with the ledger for the budget check (`budget_check.FirstForward`), and
where nothing else advances the controller, any torch `optimizer.step()` after a training
forward of the watched model is the step boundary: no loop needs a call of ours.

The codecs' seeds are computed in `llm_act.runtime.seeds`, and the controller's checkpoint
(`state_dict`, `load_state_dict`) in `llm_act.runtime.controller_state`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from llm_act.codecs.base import Codec
from llm_act.codecs.registry import KEEP, MLP_FEWBIT, MLP_VALUE, RECOMPUTE, accepts, make_codec, refusal
from llm_act.config import ActConfig
from llm_act.layer_contract import LayerBinder, binder_of
from llm_act.measurement.probing import params_of
from llm_act.plan import (LayerPlans, PlanLike, describe as describe_plan, is_keep, keep_layer, plan_from, resolve,
                          spans)
from llm_act.runtime import agreement, controller_state
from llm_act.runtime.controller_state import ControllerSnapshot
from llm_act.runtime.adapt import Adapter
from llm_act.runtime.logs import default_handler, speaks_for_stage
from llm_act.runtime.seeds import codec_seed
from llm_act.sites import ATTN_Q, DEFAULT_CODECS, MLP_ACT_INPUT, SITES

log = logging.getLogger(__name__)

#: `Controller.boundary` where any torch optimizer's step advances it (`watch`)
ANY_OPTIMIZER = "optimizer.step() (any torch optimizer after a training forward)"


def _sequence_parallel(modules) -> bool:
    """Whether a layer's modules run under megatron's sequence parallelism: the
    `TransformerConfig.sequence_parallel` they carry (`module.config`), or the flag
    megatron's parallel linears keep (`module.sequence_parallel`). It is one setting of
    the whole model, so every TP rank reads the same."""
    for module in modules:
        if getattr(getattr(module, "config", None), "sequence_parallel", False) is True:
            return True
        if getattr(module, "sequence_parallel", False) is True:
            return True
    return False


#: the controllers that take any torch optimizer's step as their boundary (`Controller.watch`),
#: in the order they started watching, held weakly
_WATCHERS: list = []
_ANY_OPTIMIZER_HOOK: Any = None


def _any_optimizer_stepped(*_args: Any, **_kwargs: Any) -> None:
    """The one global optimizer-step hook of this process: tells every live watcher. It is
    registered once and never removed, because torch iterates its hook dict while calling
    the hooks, and a hook removed then (a controller collected by a garbage collection inside
    a hook) ends that `optimizer.step()` with "OrderedDict mutated during iteration"."""
    global _WATCHERS
    live = [c for c in (ref() for ref in _WATCHERS) if c is not None]
    if len(live) != len(_WATCHERS):
        _WATCHERS = [ref for ref in _WATCHERS if ref() is not None]
    for controller in live:
        controller._any_optimizer_stepped()


def _watch_any_optimizer(controller: "Controller") -> Any:
    """Add `controller` to the watchers of the global hook (registered on first use); the
    weak reference it is held by (a collected controller drops out by itself)."""
    import weakref

    from torch.optim.optimizer import register_optimizer_step_post_hook

    global _ANY_OPTIMIZER_HOOK
    if _ANY_OPTIMIZER_HOOK is None:
        _ANY_OPTIMIZER_HOOK = register_optimizer_step_post_hook(_any_optimizer_stepped)
    ref = weakref.ref(controller)
    _WATCHERS.append(ref)
    return ref


class Controller:
    """Holds the current per-layer plan and the codec instances; see the module docstring.

    `modules` maps a global 0-based layer index to {site: the module that stores it}
    (what `swap.convert_layer` returns); `num_layers` is the model's total layer count
    (JSON plans cover all layers, also on a pipeline stage that holds a few). A Controller
    with no modules (config.enabled False) does nothing but count iterations.
    """

    def __init__(
        self,
        config: Optional[ActConfig] = None,
        modules: Optional[Mapping[int, Mapping[str, Any]]] = None,
        num_layers: Optional[int] = None,
    ):
        if config is None:
            config = ActConfig()
        if not isinstance(config, ActConfig):
            raise TypeError(f"config: expected an llm_act.ActConfig, got {type(config).__name__}")
        self.config = config
        self._modules: dict[int, dict[str, Any]] = {
            int(i): dict(sites) for i, sites in (modules or {}).items()
        }
        for i, sites in self._modules.items():
            for site in sites:
                if site not in SITES:
                    raise ValueError(f"modules[{i}]: unknown site {site!r}")
        if num_layers is None:
            num_layers = max(self._modules, default=-1) + 1
        self.num_layers = int(num_layers)
        self._codecs: dict[tuple[int, str, str], Codec] = {}
        self._plan: LayerPlans = {}
        self._pending: Optional[LayerPlans] = None
        self._in_step = False
        self._hooks: list[Any] = []
        self.iteration = 0
        #: global layer index -> its TransformerLayer (`patches.megatron.apply` fills it; empty on
        #: the generic path)
        self.layer_modules: dict[int, Any] = {}
        self._probe: Optional[Callable[[], Any]] = None
        self._step_probe: Optional[Callable[[], Any]] = None
        self._probe_params: Any = None
        #: what advances this controller besides `step()`: "optimizer.step()" after
        #: `attach_optimizer`, "engine.step()" in the DeepSpeed door; None: nothing known
        self.boundary: Optional[str] = None
        self._any_optimizer: Any = None  # the global optimizer-step hook of `watch`
        #: the output layer and loss of a megatron-core GPTModel, stock or chunked
        #: (`llm_act.runtime.output_choice.OutputSwitch`; `patches.megatron.apply` sets it where
        #: `ActConfig.output_loss` asks for the chunked loss or lets the planner choose), else None
        self.output: Any = None
        self._pending_output: Optional[str] = None
        #: what the loss's backward holds on top of every stored byte, where the door knows it
        #: (the generic door: `patches.deepspeed.generic`, a Hugging Face model's logits); 0:
        #: not priced (megatron-core's measured path prices its output layer by `output`)
        self.loss_event_bytes = 0
        #: the door prices the backward: each measured block's gradients in flight, and what the
        #: forward saves after the blocks as the loss's (`MeasuredProfile.backward_priced`; the
        #: generic door, whose blocks backpropagate through plain autograd); False on
        #: megatron-core's measured path, whose fused kernels' backward is not measured
        self.backward_priced = False

        self.adapter = Adapter(self)
        if self.enabled:
            self._apply(resolve(config, self.num_layers, self._modules, self.no_fewbit_layers()))

    # ---- what it controls ---------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """False when there is nothing to control (disabled config or no compressed layer)."""
        return self.config.enabled and bool(self._modules)

    @property
    def layers(self) -> tuple[int, ...]:
        """The global layer indices this controller drives (this pipeline stage's)."""
        return tuple(sorted(self._modules))

    @property
    def plan(self) -> LayerPlans:
        """The plan in force now, {layer: {site: choice}} (a copy)."""
        return {i: dict(c) for i, c in self._plan.items()}

    @property
    def pending_plan(self) -> Optional[LayerPlans]:
        """A plan asked for with `set_plan` that waits for the next step boundary."""
        return None if self._pending is None else {i: dict(c) for i, c in self._pending.items()}

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every plan change: {iteration, changes, predicted_bytes, overhead_ms, reason}."""
        return self.adapter.history

    def sites(self, layer: int) -> tuple[str, ...]:
        """The sites of `layer` that compressed modules store, in `SITES` order (the
        planner chooses for every one of them)."""
        stored = self._modules.get(layer, {})
        return tuple(s for s in SITES if s in stored)

    def all_modules(self) -> list[Any]:
        """Every module the controller drives, each once."""
        seen, out = set(), []
        for stored in self._modules.values():
            for m in stored.values():
                if id(m) not in seen:
                    seen.add(id(m))
                    out.append(m)
        return out

    def reinstall(self) -> None:
        """Hand every module its codec of the plan in force again (after probe passes)."""
        if self.enabled:
            self._apply(self._plan)

    def describe(self, plan: LayerPlans) -> str:
        """`llm_act.plan.describe` of `plan` over the sites the layers really store."""
        return describe_plan({layer: {s: n for s, n in choice.items() if s in self._modules.get(layer, {})}
                              for layer, choice in plan.items()})

    def module(self, layer: int, site: str) -> Any:
        """The module that stores `site` of `layer` (KeyError if none)."""
        return self._modules[layer][site]

    def codec(self, layer: int, site: str) -> Optional[Codec]:
        """The codec in force at (layer, site), None when kept or recomputed, or when the layer
        does not store the site (the final norm's input of a layer before the last)."""
        name = self._plan.get(layer, {}).get(site, KEEP)
        if name in (KEEP, RECOMPUTE) or site not in self._modules.get(layer, {}):
            return None
        return self._codecs[(layer, site, name)]

    def nonfinite_overflow(self) -> int:
        """Non-finite values (NaN, +-Inf) that did not fit the side lists of this controller's
        codecs since they were built, and so decoded to NaN (an Inf lost its sign; nothing
        became finite): summed on each device, one transfer per device. A sync: the adapter
        reads it at tracking and report points only, and the run's summary at its end."""
        per_device: dict[torch.device, list[torch.Tensor]] = {}
        for codec in self._codecs.values():
            for counter in codec.overflow_counters():
                per_device.setdefault(counter.device, []).append(counter)
        return sum(int(torch.stack(counters).sum()) for counters in per_device.values())

    # ---- switching plans -----------------------------------------------------------------
    def set_plan(self, plan: PlanLike) -> None:
        """Ask for `plan` ("keep", "compress", "auto", a JSON plan path or dict, a list of
        per-layer choices, or {layer: {site: choice}}); it is validated now and applied at the
        next step boundary -- or at once while nothing drives iterations yet (no step() run,
        no optimizer attached), since no iteration can then be in flight. `ActConfig.codecs`
        overrides are not re-applied: the plan is taken as given.

        Collective under torch.distributed: every rank of this pipeline stage (its TP and DP
        ranks) must call it with the same plan, since mismatched plans hang the collectives
        inside recomputation; a difference raises `agreement.Disagreement` on every rank,
        naming it, and a rank that never calls it ends the others' wait after
        `LLM_ACT_COLLECTIVE_TIMEOUT` seconds (`agreement.CollectiveError`)."""
        if not self.enabled:
            return

        wanted = plan_from(plan, self.num_layers, self._modules, self.no_fewbit_layers())
        self.check_accepted(wanted)
        agreement.agree_plan(wanted, agreement.groups())
        self._pending = wanted
        if not self._in_step and not self._driven:
            # nobody drives iterations yet: there is no iteration to protect
            self._apply_pending()

    @property
    def _driven(self) -> bool:
        return self.iteration > 0 or bool(self._hooks)

    @property
    def output_loss(self) -> Optional[str]:
        """The output loss in force ("stock" or "chunked"), None where this controller holds no
        output layer it may switch (`output`)."""
        return None if self.output is None else self.output.mode

    def set_output_loss(self, mode: Optional[str]) -> str:
        """Ask for the output loss `mode` ("stock" or "chunked"; None: no change), applied with
        plans at the next step boundary (or at once while nothing drives iterations). Returns
        "output loss: old->new" when it changes, else "". The adaptive planner calls it with
        the decision its source rank broadcast, so every rank of the stage asks alike."""
        if mode is None or self.output is None:
            return ""
        now = self._pending_output or self.output.mode
        if mode == now:
            return ""
        if mode not in ("stock", "chunked"):
            raise ValueError(f"output loss: expected 'stock' or 'chunked', got {mode!r}")
        self._pending_output = mode
        if not self._in_step and not self._driven:
            self._apply_pending()
        return f"output loss: {now}->{mode}"

    def set_probe(self, forward: Optional[Callable[[], Any]], params: Any = None) -> None:
        """The closure the adaptive planner measures with: `forward()` runs one forward over
        the current iteration's batch and returns the loss (unreduced per sample/token is
        best); `params`: the parameters whose gradient sensitivity counts (default: those
        of the controlled modules). None removes it."""
        if forward is not None and not callable(forward):
            raise TypeError(f"forward: expected a callable or None, got {type(forward).__name__}")
        self._probe = forward
        self._probe_params = params

    def watch(self, model: Any, layers: Any = None) -> None:
        """Measure from the training steps of `model` (a module or a list of pipeline
        chunks), whatever loop runs them:

        - the first training step is measured for the budget check
          (`llm_act.runtime.budget_check.FirstForward`; `layers`: the megatron-core TransformerLayers, whose
          TransformerConfig gives the analytic profile of plan "auto"); those hooks remove
          themselves after the first measured forward of every root;
        - plan "auto" records the training step of every tracking iteration and measures
          with it at the step boundary (`llm_act.measurement.replay`): no probe is needed;
        - where nothing else advances the controller (no `step()`, no attached optimizer, no
          DeepSpeed engine), every `optimizer.step()` of any torch optimizer that follows a
          training forward of `model` is the step boundary: a plain loop or Megatron-LM's
          `pretrain()` needs no call of ours.

        Idempotent."""
        if not self.enabled:
            return
        roots = list(model) if isinstance(model, (list, tuple)) else [model]
        self.adapter.first.install(roots, list(layers) if layers is not None else None)
        self.adapter.replay.install(roots)
        if self._any_optimizer is None:
            default_handler()
            start = ("'auto' starts from 'compress' and re-plans at iterations 1, 2, 4, ..."
                     if self.config.plan == "auto" else repr(self.config.plan))
            if speaks_for_stage():
                log.info("llm_act: plan in force at the start (%s), layers %s:\n%s", start,
                         spans(list(self.layers)), self.describe(self._plan))
            self._any_optimizer = _watch_any_optimizer(self)

    def _any_optimizer_stepped(self) -> None:
        """A torch optimizer stepped (the global hook of `watch`): the step boundary when
        nothing else drives this controller and a training forward of the watched model
        ran since the last boundary."""
        if self._in_step or self._hooks or self.boundary not in (None, ANY_OPTIMIZER):
            return
        if not self.adapter.replay.forward_seen:
            return  # an optimizer that does not train this model, or a second one of this step
        self.boundary = ANY_OPTIMIZER
        self._advance()

    def request_fidelity(self) -> None:
        """Report the gradient fidelity (`llm_act.measurement.fidelity`) at the end of the next
        iteration, besides the ones `ActConfig.fidelity_every` schedules; the report is
        logged and appended to `adapter.measured.fidelity`. Under distributed training call it on
        every rank (the report combines the ranks' sums in one collective)."""
        self.adapter.measured.fidelity_requested = True

    @property
    def probe_given(self) -> bool:
        """Whether the loop gave a probe (`step(probe=...)`, `set_probe`): tracking points then
        measure with it instead of the training step the hooks recorded."""
        return self._step_probe is not None or self._probe is not None

    def probe_params(self) -> list:
        if self._probe_params is not None:
            return params_of(self._probe_params)
        if self.layer_modules:
            return params_of(list(self.layer_modules.values()))
        return params_of([m for m in self.all_modules() if hasattr(m, "parameters")])

    @contextlib.contextmanager
    def step(self, probe: Optional[Callable[[], Any]] = None) -> Iterator["Controller"]:
        """`with controller.step(): forward/backward/optimizer step` -- one iteration.

        A pending plan takes effect on entry; on a clean exit the iteration counter advances,
        a tracking iteration re-plans (with `probe`, this iteration's forward closure, or the
        one given to `set_probe`), and a plan asked for during the step takes effect then.
        """
        if self._in_step:
            raise RuntimeError("controller.step() is already active: steps do not nest")
        if probe is not None and not callable(probe):
            raise TypeError(f"probe: expected a callable or None, got {type(probe).__name__}")
        self._apply_pending()
        self._in_step = True
        self._step_probe = probe
        try:
            yield self
        finally:
            self._in_step = False
        try:
            self._advance()
        finally:
            self._step_probe = None

    def attach_optimizer(self, optimizer: Any) -> Any:
        """Advance one iteration after every `optimizer.step()` (for loops that never call
        `step()`); returns the hook handle (`.remove()` detaches). Inside `with step():` the
        hook does nothing, so the two ways never double-count."""
        target = optimizer
        if not hasattr(target, "register_step_post_hook"):
            target = getattr(optimizer, "optimizer", None)  # megatron's optimizer wrappers
        if target is None or not hasattr(target, "register_step_post_hook"):
            raise TypeError(
                f"optimizer: expected a torch.optim.Optimizer (or a wrapper holding one in "
                f".optimizer), got {type(optimizer).__name__}"
            )

        def hook(*_args: Any, **_kwargs: Any) -> None:
            if not self._in_step:
                self._advance()

        handle = target.register_step_post_hook(hook)
        self._hooks.append(handle)
        self.boundary = self.boundary or "optimizer.step()"
        return handle

    def _advance(self) -> None:
        self.iteration += 1
        if self.enabled:
            self.adapter.after_iteration(self._step_probe or self._probe)
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is not None:
            plan, self._pending = self._pending, None
            self._apply(plan)
        if self._pending_output is not None:
            mode, self._pending_output = self._pending_output, None
            self.output.set(mode)

    def _apply(self, plan: LayerPlans) -> None:
        """Give every module the codec of its (layer, site); build codecs on first use.

        A layer with a binder (`layer_contract.binder_of` its modules: a megatron-core
        layer's `LayerRecompute`, a generic block's `BlockRecompute`) binds the whole
        layer's choice, the "recompute" ones included (regions, hooks, regenerated masks),
        and refuses a combination it cannot bind before changing anything (the layers bound
        before it get the plan in force back). The core attention then gets its mode
        (`attention_mode`)."""
        self.check_accepted(plan)
        try:
            self._bind(plan)
        except Exception:
            if self._plan or plan:  # a layer refused: put the plan in force back everywhere
                self._bind(self._plan)
            raise
        self._plan = {layer: dict(plan.get(layer, keep_layer())) for layer in self._modules}
        self.set_attention_mode(self.attention_mode())

    def _bind(self, plan: LayerPlans) -> None:
        """Bind each layer's choice: through its binder where it has one, and site by site for
        the modules no binder owns (a generic block's, the final norm bound with the last
        layer's plan)."""
        for layer, stored in self._modules.items():
            choice = plan.get(layer, {})
            owner = self.binder(layer)
            if owner is not None:
                owner.bind(choice, {site: self._get_codec(layer, site, name)
                                    for site, name in owner.codec_names(choice).items()})
            for site, module in stored.items():
                if owner is not None and binder_of(module) is owner:
                    continue
                name = choice.get(site, KEEP)
                module.set_act_codec(site, None if name == KEEP else self._get_codec(layer, site, name))

    def attention_mode(self) -> str:
        """The core-attention mode in force: `ActConfig.attention` when it names a backend
        ("stock", "sdpa", "chunked"); under "auto", "stock" while the plan keeps everything
        (exactly stock megatron-core; lossless mask codecs allowed, `is_keep`) and
        memory-efficient ("auto") otherwise -- also when
        the adaptive planner ("auto" plan) keeps everything: its profile was measured with
        the memory-efficient attention."""
        wanted = self.config.attention
        if wanted != "auto":
            return wanted
        return "stock" if is_keep(self._plan) and self.config.plan != "auto" else "auto"

    def set_attention_mode(self, mode: str) -> None:
        """Put every controlled core attention in `mode` (until the next plan is applied)."""
        for stored in self._modules.values():
            core = stored.get(ATTN_Q)
            if core is not None:
                core.set_attention_mode(mode)

    def _get_codec(self, layer: int, site: str, name: str) -> Codec:
        key = (layer, site, name)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self.new_codec(layer, site, name, self._codec_seed(layer, site))
            self._codecs[key] = codec
        return codec

    def new_codec(self, layer: int, site: str, name: str, seed: int) -> Codec:
        """A codec `name` for (layer, site) with its own generator seeded `seed` (the plan's
        are built here once; the fidelity report builds fresh ones)."""
        kwargs = {"activation": self._activation(layer, site)} if site == MLP_ACT_INPUT else {}
        return make_codec(name, seed=seed, **kwargs)

    def _codec_seed(self, layer: int, site: str) -> int:
        """`codec_seed` of (layer, site) in this process (its DP and TP rank, and whether
        the layer runs under sequence parallelism)."""
        sp = _sequence_parallel(self._modules.get(layer, {}).values())
        return codec_seed(self.config.seed, layer, site, sequence_parallel=sp)

    def binder(self, layer: int) -> Optional[LayerBinder]:
        """The binder of `layer` (`layer_contract.binder_of` its modules), None where none owns
        them (their sites are bound one by one)."""
        return next((b for b in map(binder_of, self._modules.get(layer, {}).values()) if b is not None), None)

    def mlp_kind(self, layer: int) -> Optional[str]:
        """What `layer`'s MLP activation lets backward keep (`LayerBinder.mlp_kind`: "fewbit",
        "mask", "value", or None where unknown). Modules no binder owns say it through
        `act_activation` (a fitted activation's name, or None: a value codec only)."""
        owner = self.binder(layer)
        if owner is not None:
            return owner.mlp_kind()
        module = self._modules.get(layer, {}).get(MLP_ACT_INPUT)
        if module is None:
            return None
        return MLP_FEWBIT if isinstance(module.act_activation, str) else MLP_VALUE

    def accepts(self, layer: int, site: str, name: str) -> bool:
        """Whether `layer` can take choice `name` at `site`: the schema's rule
        (`registry.refusal`) for this layer's MLP kind. Every path of "auto" asks it before it
        offers, measures or reports a codec."""
        return accepts(site, name, self.mlp_kind(layer))

    def check_accepted(self, plan: LayerPlans) -> None:
        """Refuse, before anything changes, a plan with a choice some layer cannot take: a
        codec the schema's rule refuses for the layer (`accepts`), or a combination its binder
        cannot bind (`LayerBinder.codec_names` raises). A `ValueError` (the binder's own error
        for a combination) naming the layer, the site and the fix."""
        for layer, choice in plan.items():
            stored, kind = self._modules.get(layer, {}), self.mlp_kind(layer)
            for site, name in choice.items():
                why = refusal(site, name, kind) if site in stored else None
                if why is not None:
                    raise ValueError(f"plan for layer {layer}: {why}")
            owner = self.binder(layer)
            if owner is not None:
                owner.codec_names(choice)

    def no_fewbit_layers(self) -> set[int]:
        """Layers that cannot take the default codec at `mlp.act_input` (a few-bit one):
        "compress" gives them a value codec there (`plan.VALUE_ACT_CODEC`)."""
        return {layer for layer, stored in self._modules.items()
                if MLP_ACT_INPUT in stored and not self.accepts(layer, MLP_ACT_INPUT, DEFAULT_CODECS[MLP_ACT_INPUT])}

    def _activation(self, layer: int, site: str) -> str:
        """The activation whose derivative a few-bit codec at `site` tabulates."""
        name = self._modules[layer][site].act_activation
        return name if isinstance(name, str) else "gelu"

    # ---- checkpoints (`llm_act.runtime.controller_state`) --------------------------------
    @property
    def in_step(self) -> bool:
        """Whether `step()` is running (a checkpoint is neither taken nor restored then)."""
        return self._in_step

    def snapshot(self) -> ControllerSnapshot:
        """What a checkpoint keeps of this controller, as plain data (`state_dict` saves it)."""
        return ControllerSnapshot(
            iteration=self.iteration, config=self.config, plan=self._plan, pending_plan=self._pending,
            adapt=self.adapter.state_dict(), output_loss=self.output_loss,
            pending_output_loss=self._pending_output,
            codecs={key: codec.state_dict() for key, codec in self._codecs.items()})

    def restore_codec(self, layer: int, site: str, name: str, state: Mapping[str, Any]) -> Optional[bool]:
        """Give codec `name` at (layer, site) its saved random stream `state`: True when
        restored, False when the stream was seeded for another run or rank (this controller's
        fresh one stays), None when the layer is not on this pipeline stage."""
        if site not in self._modules.get(layer, {}):
            return None
        if state.get("seed") != self._codec_seed(layer, site):
            return False
        self._get_codec(layer, site, name).load_state_dict(state)
        return True

    def restore_plans(self, plan: Mapping[int, Mapping[str, str]], pending: Optional[Mapping[int, Mapping[str, str]]],
                      output_loss: Optional[str], pending_output_loss: Optional[str]) -> None:
        """Put a checkpoint's plan in force, its pending plan and its output loss back."""
        self._apply(plan_from(dict(plan), self.num_layers, self._modules))
        self._pending = None if pending is None else plan_from(dict(pending), self.num_layers, self._modules)
        if self.output is not None and output_loss in ("stock", "chunked"):
            self.output.set(output_loss)
            self._pending_output = pending_output_loss

    def state_dict(self) -> dict[str, Any]:
        """Iteration, the `ActConfig` it ran under, plan (in force and pending), the adaptive
        planner's state and every codec's generator state."""
        return controller_state.state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Restore what `state_dict()` saved where it agrees with this controller's config:
        the settings given now (the `--act-compress-*` flags) win over the checkpoint's.

        - the iteration always comes back (it is the training clock);
        - the plan in force, the pending plan and the adaptive planner's state come back
          only when every `ActConfig` field but `seed` equals the saved one; otherwise (or
          when the checkpoint predates saved configs) the plan of the current config stays;
        - a codec's random stream comes back only when its seed is the one this controller
          gives it (same `seed`, same data- and tensor-parallel rank), so replicas and
          shards stay independent.

        Changes take effect now, between iterations. Returns the lines it logs (logger
        "llm_act.runtime.controller", INFO): what was restored and what was replaced."""
        return controller_state.load_state_dict(self, state)

    def __repr__(self) -> str:
        if not self.enabled:
            return f"Controller(disabled, iteration={self.iteration})"
        return f"Controller(iteration={self.iteration}, layers={list(self.layers)},\n{describe_plan(self._plan)})"
