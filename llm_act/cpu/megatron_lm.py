"""CPU stand-ins for Megatron-LM's own training loop (`pretrain()`; tag core_v0.16.1 and
branch core_r0.19.0, the latter also with megatron-core 0.19's wheel, which ships
`megatron.training`).

`shim.install()` makes megatron-core's model and schedules run on CPU; Megatron-LM's
loop (`megatron/training/*`, and the megatron-core parts only that loop reaches: DDP grad
buffers, the optimizer, grad scaler, clip_grads, timers, the rerun state machine) assumes
CUDA in more places. `patch_core()` and `patch_training()` here, called by
`shim.install(megatron_lm=True)` after its own part and only when CUDA is absent, add
what it needs:

- `initialize_megatron` runs with `allow_no_cuda=True` (its "Megatron requires CUDA."
  assert), in `megatron.training.initialize`, `megatron.training` and `training.py`;
- the fused-kernel `load` (CUDA extensions) does nothing, where `megatron.legacy` exists (a
  Megatron-LM checkout up to 0.16 has it; 0.19's checkout and the megatron-core 0.19 wheel do
  not);
- in the modules of `_TRAINING_MODULES` and `_CORE_MODULES`, and of
  `_OPTIONAL_TRAINING_MODULES` where they exist, the global `torch` is
  `shim`'s proxy, grown with
  `device_count() == 1` (so initialize.py builds the model-parallel groups and seeds the
  RNG tracker, as on one GPU per rank), `set_device` doing nothing,
  `get_device_properties` describing the CPU, `default_stream`, and CUDA's RNG state played
  by the CPU default generator (the rerun state machine saves and restores it);
- `Module.cuda` and `Tensor.cuda` return their object unchanged when megatron code calls
  them (get_model moves the model, get_batch the batch), Megatron-LM's script run as
  `__main__` included (0.19's `pretrain_gpt.py` moves its batch itself); every other caller
  gets torch's own method (which refuses on a CPU-only torch, as before);
- clip_grads' `assert param.grad.type() == 'torch.cuda.FloatTensor'` in
  `clip_grad_by_total_norm_fp32`: CPU fp32 gradients take the function's own
  `decoupled_grad` path, which scales the same tensors (`_cpu_grads`).

`shim.install_core()` does the megatron-core part alone (no Megatron-LM needed):
megatron-core's DDP and `get_megatron_optimizer` then run on CPU too.

Every patched object carries `stand_ins.MARK` and keeps the original in `__wrapped__`; a
target someone else already replaced is left alone, and a second call changes nothing.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import types
from typing import Any, Callable

import torch

from llm_act.patches.megatron import compat
from llm_act.cpu.stand_ins import (
    CPU_STREAM, MARK, cpu_device, CpuCuda, CpuTorch, mark, patch_attr, replace_torch)

#: Megatron-LM's modules that reach torch.cuda or build on "cuda"
_TRAINING_MODULES = (
    "megatron.training.initialize",  # device count, set_device, the RNG seed
    "megatron.training.training",  # start-time tensors, get_model's device, DDP stream
    "megatron.training.utils",  # norms, reductions, the batch broadcast
    "megatron.training.global_vars",
)

#: Megatron-LM's modules of that kind that not every version has, patched where they exist
_OPTIONAL_TRAINING_MODULES = (
    # 0.19: the config-container model builders move each chunk to current_device()
    "megatron.training.models.dist_utils",
    # 0.19: `megatron.training.utils` became a package; its reductions and norms live here
    "megatron.training.utils.common_utils",
)

#: megatron-core's modules that only a training stack (Megatron-LM's loop) reaches
_CORE_MODULES = (
    "megatron.core.timers",  # synchronize(), the gathered timings
    "megatron.core.distributed.param_and_grad_buffer",  # DDP buffers, streams
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.rerun_state_machine",  # current_device(), CUDA RNG state
)

_installed = False


class _LmCuda(CpuCuda):
    """`torch.cuda` for Megatron-LM's loop: one "device" per rank, the CPU."""

    def __init__(self) -> None:
        super().__init__(rng=True)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        """The CPU described as a device: compute capability 0.0, the machine's memory."""
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 0
        return types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=memory,
                                     multi_processor_count=os.cpu_count() or 1)

    @staticmethod
    def default_stream(device: Any = None) -> Any:
        return CPU_STREAM


