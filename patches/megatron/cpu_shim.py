"""Make stock megatron-core 0.16 build and train a GPT on a CPU-only torch.

megatron-core assumes CUDA in a handful of places that a CPU/gloo run reaches: the
`GlobalMemoryBuffer`, RoPE, the default causal mask, the sequence-parallel mappings and
linear backward, and the pipeline schedules / p2p code call `torch.cuda.current_device()`
/ `torch.cuda.synchronize()` or build tensors on "cuda"; the RNG tracker and
`model_parallel_cuda_manual_seed` read and write CUDA generator states.

`install()` fixes exactly these, and only when CUDA is absent:

- In the modules listed in `_CUDA_MODULES`, the module-global name `torch` is replaced by
  a thin proxy (`_CpuTorch`) that forwards everything to torch, except that
  `torch.cuda.current_device()` answers the CPU device, `torch.cuda.synchronize()` does
  nothing, and tensor factories (`torch.empty/zeros/ones/full/tensor/arange/...`) map a
  "cuda" device to "cpu". No megatron function is copied; their code runs unchanged.
- In `tensor_parallel/random.py` the CUDA generator state is played by torch's default
  CPU generator, as the CUDA default generator is on a GPU: `fork()` swaps the tracker's
  state into the CPU default generator, so dropout under the tracker draws from the
  tracker's stream and leaves the default stream where it was, and
  `model_parallel_cuda_manual_seed(seed)` seeds the default CPU generator with the
  data-parallel seed (what `torch.cuda.manual_seed` does on a GPU).

Every patched object carries `_llm_act_cpu_shim = True` and keeps the original in
`__wrapped__`. A target that is no longer the stock object (someone else patched it) is
left alone, and a second `install()` changes nothing.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Any, Callable

import torch

MARK = "_llm_act_cpu_shim"

#: Modules whose functions call torch.cuda.current_device()/synchronize() or build on "cuda".
_CUDA_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # RoPE inv_freq
    "megatron.core.transformer.utils",  # get_default_causal_mask, sliding-window mask
    "megatron.core.tensor_parallel.mappings",  # SP gather / reduce-scatter buffers
    "megatron.core.tensor_parallel.layers",  # SP linear backward, GPU-side weight init
    "megatron.core.pipeline_parallel.schedules",  # token counter on "cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape exchange, synchronize()
)

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "eye", "linspace",
)

_installed = False


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device (str, int-free torch.device) to the CPU; leave others alone."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return torch.device("cpu")
    return device


def _factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return make


class _CpuCuda:
    """`torch.cuda` as seen by a shimmed module: the current device is the CPU.

    With `rng=True` (only for tensor_parallel/random.py) the CUDA default generator is
    played by the CPU default one: get/set_rng_state and manual_seed act on it.
    """

    def __init__(self, rng: bool = False) -> None:
        setattr(self, MARK, True)
        self.__wrapped__ = torch.cuda
        if rng:
            self.get_rng_state = lambda device="cuda": torch.get_rng_state()
            self.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
            self.manual_seed = lambda seed: torch.manual_seed(seed)
            self.manual_seed_all = self.manual_seed

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch:
    """`torch` as seen by a shimmed module: CUDA device requests resolve to the CPU."""

    def __init__(self, rng: bool = False) -> None:
        setattr(self, MARK, True)
        self.__wrapped__ = torch
        self.cuda = _CpuCuda(rng)
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        self.__dict__[name] = value  # torch's attributes are fixed; cache the lookup
        return value


# ---- the RNG tracker on the CPU default generator ------------------------------------------


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """The state of the generator that plays CUDA's default one: the CPU default."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _tracker_fork(self, name: str = "model-parallel-rng"):
    """CudaRNGStatesTracker.fork: swap `name`'s state into the CPU default generator.

    Ops inside draw from the tracker's stream (as they draw from the swapped-in CUDA
    state on a GPU); on exit the advanced state is stored back and the caller's state
    restored, so the default stream does not move.
    """
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    outer_state = torch.get_rng_state()
    outer_name = getattr(self, "_current_state_name", "default-rng")
    if outer_name != "default-rng":
        self.states_[outer_name] = outer_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(
                f"current state name {self._current_state_name} is not the same as the "
                f"desired state name {name}."
            )
        self.states_[name] = torch.get_rng_state()
        if outer_name != "default-rng":
            outer_state = self.states_[outer_name]
        torch.set_rng_state(outer_state)
        self._current_state_name = outer_name


