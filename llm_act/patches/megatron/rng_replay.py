"""Megatron's RNG states, captured in forward and replayed in backward.

A recomputation must draw what its forward drew (a dropout the same mask), so it runs under
the states recorded before the forward: the default generator, the device generator and
megatron's tracker, through `megatron.core.tensor_parallel.random`'s own helpers (the ones
its CheckpointFunction uses). `recomputing()` marks the re-run so the patched modules take
their stock path while it lasts (`is_recomputing()`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from llm_act.cpu import required as cpu_required


def _random():
    from megatron.core.tensor_parallel import random

    return random


def capture_rng() -> tuple:
    """(CPU state, device state, tracker states) as megatron's CheckpointFunction records them."""
    cpu_required.require("recomputation (megatron's CUDA RNG states, recorded for the replay)",
                         "llm_act recompute")
    return _random()._get_all_rng_states()


@contextlib.contextmanager
def replay_rng(states: tuple) -> Iterator[None]:
    """Run with the RNG states `states` (from `capture_rng`), then restore the current ones.
    The tracker gets a copy of the recorded dict, so `states` can be replayed again."""
    random = _random()
    cpu, device, tracker = states
    with random._fork_rng():
        random._set_all_rng_states(cpu, device, dict(tracker))
        yield


_LOCAL = threading.local()


def is_recomputing() -> bool:
    """True while llm_act re-runs a forward in backward (regions run their stock path then)."""
    return getattr(_LOCAL, "depth", 0) > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1
