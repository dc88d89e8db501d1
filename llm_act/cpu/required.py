"""Where megatron-core needs llm_act's CPU stand-ins, and the one-line error that says so.

The stand-ins (`llm_act.cpu.install()`) are opt-in: `apply()`, `layer_spec()` and
`init_parallel()` never patch megatron-core. On a host without CUDA and without them,
megatron-core still runs a dense GPT under `apply()` (learned or no position embedding,
tensor parallelism without sequence parallelism, the memory-efficient attention, no
attention dropout, no recomputation). The parts below call `torch.cuda` on such a host; we
check for them where our own code reaches them, so the user reads which part needs the
stand-ins and how to get them instead of CUDA's traceback from inside megatron-core:

- at `apply()` / `layer_spec()` (`check_model`, `check_config`): RoPE, sequence
  parallelism, pipeline parallelism, the alltoall MoE token dispatcher;
- when the forward first takes them (`require`): megatron's stock attention, attention
  dropout under megatron's RNG tracker, recomputation's RNG states, the stock MoE router.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

from llm_act.cpu import shim

__all__ = ["CpuStandInsMissing", "check_config", "check_model", "missing", "require"]

FIX = "call llm_act.cpu.install() first (opt-in: it patches megatron-core to run on CPU)"


class CpuStandInsMissing(RuntimeError):
    """A megatron-core part that calls CUDA runs on a host without CUDA and without the
    CPU stand-ins."""


@functools.lru_cache(maxsize=None)
def _cuda() -> bool:
    return torch.cuda.is_available()  # asked on hot paths (each recompute, each attention)


def missing() -> bool:
    """True on a host without CUDA where `llm_act.cpu.install()` has not run."""
    return not _cuda() and not shim.installed()


def require(part: str, where: str) -> None:
    """Raise `CpuStandInsMissing` naming `part` (what calls CUDA) and the fix, when missing."""
    if missing():
        raise CpuStandInsMissing(f"{where}: {part} calls torch.cuda, and this host has no CUDA; {FIX}")


def check_config(tconfig: Any, where: str) -> None:
    """The TransformerConfig settings that need the stand-ins (None: nothing to check)."""
    if tconfig is None or not missing():
        return
    if getattr(tconfig, "sequence_parallel", False):
        require("sequence parallelism (megatron-core's gather buffers on torch.cuda.current_device())", where)
    if getattr(tconfig, "num_moe_experts", None) and \
            getattr(tconfig, "moe_token_dispatcher_type", None) == "alltoall":
        require("the alltoall MoE token dispatcher (a torch.cuda.Stream)", where)


def check_model(modules: Iterable[torch.nn.Module], tconfigs: Iterable[Any], where: str) -> None:
    """`check_config` for each config, then the modules and the parallel layout that need
    the stand-ins: RoPE and pipeline parallelism (megatron's p2p and schedules)."""
    if not missing():
        return
    for tconfig in tconfigs:
        check_config(tconfig, where)
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding, RotaryEmbedding)

    for module in modules:
        if isinstance(module, (RotaryEmbedding, MultimodalRotaryEmbedding)):
            require(f"RoPE ({type(module).__name__} moves its frequencies to "
                    "torch.cuda.current_device())", where)
    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        require("pipeline parallelism (megatron-core's p2p communication and schedules)", where)