class _LmTorch(CpuTorch):
    def __init__(self) -> None:
        super().__init__()
        self.cuda = _LmCuda()


def _runs_megatron_lm(namespace: dict) -> bool:
    """True for the namespace of a script that imported Megatron-LM's `megatron.training` (a
    function, class or module of it among its globals): Megatron-LM's own `pretrain_*.py`."""
    for value in list(namespace.values()):
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif isinstance(value, (types.FunctionType, type)):
            name = value.__module__ or ""
        else:
            continue
        if name == "megatron.training" or name.startswith("megatron.training."):
            return True
    return False


def _from_megatron(depth: int = 2) -> bool:
    """True when the caller `depth` frames up is megatron code, or the script run as
    `__main__` when it is Megatron-LM's (from 0.19 on `pretrain_gpt.py`'s own `get_batch`
    moves the batch with `.cuda()`, which 0.16 left to `megatron.training.utils`)."""
    frame = sys._getframe(depth)
    if frame is None:
        return False
    name = frame.f_globals.get("__name__", "")
    return name.startswith("megatron.") or (name == "__main__" and _runs_megatron_lm(frame.f_globals))


def _is_cpu(device: Any) -> bool:
    return device is None or isinstance(device, int) or cpu_device(device) == torch.device("cpu")


def _module_cuda(original: Callable) -> Callable:
    """`Module.cuda` called from megatron code: the module stays where it is (CPU)."""

    @functools.wraps(original)
    def cuda(self, device: Any = None):
        if _from_megatron() and _is_cpu(device):
            return self
        return original(self, device)

    return cuda


def _tensor_cuda(original: Callable) -> Callable:
    """`Tensor.cuda` called from megatron code: the tensor stays on the CPU."""

    @functools.wraps(original)
    def cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any):
        if _from_megatron() and _is_cpu(device):
            return self
        return original(self, device, non_blocking, **kwargs)

    return cuda


def _cpu_grads(original: Callable) -> Callable:
    """clip_grads' `clip_grad_by_total_norm_fp32` for CPU gradients.

    Its `param.grad` branch asserts `grad.type() == 'torch.cuda.FloatTensor'`; its
    `use_decoupled_grad` branch scales the same way but reads `param.decoupled_grad`. With
    CPU fp32 gradients this points `decoupled_grad` at `param.grad` for the call (the very
    tensors are scaled in place, as the stock path does) and puts it back afterwards.
    """

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if use_decoupled_grad or not grads or any(g.is_cuda for g in grads):
            return original(params, max_norm, total_norm, use_decoupled_grad)
        for g in grads:
            assert g.dtype == torch.float32, f"expected fp32 gradients, got {g.dtype}"
        missing = object()
        saved = [(p, p.__dict__.get("decoupled_grad", missing)) for p in params]
        try:
            for p in params:
                p.decoupled_grad = p.grad
            return original(params, max_norm, total_norm, True)
        finally:
            for p, old in saved:
                if old is missing:
                    del p.decoupled_grad
                else:
                    p.decoupled_grad = old

    return clip_grad_by_total_norm_fp32


def _allow_no_cuda(original: Callable) -> Callable:
    """`initialize_megatron` with `allow_no_cuda=True` unless the caller said otherwise."""

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any):
        kwargs.setdefault("allow_no_cuda", True)
        return original(*args, **kwargs)

    return initialize_megatron


def _no_load(original: Callable) -> Callable:
    """The fused-kernel `load`: nothing to build without CUDA (the unfused paths run)."""

    @functools.wraps(original)
    def load(args: Any = None) -> None:
        return None

    return load


def _patch_method(owner: type, name: str, make: Callable[[Callable], Callable]) -> bool:
    current = getattr(owner, name, None)  # Tensor.cuda is inherited from torch._C.TensorBase
    if current is None or getattr(current, MARK, False) or hasattr(current, "__wrapped__"):
        return False  # absent, ours, or someone else's wrapper
    setattr(owner, name, mark(make(current), current))
    return True


