"""Make stock megatron-core 0.16 build and train a GPT on a CPU-only torch.

megatron-core assumes CUDA in a handful of places that a CPU/gloo run reaches: the
`GlobalMemoryBuffer`, RoPE, the default causal mask, the sequence-parallel mappings and
linear backward, and the pipeline schedules / p2p code call `torch.cuda.current_device()`
/ `torch.cuda.synchronize()` or build tensors on "cuda"; the RNG tracker and
`model_parallel_cuda_manual_seed` read and write CUDA generator states.

Stock MoE layers (local spec, SequentialMLP experts, top-k routing, aux loss, the allgather
and alltoall token dispatchers, expert parallelism over gloo) add: `TopKRouter.gating`
(`transformer/moe/router.py`) moves its weight to `torch.cuda.current_device()`; the
alltoall dispatcher (`transformer/moe/token_dispatcher.py`) and the overlapped shared
expert (`transformer/moe/shared_experts.py`) create a `torch.cuda.Stream`, and the
dispatcher's `_maybe_dtoh_and_synchronize` uses `current_stream/stream/record_event`;
`track_moe_metrics` (`transformer/moe/moe_utils.py`) builds its tracker on "cuda";
`moe_utils.maybe_move_tensor_to_cpu` converts only CUDA tensors, so on CPU the alltoall
split sizes stay tensors that `all_to_all_single` rejects; and without Transformer Engine
`RouterGatingLinearFunction` reads an undefined `te_general_gemm` (NameError).
GroupedMLP (`moe_grouped_gemm=True`) needs the CUDA-only `grouped_gemm` extension and is
not emulated: megatron refuses it at build time.

`install()` fixes exactly these, and only when CUDA is absent. It is opt-in, through the
public `llm_act.cpu.install()`: `apply()`, `layer_spec()` and `init_parallel()` never call it
(`required` names it where a part needs it):

- In the modules listed in `_CUDA_MODULES`, the module-global name `torch` is replaced by
  a thin proxy (`CpuTorch`) that forwards everything to torch, except that
  `torch.cuda.current_device()` answers the CPU device, `torch.cuda.synchronize()` does
  nothing, and tensor factories (`torch.empty/zeros/ones/full/tensor/arange/...`) map a
  "cuda" device to "cpu". No megatron function is copied; their code runs unchanged.
  `torch.cuda.Stream/Event/current_stream/stream` become no-op stand-ins (`CpuStream`,
  `CpuEvent`): CPU ops run eagerly in order, so waits and events have nothing to do.
- `moe_utils.maybe_move_tensor_to_cpu` (and the token dispatcher's imported name) also
  "moves" CPU tensors: a numpy view when `as_numpy`, as the stock one gives for CUDA ones.
- `moe_utils.te_general_gemm = None` when TE is absent and the name is undefined.
- In `tensor_parallel/random.py` the CUDA generator state is played by torch's default
  CPU generator, as the CUDA default generator is on a GPU: `fork()` swaps the tracker's
  state into the CPU default generator, so dropout under the tracker draws from the
  tracker's stream and leaves the default stream where it was, and
  `model_parallel_cuda_manual_seed(seed)` seeds the default CPU generator with the
  data-parallel seed (what `torch.cuda.manual_seed` does on a GPU).

Every patched object carries `_llm_act_cpu_shim = True` and keeps the original in
`__wrapped__` (the `te_general_gemm = None` fill-in has no original and is only set while
the name is undefined). A target that is no longer the stock object (someone else patched it) is
left alone, and a second `install()` changes nothing.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Any, Callable

import torch

from llm_act._imports import require
from llm_act.cpu import megatron_lm as lm_part
from llm_act.cpu.stand_ins import MARK, CpuTorch, patch_attr, replace_torch

__all__ = ["MARK", "install", "install_core", "installed"]


#: Modules whose functions call torch.cuda.current_device()/synchronize() or build on "cuda".
_CUDA_MODULES = (
    "megatron.core.utils",  # GlobalMemoryBuffer.get_tensor
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # RoPE inv_freq
    "megatron.core.transformer.utils",  # get_default_causal_mask, sliding-window mask
    "megatron.core.tensor_parallel.mappings",  # SP gather / reduce-scatter buffers
    "megatron.core.tensor_parallel.layers",  # SP linear backward, GPU-side weight init
    "megatron.core.pipeline_parallel.schedules",  # token counter on "cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # shape exchange, synchronize()
    "megatron.core.transformer.moe.router",  # TopKRouter.gating moves its weight to current_device()
    "megatron.core.transformer.moe.moe_utils",  # aux-loss tracker values on "cuda"
    "megatron.core.transformer.moe.token_dispatcher",  # alltoall: DtoH side stream and event
    "megatron.core.transformer.moe.shared_experts",  # overlapped shared experts: side stream
)

_installed = False


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


def _patch_random(random: types.ModuleType) -> list[str]:
    """Tracker states become CPU generator states; fork swaps the CPU default generator.

    `CudaRNGStatesTracker.add` and `model_parallel_cuda_manual_seed` run unchanged: through
    the module's proxy their `torch.cuda.get_rng_state/manual_seed` act on the CPU default
    generator (so the seed call seeds it with the data-parallel seed, as on a GPU).
    """
    done = replace_torch((random.__name__,), lambda: CpuTorch(rng=True))
    tracker = random.CudaRNGStatesTracker
    for owner, name, fn in (
        (random, "_get_cuda_rng_state", _get_cpu_rng_state),
        (random, "_set_cuda_rng_state", _set_cpu_rng_state),
        (tracker, "fork", _tracker_fork),
    ):
        if patch_attr(owner, name, lambda original, fn=fn: _copy_fn(fn, original), random):
            done.append(f"{random.__name__}.{name}")
    return done


def _patch_moe_utils(moe_utils: types.ModuleType) -> list[str]:
    """Define `te_general_gemm = None` in moe_utils when Transformer Engine is absent.

    megatron-core 0.16 imports `te_general_gemm` only inside its `try: import
    transformer_engine` block, yet `RouterGatingLinearFunction.forward/backward` (the
    router's gating GEMM) test `te_general_gemm is not None`: without TE that is a
    NameError. None is what the test expects for "no TE": the router then uses torch.mm.
    Left alone when the name exists (TE present, or someone else defined it).
    """
    if "te_general_gemm" in moe_utils.__dict__ or getattr(moe_utils, "HAVE_TE", False):
        return []
    moe_utils.te_general_gemm = None
    return [f"{moe_utils.__name__}.te_general_gemm"]


def _dtoh_on_cpu(original: Callable) -> Callable:
    """moe_utils.maybe_move_tensor_to_cpu for CPU tensors, which the stock one skips.

    The alltoall dispatcher moves its split sizes to the host with `as_numpy=True`; the
    stock function only converts `tensor.is_cuda` tensors, so on CPU the splits stay
    tensors and `all_to_all_single` rejects them. On CPU the "move" is the conversion
    alone (a numpy view when `as_numpy`); CUDA tensors and non-tensors go to the stock one.
    """

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.detach().numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__qualname__ = original.__qualname__
    maybe_move_tensor_to_cpu.__doc__ = _dtoh_on_cpu.__doc__
    return maybe_move_tensor_to_cpu


def _patch_moe_dtoh(moe_utils: types.ModuleType, dispatcher: types.ModuleType) -> list[str]:
    """Patch `maybe_move_tensor_to_cpu` in moe_utils and rebind the token dispatcher's
    imported name, when that name is still the stock function."""
    done = []
    name = "maybe_move_tensor_to_cpu"
    if patch_attr(moe_utils, name, _dtoh_on_cpu, moe_utils):
        done.append(f"{moe_utils.__name__}.{name}")
    patched = getattr(moe_utils, name, None)
    if getattr(patched, MARK, False) and dispatcher.__dict__.get(name) is patched.__wrapped__:
        setattr(dispatcher, name, patched)
        done.append(f"{dispatcher.__name__}.{name}")
    return done


def _copy_fn(fn: Callable, original: Callable) -> Callable:
    """A fresh function calling `fn`, named like `original` (marking it leaves `fn` alone)."""

    def replacement(*args, **kwargs):
        return fn(*args, **kwargs)

    replacement.__name__, replacement.__qualname__ = original.__name__, original.__qualname__
    replacement.__module__, replacement.__doc__ = __name__, fn.__doc__
    return replacement


def install(megatron_lm: bool = False) -> list[str]:
    """Patch megatron-core for a CPU-only run; returns what was patched (empty if nothing).

    `megatron_lm=True` adds the stand-ins Megatron-LM's own loop (`pretrain()`) needs
    (`llm_act.cpu.megatron_lm`). Does nothing when CUDA is available and nothing on a second
    call. Raises ModuleNotFoundError, before changing anything, when megatron-core (or,
    with `megatron_lm`, Megatron-LM) is missing.
    """
    global _installed
    if torch.cuda.is_available():
        return []

    require("megatron.core", "the megatron-core CPU shim")
    if megatron_lm:
        lm_part.require_megatron_lm()
    done = replace_torch(_CUDA_MODULES, CpuTorch)
    done += _patch_random(importlib.import_module("megatron.core.tensor_parallel.random"))
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    done += _patch_moe_utils(moe_utils)
    done += _patch_moe_dtoh(
        moe_utils, importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    )
    _installed = True
    if megatron_lm:
        done += lm_part.patch_core() + lm_part.patch_training()
    return done


def install_core() -> list[str]:
    """`install()` and the stand-ins inside megatron-core that only a training stack reaches
    (timers, DDP buffers, the optimizer, grad scaler, clip_grads, the rerun state machine):
    enough for megatron-core's DDP and `get_megatron_optimizer` on CPU, without
    Megatron-LM. Returns what was patched; nothing where CUDA is available or on a second
    call."""
    if torch.cuda.is_available():
        return []
    return install() + lm_part.patch_core()


def installed() -> bool:
    """True once `install()` ran in this process."""
    return _installed
