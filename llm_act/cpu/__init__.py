"""megatron-core on a CPU-only host: llm_act's CPU stand-ins, installed only on request.

megatron-core calls CUDA in places a CPU run reaches (RoPE and the stock attention's buffers
on `torch.cuda.current_device()`, megatron's RNG tracker on CUDA generator states, MoE
routing, sequence parallelism, the pipeline schedules). `install()` replaces `torch` inside
those megatron-core modules by a proxy that answers with the CPU
(`llm_act.cpu.shim` lists every patch). That changes megatron-core for the
whole process, so it is opt-in: `apply()`, `layer_spec()` and `init_parallel()` never do it;
the processes llm_act owns (`llm-act train` / `demo`, the benches, the launchers) and its
tests call `install()` themselves. Where the stand-ins are needed and missing, llm_act
raises one line naming this function instead of CUDA's traceback.
"""
from __future__ import annotations

__all__ = ["install", "installed"]


def install(megatron_lm: bool = False) -> list[str]:
    """Install the CPU stand-ins into megatron-core; returns what was patched.

    `megatron_lm=True` adds those Megatron-LM's own loop (`pretrain()`) needs. Does nothing
    where CUDA is available and nothing on a second call; raises ModuleNotFoundError,
    before changing anything, when megatron-core (or, with `megatron_lm`, Megatron-LM) is
    missing.
    """
    from llm_act.cpu import shim

    return shim.install(megatron_lm=megatron_lm)


def installed() -> bool:
    """True once `install()` patched megatron-core in this process (never where CUDA is)."""
    from llm_act.cpu import shim

    return shim.installed()
