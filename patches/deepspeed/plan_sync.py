"""Every rank runs rank 0's plan: a broadcast before each plan switch point.

Under ZeRO-3 a recomputed block gathers its parameters again in backward, and every rank
must take part in each gather: two ranks with different plans (say one recomputes a block
the other keeps) hang. Plans may be chosen from local statistics (each rank sees its own
data), so before the controller may switch plans -- when it is created and at every
optimizer step boundary -- rank 0's plan (the pending one if it asked for a switch, else
the one in force) is broadcast and every other rank asks its controller for exactly that.
The cost is one small object broadcast per optimizer step.
"""
from __future__ import annotations

from typing import Any, Optional


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def target_plan(controller: Any) -> Optional[dict]:
    """The plan this rank's controller will run from the next iteration on."""
    pending = controller.pending_plan
    return pending if pending is not None else controller.plan


def agree(controller: Any, group: Any = None) -> bool:
    """Make every rank's controller head for rank 0's plan; True when this rank changed.

    Collective: every rank of `group` (default: the world) must call it at the same point.
    A no-op on one rank or with a disabled controller (all ranks agree on that, since they
    read the same config).
    """
    rank, world = _world()
    if world == 1 or controller is None or not controller.enabled:
        return False
    import torch.distributed as dist

    src = 0 if group is None else dist.get_global_rank(group, 0)
    payload = [target_plan(controller) if rank == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    wanted = payload[0]
    if rank == src or wanted == target_plan(controller):
        return False
    controller.set_plan(wanted)
    return True
