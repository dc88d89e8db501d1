"""The CPU stand-ins the megatron-core shim (`shim`) and its Megatron-LM part
(`megatron_lm`) both build on: `torch` and `torch.cuda` as a shimmed module sees
them (CUDA devices resolve to the CPU; streams and events do nothing, since CPU ops run
eagerly in order), and the marking rules every patch follows (a patched object carries
`MARK` and keeps its original in `__wrapped__`; only the stock object is ever replaced).
A module of its own so that neither shim module imports the other's internals back."""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Any, Callable

import torch

MARK = "_llm_act_cpu_shim"

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor", "eye", "linspace",
)


def cpu_device(device: Any) -> Any:
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
            kwargs["device"] = cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return make


class CpuEvent:
    """A recorded CUDA event on the CPU: work is already done when it is recorded."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        return None


class CpuStream:
    """A CUDA stream on the CPU: ops run eagerly in order, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> CpuEvent:
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


CPU_STREAM = CpuStream()


class CpuCuda:
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

    Stream = CpuStream
    Event = CpuEvent

    @staticmethod
    def current_stream(device: Any = None) -> CpuStream:
        return CPU_STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class CpuTorch:
    """`torch` as seen by a shimmed module: CUDA device requests resolve to the CPU."""

    def __init__(self, rng: bool = False) -> None:
        setattr(self, MARK, True)
        self.__wrapped__ = torch
        self.cuda = CpuCuda(rng)
        for name in _FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        self.__dict__[name] = value  # torch's attributes are fixed; cache the lookup
        return value


def mark(obj: Any, original: Any) -> Any:
    """`obj` as our replacement of `original`: it carries MARK (a second install, or someone
    checking, can tell) and keeps the original in `__wrapped__`."""
    setattr(obj, MARK, True)
    obj.__wrapped__ = original
    return obj


def _defined_in(fn: Any, path: str) -> bool:
    return isinstance(fn, types.FunctionType) and fn.__code__.co_filename == path


def is_stock_function(obj: Any, module: types.ModuleType) -> bool:
    """True when `obj` is the function `module` defined, as defined (a stock
    `@contextlib.contextmanager` counts); anything wrapped or replaced since is not."""
    if getattr(obj, MARK, False) or not isinstance(obj, types.FunctionType):
        return False
    if _defined_in(obj, module.__file__):
        return not hasattr(obj, "__wrapped__")
    inner = getattr(obj, "__wrapped__", None)
    return _defined_in(obj, contextlib.__file__) and _defined_in(inner, module.__file__)


def patch_attr(owner: Any, name: str, make: Callable[[Any], Any], module: types.ModuleType) -> bool:
    """Replace `owner.name` by `make(original)`, marked, only while it is the stock function
    `module` defined; True when it did."""
    current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
    if current is None or not is_stock_function(current, module):
        return False
    setattr(owner, name, mark(make(current), current))
    return True


def replace_torch(modnames: tuple[str, ...], proxy: Callable[[], Any]) -> list[str]:
    """Point each module's global `torch` at a fresh `proxy()` while it is torch itself (a
    module without one, or with someone else's replacement, is left alone); returns the
    names replaced."""
    done = []
    for modname in modnames:
        module = importlib.import_module(modname)
        if module.__dict__.get("torch") is torch:
            module.torch = proxy()
            done.append(f"{modname}.torch")
    return done
