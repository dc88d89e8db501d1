"""Private helpers of the test suite; production code never imports this module.

`spawn` runs a function on N gloo ranks and re-raises a worker's failure in the caller with
the worker's own traceback, so multi-process tests fail readably. The model and process-group
builders the tests share live in `llm_act.train.small_gpt` and `llm_act.train.parallel`
(benches and demos use them too) and are re-exported here for the tests; `init_parallel`
here also installs the CPU stand-ins (`llm_act.cpu`), which the library's own never does.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch

from llm_act.process.deferred_compile import defer_torch_compile


def _after_import(name: str, patch: Callable[[Any], None]) -> None:
    """Run `patch(module)` right after module `name` is first imported (no import now)."""
    import importlib.abc
    import importlib.util
    import sys

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def skip_deepspeed_shm_build() -> None:
    """DeepSpeed builds its shared-memory all-reduce op (C++, about a minute) in every CPU
    process that starts its comm, and the tests start many; gloo's all-reduce, which it
    falls back to, does the same job here. Takes effect when deepspeed.comm is imported."""
    if torch.cuda.is_available():
        return
    _after_import("deepspeed.comm.torch", lambda module: setattr(module, "build_shm_op", lambda: None))


defer_torch_compile()
skip_deepspeed_shm_build()

from llm_act.process.fresh import apply_environ, fresh_context  # noqa: E402
from llm_act.train import parallel as _parallel  # noqa: E402
from llm_act.train.parallel import destroy_parallel, free_port  # noqa: E402
from llm_act.train.small_gpt import gpt_batch, gpt_model, local_layer_spec, small_config, transformer_layer  # noqa: E402


def init_parallel(*args: Any, **kwargs: Any) -> None:
    """`llm_act.train.parallel.init_parallel` after `llm_act.cpu.install()`: the tests run
    megatron-core on CPU, so they opt in to the CPU stand-ins (a no-op where CUDA is). A test
    of what runs without them (tests/cpu/test_opt_in.py) calls neither."""
    from llm_act import cpu

    cpu.install()
    _parallel.init_parallel(*args, **kwargs)


__all__ = ["WorkerError", "defer_torch_compile", "destroy_parallel", "skip_deepspeed_shm_build", "free_port", "gpt_batch", "gpt_model", "init_parallel",
           "local_layer_spec", "small_config", "spawn", "transformer_layer"]


class WorkerError(RuntimeError):
    """A spawned rank failed; the message carries the rank's own traceback."""


#: what the rank processes' server imports once: each rank then starts as a fork of it, in
#: well under a second, instead of importing torch and megatron-core anew (about 5 s of CPU
#: per rank on the CI machine). Only imports: no state is set up before the fork.
_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt.gpt_model",
            "megatron.core.transformer.transformer_layer", "llm_act.patches.megatron")


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors,
            environ: dict) -> None:
    apply_environ(environ)  # a forked rank has the server's environment: take the caller's
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


#: a rendezvous whose port was taken between `free_port` and its listen (EADDRINUSE) is
#: started again on a new port, up to this many tries in all
PORT_TRIES = 3


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> None:
    """Run `fn(rank, world_size, port, *args)` on `world_size` fresh processes (forks of a
    server that has imported torch and megatron-core once: `fresh_process`).

    `fn` must be importable (a module-level function). Raises `WorkerError` with every
    failing rank's traceback, or when a rank hangs past `timeout` seconds. A rank that finds
    the rendezvous port taken stops every rank at once, and they start again on a new port.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = fresh_context(_PRELOAD)
    for _ in range(PORT_TRIES):
        failures, hung, procs = _run_ranks(ctx, fn, world_size, args, timeout)
        if not any(_lost_port(tb) for _, tb in failures):
            break
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


def _lost_port(traceback_text: str) -> bool:
    """A rendezvous that could not listen on its port: another process had bound it."""
    return "EADDRINUSE" in traceback_text and "DistNetworkError" in traceback_text


def _run_ranks(ctx, fn: Callable, world_size: int, args: tuple, timeout: float):
    """One try of `spawn`: (failures as (rank, traceback), hung ranks, processes)."""
    import time
    from multiprocessing.connection import wait

    errors = ctx.SimpleQueue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, errors, environ), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failures: list[tuple[int, str]] = []
    lost = False
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        wait([p.sentinel for p in procs if p.is_alive()], min(1.0, max(0.0, deadline - time.monotonic())))
        while not errors.empty():
            failures.append(errors.get())
        lost = any(_lost_port(tb) for _, tb in failures)
        if lost:
            break  # the others wait for a rendezvous that will not come
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    for p in procs:
        p.join()
    if lost:
        hung = []  # stopped, not hung: reported by their exit codes
    while not errors.empty():
        failures.append(errors.get())
    return failures, hung, procs
