"""Helpers that tests and demos share to run stock megatron-core on CPU with gloo.

`init_parallel` brings up a gloo process group and megatron's parallel state (with the
CPU shim installed when CUDA is absent); `small_config`, `gpt_model` and
`transformer_layer` build small models from the local (non-Transformer-Engine) spec;
`spawn` runs a function on N gloo ranks and re-raises a worker's failure in the caller
with the worker's own traceback, so multi-process tests fail readably.
"""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable, Optional

import torch

from llm_act._imports import require


def free_port() -> int:
    """A TCP port nobody listens on right now (for a gloo rendezvous)."""
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
    """
    import torch.distributed as dist

    require("megatron.core", "llm_act.testing")
    from llm_act.patches.megatron import cpu_shim

    cpu_shim.install()
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
    """Tear down megatron's parallel state and the process group (if up)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _forget_deepspeed_groups()


def _forget_deepspeed_groups() -> None:
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


def small_config(
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    **overrides: Any,
):
    """A small TransformerConfig built on CPU; `dropout` sets hidden and attention dropout.

    bf16/fp16 set the matching flags and `params_dtype`. `bias_dropout_fusion` defaults to
    False here: megatron's fused bias-dropout-add is a `torch.compile` function, which
    costs about a minute of Inductor compilation on CPU. Everything else is
    megatron-core's default unless overridden.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    kw: dict[str, Any] = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        use_cpu_initialization=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        params_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        bias_dropout_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def local_layer_spec(**kwargs: Any):
    """megatron-core's GPT layer spec without Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(**kwargs)


def gpt_model(config, vocab_size: int = 128, max_sequence_length: int = 64, spec=None, **kwargs: Any):
    """A GPTModel (RoPE by default) from the local spec, on CPU, in `config.params_dtype`."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    kwargs.setdefault("position_embedding_type", "rope")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec if spec is not None else local_layer_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        **kwargs,
    )


def transformer_layer(config, layer_number: int = 1, spec=None):
    """One stock TransformerLayer (local spec); megatron's `layer_number` is 1-based."""
    from megatron.core.transformer.spec_utils import build_module

    spec = spec if spec is not None else local_layer_spec()
    return build_module(spec, config=config, layer_number=layer_number)


def gpt_batch(batch: int, seq: int, vocab_size: int = 128, generator: Optional[torch.Generator] = None):
    """(input_ids, position_ids, labels) for a GPTModel forward; labels are the ids shifted."""
    ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return ids[:, :-1].contiguous(), pos, ids[:, 1:].contiguous()


# ---- multi-process gloo runs ---------------------------------------------------------------


class WorkerError(RuntimeError):
    """A spawned rank failed; the message carries the rank's own traceback."""


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, port, *args)
    except BaseException:  # report everything, including SystemExit from a worker
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run `fn(rank, world_size, port, *args)` on `world_size` fresh processes.

    `fn` must be importable (a module-level function). Raises `WorkerError` with every
    failing rank's traceback, or when a rank hangs past `timeout` seconds.
    """
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    hung = []
    for r, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            hung.append(r)
    for r in hung:
        procs[r].kill()
        procs[r].join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures or hung or any(p.exitcode != 0 for p in procs):
        lines = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures)]
        lines += [f"rank {r} hung for more than {timeout:.0f} s (killed)" for r in hung]
        reported = {r for r, _ in failures} | set(hung)
        lines += [
            f"rank {r} exited with code {p.exitcode}"
            for r, p in enumerate(procs)
            if p.exitcode != 0 and r not in reported
        ]
        raise WorkerError("\n".join(lines))