def _rebind(name: str, patched: Any, modules: tuple[str, ...]) -> list[str]:
    """Point `modules`' imported `name` at `patched` where it is still the original."""
    done = []
    for modname in modules:
        module = sys.modules.get(modname) or importlib.import_module(modname)
        if module.__dict__.get(name) is patched.__wrapped__:
            setattr(module, name, patched)
            done.append(f"{modname}.{name}")
    return done


def patch_core() -> list[str]:
    """The stand-ins inside megatron-core that only a training stack reaches (timers, DDP
    buffers, the optimizer, grad scaler, clip_grads, the rerun state machine), over the
    megatron-core shim `shim.install()` already put in (`shim.install_core()` runs
    both). Returns what was patched; nothing on a second call."""
    done = replace_torch(_CORE_MODULES, _LmTorch)
    clip = importlib.import_module("megatron.core.optimizer.clip_grads")
    name = "clip_grad_by_total_norm_fp32"
    if patch_attr(clip, name, _cpu_grads, clip):
        done.append(f"{clip.__name__}.{name}")
    if getattr(getattr(clip, name), MARK, False):
        done += _rebind(name, getattr(clip, name), (
            "megatron.core.optimizer", "megatron.core.optimizer.optimizer",
            "megatron.core.optimizer.distrib_optimizer"))
    return done


#: modules patched where they exist: `megatron.legacy` ships with a Megatron-LM checkout up to
#: 0.16, not in 0.19's (nor in the megatron-core 0.19 wheel, whose `megatron.training` does not
#: reach it)
_OPTIONAL_MODULES = ("megatron.legacy.fused_kernels",) + _OPTIONAL_TRAINING_MODULES


def require_megatron_lm() -> None:
    """Raise ModuleNotFoundError naming the fix when Megatron-LM's `megatron.training`, or a
    module the stand-ins patch, is not importable: every one is imported here, before anything
    is patched, so a missing module never leaves the process half patched (the optional ones,
    `_OPTIONAL_MODULES`, are skipped where absent)."""
    try:
        for name in ("megatron.training",) + _TRAINING_MODULES + _CORE_MODULES + (
                "megatron.core.optimizer.clip_grads",):
            importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"shim.install(megatron_lm=True) needs Megatron-LM's `megatron.training` "
            f"({err}): run from a Megatron-LM checkout (tag core_v0.16.1 or branch "
            f"core_r0.19.0), put one on PYTHONPATH, or install megatron-core 0.19 or later "
            f"(its wheel ships `megatron.training`)") from err
    for name in _OPTIONAL_MODULES:  # an error inside one that exists raises here, still unpatched
        compat.optional_module(name)


def patch_training() -> list[str]:
    """The stand-ins for Megatron-LM's loop itself (see the module docstring), after
    `patch_core()`; returns what was patched, nothing new on a second call."""
    global _installed
    done = replace_torch(_TRAINING_MODULES + tuple(
        name for name in _OPTIONAL_TRAINING_MODULES if compat.optional_module(name) is not None),
        _LmTorch)
    init = importlib.import_module("megatron.training.initialize")
    if patch_attr(init, "initialize_megatron", _allow_no_cuda, init):
        done.append("megatron.training.initialize.initialize_megatron")
    if getattr(init.initialize_megatron, MARK, False):
        done += _rebind("initialize_megatron", init.initialize_megatron,
                        ("megatron.training", "megatron.training.training"))
    kernels = compat.optional_module("megatron.legacy.fused_kernels")
    if kernels is not None and patch_attr(kernels, "load", _no_load, kernels):
        done.append("megatron.legacy.fused_kernels.load")
    if _patch_method(torch.nn.Module, "cuda", _module_cuda):
        done.append("torch.nn.Module.cuda")
    if _patch_method(torch.Tensor, "cuda", _tensor_cuda):
        done.append("torch.Tensor.cuda")
    _installed = True
    return done


def installed() -> bool:
    """True once `patch_training()` ran in this process."""
    return _installed
