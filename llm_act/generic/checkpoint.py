"""Per-block recompute for the repeated blocks of a plain torch model (GACT's CB1).

Megatron's "full" recompute, for models without megatron-core: each block's forward runs
inside a non-reentrant `torch.utils.checkpoint`, so a block keeps only its input for
backward and recomputes the rest, one block at a time. With a codec the kept input (the
checkpoint, site `ln1.input`) is encoded too, and backward recomputes the block from its
decoded copy (GACT sec. 5.5); the activations of the recomputed block are full precision
and live only while that block backpropagates.

How the input gets encoded: the non-reentrant checkpoint saves its tensor inputs through
the saved-tensor hooks active outside it, before installing its own; `checkpoint_blocks`
puts `compress_saved_tensors` there, so exactly the block inputs pass through our hooks
(everything the block saves inside goes to the checkpoint's own, innermost hooks).
Keyword tensor arguments are held by the checkpoint as they are.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from llm_act import ledger as _ledger
from llm_act.generic.hooks import SavedTensorCompression
from llm_act.runtime.seeds import codec_seed
from llm_act.sites import CHECKPOINT_SITE

_MARK = "_llm_act_checkpointed"


class CheckpointHandle:
    """Undoes `checkpoint_blocks`: `.remove()` restores every block's own forward."""

    def __init__(self, blocks: list[torch.nn.Module]):
        self.blocks = blocks
        #: one `SavedTensorCompression` per block (None without a codec); `.stats` per block
        self.hooks: list = []

    def remove(self) -> None:
        for block in self.blocks:
            if getattr(block.__dict__.get("forward"), _MARK, False):
                del block.forward
        self.blocks = []
        self.hooks = []


def checkpoint_blocks(blocks: Iterable[torch.nn.Module], codec: Optional[str] = None, *,
                      first_layer: int = 0, seed: int = 1234,
                      preserve_rng_state: bool = True) -> CheckpointHandle:
    """Wrap each block's forward, in place, in `torch.utils.checkpoint(use_reentrant=False)`.

    `codec`: None keeps each block input as it is (bit-identical gradients); a codec name
    ("int8", "outlier_int4", ...) stores it encoded and recomputes from the decoded copy.
    The ledger counts each block input at (`first_layer` + i, "ln1.input"). Under
    `torch.no_grad()` a block runs as it is. Returns a handle whose `remove()` undoes it.
    """
    blocks = list(blocks)
    if isinstance(first_layer, bool) or not isinstance(first_layer, int) or first_layer < 0:
        raise ValueError(f"first_layer: expected a non-negative int, got {first_layer!r}")
    for i, block in enumerate(blocks):
        if not isinstance(block, torch.nn.Module):
            raise TypeError(f"blocks[{i}]: expected a torch.nn.Module, got {type(block).__name__}")
        if getattr(block.__dict__.get("forward"), _MARK, False):
            raise ValueError(f"blocks[{i}] ({type(block).__name__}) is already checkpointed")
    handle = CheckpointHandle(blocks)
    for i, block in enumerate(blocks):
        layer = first_layer + i
        hooks = None
        if codec is not None:
            # the block input is an activation even when it does not require grad (the
            # model's input), and is encoded whatever its size
            hooks = SavedTensorCompression(block, codec, require_grad=False, min_numel=1,
                                           seed=codec_seed(seed, layer, CHECKPOINT_SITE), layer=layer,
                                           site=CHECKPOINT_SITE)
        handle.hooks.append(hooks)
        block.forward = _wrap(block.forward, hooks, layer, preserve_rng_state)
    return handle


def checkpointed_call(forward, hooks: Optional[SavedTensorCompression], layer: int, *args,
                      preserve_rng_state: bool = True, **kwargs):
    """`forward(*args, **kwargs)` under the non-reentrant checkpoint: its tensor inputs go
    through `hooks` (the block input's codec) or, with None, are kept and counted at
    (`layer`, "ln1.input"); everything else is recomputed in backward."""
    context = hooks if hooks is not None else _ledger.scope(layer, CHECKPOINT_SITE)
    with context:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def _wrap(forward, hooks, layer: int, preserve_rng_state: bool):
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpointed_call(forward, hooks, layer, *args, preserve_rng_state=preserve_rng_state, **kwargs)

    setattr(checkpointed, _MARK, True)
    return checkpointed