# ---- installation ----------------------------------------------------------------------


def _mark(obj: Any, original: Any) -> Any:
    setattr(obj, MARK, True)
    obj.__wrapped__ = original
    return obj


def _defined_in(fn: Any, path: str) -> bool:
    return isinstance(fn, types.FunctionType) and fn.__code__.co_filename == path


def _is_stock_function(obj: Any, module: types.ModuleType) -> bool:
    """True when `obj` is the function `module` defined, as defined (a stock
    `@contextlib.contextmanager` counts); anything wrapped or replaced since is not."""
    if getattr(obj, MARK, False) or not isinstance(obj, types.FunctionType):
        return False
    if _defined_in(obj, module.__file__):
        return not hasattr(obj, "__wrapped__")
    inner = getattr(obj, "__wrapped__", None)
    return _defined_in(obj, contextlib.__file__) and _defined_in(inner, module.__file__)


def _patch_attr(owner: Any, name: str, make: Callable[[Any], Any], module: types.ModuleType) -> bool:
    current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if current is None or not _is_stock_function(current, module):
        return False
    setattr(owner, name, _mark(make(current), current))
    return True


def _patch_torch_global(module: types.ModuleType, rng: bool = False) -> bool:
    if module.__dict__.get("torch") is not torch:  # absent, or someone else's replacement
        return False
    module.torch = _CpuTorch(rng)
    return True


def _patch_random(random: types.ModuleType) -> list[str]:
    """Tracker states become CPU generator states; fork swaps the CPU default generator.

    `CudaRNGStatesTracker.add` and `model_parallel_cuda_manual_seed` run unchanged: through
    the module's proxy their `torch.cuda.get_rng_state/manual_seed` act on the CPU default
    generator (so the seed call seeds it with the data-parallel seed, as on a GPU).
    """
    done = []
    if _patch_torch_global(random, rng=True):
        done.append(f"{random.__name__}.torch")
    tracker = random.CudaRNGStatesTracker
    for owner, name, fn in (
        (random, "_get_cuda_rng_state", _get_cpu_rng_state),
        (random, "_set_cuda_rng_state", _set_cpu_rng_state),
        (tracker, "fork", _tracker_fork),
    ):
        if _patch_attr(owner, name, lambda original, fn=fn: _copy_fn(fn, original), random):
            done.append(f"{random.__name__}.{name}")
    return done


def _copy_fn(fn: Callable, original: Callable) -> Callable:
    """A fresh function calling `fn`, named like `original` (marking it leaves `fn` alone)."""

    def replacement(*args, **kwargs):
        return fn(*args, **kwargs)

    replacement.__name__, replacement.__qualname__ = original.__name__, original.__qualname__
    replacement.__module__, replacement.__doc__ = __name__, fn.__doc__
    return replacement


def install() -> list[str]:
    """Patch megatron-core for a CPU-only run; returns what was patched (empty if nothing).

    Does nothing when CUDA is available and nothing on a second call. Raises
    ModuleNotFoundError when megatron-core is missing.
    """
    global _installed
    if torch.cuda.is_available():
        return []
    from llm_act._imports import require

    require("megatron.core", "the megatron-core CPU shim")
    done: list[str] = []
    for modname in _CUDA_MODULES:
        module = importlib.import_module(modname)
        if _patch_torch_global(module):
            done.append(f"{modname}.torch")
    done += _patch_random(importlib.import_module("megatron.core.tensor_parallel.random"))
    _installed = True
    return done


def installed() -> bool:
    """True once `install()` ran in this process."""
    return _installed
