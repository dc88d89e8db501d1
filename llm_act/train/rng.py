"""Every random-number state a training step reads, as one picklable dict.

A resumed run must draw the same dropout masks as the run that saved, so a checkpoint
holds Python's, NumPy's and torch's generators and megatron-core's RNG tracker (the
model-parallel stream that TP-split dropout draws from). The codecs' stochastic rounding
uses the Controller's own generators, which travel in the Controller's state_dict.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def get_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in _tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    _tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_all(seed: int) -> None:
    """Megatron-LM's `_set_random_seed`: one seed per pipeline stage, shared by the
    data-parallel replicas; the tracker gets its model-parallel and data-parallel streams."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = int(seed) + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
