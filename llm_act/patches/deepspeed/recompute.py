"""Per-block recompute of generic blocks, through DeepSpeed's activation checkpointing if set.

Without `"activation_checkpointing"` in the DeepSpeed config, blocks are recomputed with
`llm_act.generic.hooks.checkpoint_blocks` (torch's non-reentrant checkpoint; the block input may be
encoded, GACT's CB1). With it, each block runs under `deepspeed.checkpointing.checkpoint`,
so `partition_activations` and `cpu_checkpointing` keep working on the block inputs.

What cannot work is refused with a ValueError naming the keys:
- DeepSpeed's checkpoint holds the block inputs itself (as autograd-context attributes,
  split or moved to CPU), out of reach of saved-tensor hooks, so the block input
  (`codecs["ln1.input"]`) cannot also be compressed;
- `cpu_checkpointing` or `partition_activations` on DeepSpeed's CPU accelerator: in
  DeepSpeed 0.19 the offload path empties the saved block inputs there (recompute fails on
  a 0-d tensor) and the partitioned path hands blocks with keyword arguments their inputs
  flattened; both work as intended only on GPUs;
- `contiguous_memory_optimization` preallocates `number_checkpoints` buffers: fewer than
  the recomputed blocks would overflow them, and it needs `partition_activations`.

`checkpointed_forward` is the one wrapper both doors use: these generic blocks and
megatron-core `TransformerLayer`s (`megatron_recompute`). DeepSpeed's `CheckpointFunction`
replays the default CPU and device generators and its *own* RNG tracker; a model that draws
dropout from another tracker (megatron's) passes `rng=(capture, replay)` so that tracker is
replayed too and the recomputed block draws the masks of its forward.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llm_act import ledger as _ledger
from llm_act.codecs.registry import KEEP
from llm_act.generic.checkpoint import checkpoint_blocks
from llm_act.sites import CHECKPOINT_SITE

_MARK = "_llm_act_checkpointed"


def check(checkpointing: Any, ckpt_codec: str, num_blocks: int) -> None:
    """Refuse combinations of our recompute and DeepSpeed's checkpointing that cannot work."""
    if checkpointing is None or not checkpointing.configured:
        return
    if ckpt_codec != KEEP:
        raise ValueError(
            f"activation_compression.codecs['ln1.input'] = {ckpt_codec!r} cannot be combined with "
            "activation_checkpointing: recomputation then goes through deepspeed.checkpointing, "
            "which stores each block input itself (partitioned or on CPU as configured), out of "
            "reach of llm_act's codecs. Set codecs['ln1.input'] to 'keep', or remove "
            "activation_checkpointing from the DeepSpeed config to compress the block inputs"
        )
    if checkpointing.contiguous_memory_optimization:
        if not checkpointing.partition_activations:
            raise ValueError(
                "activation_checkpointing.contiguous_memory_optimization needs "
                "activation_checkpointing.partition_activations = true"
            )
        n = checkpointing.number_checkpoints
        if n is None or n < num_blocks:
            raise ValueError(
                f"activation_checkpointing.number_checkpoints = {n!r}: llm_act recomputes "
                f"{num_blocks} blocks, and contiguous_memory_optimization needs at least one "
                "buffer per recomputed block"
            )


def configure(checkpointing: Any, mpu: Any = None) -> None:
    """Configure `deepspeed.checkpointing` from the settings (unless the user already did)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if checkpointing.stores_checkpoints and get_accelerator().device_name() == "cpu":
        raise ValueError(
            "activation_checkpointing.cpu_checkpointing / partition_activations: on DeepSpeed's "
            "CPU accelerator (0.19) these lose or flatten the block inputs that recomputation "
            "starts from; drop them on CPU (they apply to GPU runs)"
        )
    if deepspeed.checkpointing.is_configured():
        return
    deepspeed.checkpointing.configure(
        mpu,
        partition_activations=checkpointing.partition_activations,
        contiguous_checkpointing=checkpointing.contiguous_memory_optimization,
        num_checkpoints=checkpointing.number_checkpoints,
        checkpoint_in_cpu=checkpointing.cpu_checkpointing,
    )


def wrap_blocks(blocks: list[torch.nn.Module], codec: Optional[str], checkpointing: Any,
                seed: int = 1234, mpu: Any = None) -> None:
    """Recompute every block in backward (see the module docstring)."""
    if checkpointing is None or not checkpointing.configured:
        checkpoint_blocks(blocks, codec, seed=seed)
        return
    check(checkpointing, codec or KEEP, len(blocks))
    configure(checkpointing, mpu)
    for i, block in enumerate(blocks):
        if getattr(block.__dict__.get("forward"), _MARK, False):
            raise ValueError(f"blocks[{i}] ({type(block).__name__}) is already checkpointed")
        block.forward = checkpointed_forward(block.forward, i)


def is_checkpointed(forward: Any) -> bool:
    """Whether `forward` is a `checkpointed_forward` wrapper."""
    return bool(getattr(forward, _MARK, False))


def checkpointed_forward(forward, layer: int, rng: Optional[tuple] = None):
    """`forward` run under `deepspeed.checkpointing.checkpoint` when grad is on.

    The first tensor argument (the block input, which DeepSpeed keeps outside autograd) is
    counted in active ledgers at (`layer`, "ln1.input"). `rng`: `(capture, replay)` for RNG
    state DeepSpeed does not replay itself: `capture()` is called when the forward runs,
    and the recomputation runs inside `replay(captured)` (a context manager that restores
    the states in force on exit).
    """
    import deepspeed

    def checkpointed(*args: Any, **kwargs: Any):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None:  # DeepSpeed holds it outside autograd: count it here
            _ledger.report(layer, CHECKPOINT_SITE, first, first.numel() * first.element_size())
        if rng is None:
            return deepspeed.checkpointing.checkpoint(forward, *args, **kwargs)
        capture, replay = rng
        captured: list = []

        def run(*a: Any, **k: Any):
            if not captured:  # the forward, under no_grad inside CheckpointFunction
                captured.append(capture())
                return forward(*a, **k)
            with replay(captured[0]):  # the recomputation in backward
                return forward(*a, **k)

        return deepspeed.checkpointing.checkpoint(run, *args, **kwargs)

    setattr(checkpointed, _MARK, True)
    return checkpointed
