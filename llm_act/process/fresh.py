"""Fresh processes that start fast: the benches' isolated measurements and the tests' ranks.

A process made by `fresh_context(preload)` starts with none of the caller's state, as a
"spawn" one does, but as a fork of a server that imported `preload` once ("forkserver"):
no second import of torch and megatron-core per process (about 5 s of CPU each). Only
imports run in the server, never device work: the children initialise CUDA themselves.
A forked child has the server's environment, not the caller's: pass `os.environ` along and
apply it first (`apply_environ`).
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Mapping, Sequence

from llm_act._imports import available


def fresh_context(preload: Sequence[str] = ()):
    """The "forkserver" context with the installed modules of `preload` imported in its
    server ("spawn" where the platform has no forkserver). The server starts at the first
    process; a later call's `preload` adds nothing once it runs."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in preload if available(m.split(".")[0])])
    return ctx


def apply_environ(environ: Mapping[str, str]) -> None:
    """Make this process's environment `environ` (the caller's, taken when it started us)."""
    os.environ.clear()
    os.environ.update(environ)
