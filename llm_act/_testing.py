"""Private helpers of the test suite; production code never imports this module.

`spawn` runs a function on N gloo ranks and re-raises a worker's failure in the caller with
the worker's own traceback, so multi-process tests fail readably. The model and process-group
builders the tests share live in `llm_act.train.small_gpt` and `llm_act.train.parallel`
(benches and demos use them too) and are re-exported here for the tests.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch

from llm_act.train.parallel import destroy_parallel, free_port, init_parallel
from llm_act.train.small_gpt import gpt_batch, gpt_model, local_layer_spec, small_config, transformer_layer

__all__ = ["WorkerError", "destroy_parallel", "free_port", "gpt_batch", "gpt_model", "init_parallel",
           "local_layer_spec", "small_config", "spawn", "transformer_layer"]


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
