"""The memory figures a plan is held against, besides what the plan itself stores.

One job: say how much memory this rank has and holds outside the activations -- the
micro-batches in flight on its pipeline stage, the device's total memory, the static memory
(weights, gradients, optimizer state). The solver (`llm_act.runtime.solving`) and the budget
checks (`llm_act.runtime.budget_check`) both count with these, so they live in one place and
the two count alike.

Callers use `memory.inflight()` through the module (not a copied name), so one
`monkeypatch.setattr(memory, "inflight", ...)` changes every count of a test.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def inflight() -> int:
    """Micro-batches in flight on this pipeline stage under 1F1B: p - k."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return ps.get_pipeline_model_parallel_world_size() - ps.get_pipeline_model_parallel_rank()
    except Exception:  # megatron-core absent
        pass
    return 1


def device_memory_bytes() -> Optional[int]:
    """Total memory of the current GPU; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def static_bytes(roots: list[Any], controlled_params: Callable[[], list]) -> int:
    """Memory that is not activations: on a GPU what is allocated between iterations;
    on CPU the weights and gradients of every parameter of the watched `roots`
    (`Controller.watch`: embeddings and output layer included; under ZeRO-3 this rank's
    partition), else of the controlled layers (`controlled_params()`)."""
    if torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    params = [p for root in roots for p in root.parameters()] if roots else controlled_params()
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            local = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
            total += 2 * int(local.numel() if local is not None else p.numel()) * p.element_size()
    return total
