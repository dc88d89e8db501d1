"""Process group and megatron-core parallel state for the loop.

Under torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` in the environment) the
process group starts from the environment; a plain `python pretrain_gpt.py` is one rank on
a free local port. gloo without CUDA (with llm_act's megatron-core CPU shim), NCCL with it.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def world_size() -> int:
    """The world size the launcher asks for (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(args: argparse.Namespace) -> None:
    """Start the process group (if needed) and megatron's parallel state for `args`."""
    from megatron.core import parallel_state as ps

    from llm_act.patches.megatron import cpu_shim

    cuda = torch.cuda.is_available()
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("--distributed-backend nccl: needs CUDA, which this machine lacks; use gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        cpu_shim.install()
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            from llm_act.testing import free_port

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


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    """Where this rank trains: its CUDA device when there is one (`init` selected it)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def is_logging_rank() -> bool:
    """The last rank prints: it holds the loss (last pipeline stage), as in Megatron-LM."""
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
