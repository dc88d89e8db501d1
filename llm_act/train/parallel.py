"""Process group and megatron-core parallel state for the loop.

Under torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in the environment) the
process group starts from the environment; a plain `python pretrain_gpt.py` is one rank on
a free local port. gloo without CUDA, NCCL with it. `init` starts the training loop's
process (the torchrun door, `llm-act train`, the benches that run the loop), which owns that
process, so without CUDA it installs llm_act's CPU stand-ins for megatron-core
(`llm_act.cpu.install()`). `init_parallel` (tests, benches, demos, a user's own process)
never does: without CUDA its caller opts in first.
"""
from __future__ import annotations

import argparse
import os
import random
import socket
from typing import Optional

import torch
import torch.distributed as dist

from llm_act import cpu
from llm_act._imports import require


def world_size() -> int:
    """The world size the launcher asks for (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(args: argparse.Namespace) -> None:
    """Start the process group (if needed) and megatron's parallel state for `args`."""
    from megatron.core import parallel_state as ps

    cuda = torch.cuda.is_available()
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("--distributed-backend nccl: needs CUDA, which this machine lacks; use gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu.install()  # the loop owns this process: it opts in to the CPU stand-ins
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        same = (ps.get_tensor_model_parallel_world_size() == args.tensor_model_parallel_size
                and ps.get_pipeline_model_parallel_world_size() == args.pipeline_model_parallel_size)
        if same:
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size)


def device() -> torch.device:
    """Where this rank trains: its CUDA device when there is one (`init` selected it)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def is_logging_rank() -> bool:
    """The last rank prints: it holds the loss (last pipeline stage), as in Megatron-LM."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


# ---- the gloo process group of tests, benches and demos, and the teardown of every run ----


#: where `free_port` looks first: below the kernel's ephemeral range, which it hands out to
#: outgoing connections (gloo's pairs among them) with no bind from anyone, so a port taken
#: from that range can be gone by the time the rendezvous listens on it.
PORT_FLOOR = 20000


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on right now (for a gloo rendezvous): a random one outside
    the ephemeral range where there is room, else one the kernel picks."""
    low, _ = _ephemeral_range()
    if low - PORT_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(PORT_FLOOR, low)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    rank: int = 0,
    world_size: int = 1,
    port: Optional[int] = None,
    seed: int = 1234,
    ep: int = 1,
) -> None:
    """Start gloo (if not started) and megatron's parallel state, then seed its RNG tracker.

    With one rank and no `port` a free port is picked. Re-initialises megatron's parallel
    state when it is already up (so tests can change TP/PP within one process). `ep` is
    megatron's expert-model-parallel size (MoE experts split over `ep` ranks).

    Never patches megatron-core. Seeding megatron's RNG tracker
    (`model_parallel_cuda_manual_seed`) needs CUDA generator states: on a host without CUDA
    call `llm_act.cpu.install()` first; without it this raises before starting anything.
    """
    require("megatron.core", "llm_act.train.parallel")
    from llm_act.cpu import required as cpu_required

    cpu_required.require("seeding megatron's RNG tracker (model_parallel_cuda_manual_seed)",
                         "init_parallel")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        if port is None:
            if world_size != 1:
                raise ValueError(f"port: needed for world_size={world_size}, got None")
            port = free_port()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and the process group (if up), and forget the
    groups DeepSpeed cached from it."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_deepspeed_groups()


def forget_deepspeed_groups() -> None:
    """DeepSpeed caches the process groups its first engine used (`deepspeed.utils.groups`);
    once the process group is destroyed they are stale, and the next engine, on a new
    group, would be handed them. Forget them (only if DeepSpeed was imported)."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
