"""Extra forward/backward passes that leave the real training run untouched.

The planner's measurements (the measured profile, GACT's sensitivity) run additional
passes over the current batch in the middle of training. They must not move anything the
real run depends on: the RNG streams (torch's CPU and CUDA generators, megatron's tracker
states: dropout masks of the next iteration), the gradient buffers (`.grad`, and megatron's
`main_grad` that a linear with gradient-accumulation fusion writes in backward), the
codecs' private generators (the real codecs are never called: probes install their own)
and the codec tables of the modules (the real ones are put back afterwards).

`isolated(controller, params)` is the one context manager that guarantees this; inside it
`restore_rng()` rewinds the RNG streams to their state at entry, so every probe pass draws
the very dropout masks the others draw (two passes then differ only in what the probe
changes on purpose).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from llm_act.layer_contract import binder_of
from llm_act.measurement.controlled import ControlledModel


def _tracker():
    """megatron's RNG tracker when megatron-core is importable and seeded, else None."""
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except Exception:  # megatron-core absent: only torch's streams exist
        return None
    try:
        tracker = get_cuda_rng_tracker()
        return tracker if tracker.get_states() else None
    except Exception:
        return None


class RngSnapshot:
    """Every RNG state a forward pass may draw from, captured now; `restore()` rewinds."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.tracker = _tracker()
        self.tracker_states = None
        if self.tracker is not None:
            self.tracker_states = {k: v.clone() for k, v in self.tracker.get_states().items()}

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.tracker is not None:
            self.tracker.set_states({k: v.clone() for k, v in self.tracker_states.items()})


def _fusion_modules(modules: Iterable[Any]) -> list[Any]:
    return [m for m in modules if getattr(m, "gradient_accumulation_fusion", False)]


class _FusionOff:
    """While installed, every module that runs with gradient-accumulation fusion on (the
    controlled linears, and the output layer no controller holds) has it turned off: in
    backward it would add into `main_grad`, the real run's gradient buffer."""

    def __init__(self, modules: Iterable[Any]):
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.off: dict[int, Any] = {}
        for m in _fusion_modules(modules):
            self._turn_off(m)
        self.handle = register_module_forward_pre_hook(lambda m, args: self._turn_off(m))

    def _turn_off(self, m: Any) -> None:
        if getattr(m, "gradient_accumulation_fusion", False) is True and id(m) not in self.off:
            self.off[id(m)] = m
            m.gradient_accumulation_fusion = False

    def restore(self) -> None:
        self.handle.remove()
        for m in self.off.values():
            m.gradient_accumulation_fusion = True


@contextlib.contextmanager
def isolated(controller: ControlledModel, params: Iterable[torch.Tensor] = ()) -> Iterator[RngSnapshot]:
    """Run probe passes: on exit the RNG streams, `.grad` of `params`, the modules' codec
    tables and gradient-accumulation-fusion flags are as they were at entry."""
    snap = RngSnapshot()
    params = list(params)
    grads = [p.grad for p in params]
    main_grads = [getattr(p, "main_grad", None) for p in params]
    fusion = _FusionOff(controller.all_modules())
    try:
        yield snap
    finally:
        fusion.restore()
        for p, g, mg in zip(params, grads, main_grads):
            p.grad = g
            if mg is not None:
                p.main_grad = mg
        snap.restore()
        controller.reinstall()


def install(controller: ControlledModel, codecs: dict[tuple[int, str], Any]) -> None:
    """Give every (layer, site) the controller drives the codec in `codecs` (None = keep).
    A layer with a binder (`layer_contract.binder_of`, e.g. `LayerRecompute`) is unbound
    first (every site kept, hooks and regions removed), so probe passes see each site's
    tensor in forward;
    `Controller.reinstall()` binds the plan in force again."""
    for layer in controller.layers:
        owner = binder_of(controller.module(layer, controller.sites(layer)[0])) \
            if controller.sites(layer) else None
        if owner is not None:
            owner.bind({}, {})
    for layer in controller.layers:
        for site in controller.sites(layer):
            controller.module(layer, site).set_act_codec(site, codecs.get((layer, site)))


def scalar_loss(out: Any) -> torch.Tensor:
    """The mean of what a probe closure returned (a loss tensor, or a tuple led by one)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(
            f"probe: expected the closure to return a floating-point loss tensor, got {type(out).__name__}")
    return out.float().mean()


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 3, warmup: int = 1) -> float:
    """Median time of `fn()` in ms: CUDA events on a GPU, wall clock on CPU. Only ratios
    between times taken in one run mean anything."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def device_of(controller: ControlledModel) -> torch.device:
    """The device of the controlled model's parameters (CPU when it has none)."""
    for m in controller.all_modules():
        for p in m.parameters(recurse=False) if isinstance(m, torch.nn.Module) else ():
            return p.device
    return torch.device("cpu")


def optional_grad(loss: torch.Tensor, params: list[torch.Tensor], retain: bool = False) -> list[torch.Tensor]:
    """d loss / d params as a list (zeros where a parameter takes no part), never into .grad."""
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def sq_distance(a: list[torch.Tensor], b: Optional[list[torch.Tensor]]) -> float:
    """||a - b||^2 over all tensors together, in float64 (b None: ||a||^2)."""
    if b is None:
        return float(sum(float(x.double().pow(2).sum()) for x in a))
    return float(sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(a, b)))


def sq_by_group(a: list[torch.Tensor], b: Optional[list[torch.Tensor]], groups: Sequence[str]) -> dict[str, float]:
    """||a - b||^2 per group name (`groups[i]` names tensor i; b None: ||a||^2), in float64."""
    out: dict[str, float] = {}
    for i, (x, g) in enumerate(zip(a, groups)):
        d = x.double() if b is None else x.double() - b[i].double()
        out[g] = out.get(g, 0.0) + float(d.pow(2).sum())
    return out


def params_of(model_or_params: Any) -> list[torch.Tensor]:
    """Trainable parameters of a module / list of modules, or the given parameter list."""
    if isinstance(model_or_params, torch.nn.Module):
        return [p for p in model_or_params.parameters() if p.requires_grad]
    items = list(model_or_params)
    if items and all(isinstance(m, torch.nn.Module) for m in items):
        out, seen = [], set()
        for m in items:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out
    return [p for p in items if isinstance(p, torch.Tensor) and p.requires_grad]


def first(items: Iterable[Any]) -> Optional[Any]:
    for x in items:
        return x
    return None
