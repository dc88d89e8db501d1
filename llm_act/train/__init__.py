"""llm_act's GPT training loop on megatron-core (the torchrun door, and `llm-act train`).

megatron-core's training stack (DDP grad buffers, optimizer, clip_grads,
dist_checkpointing) needs CUDA, so on CPU this loop does that part itself: gloo, torch
AdamW on fp32 masters, a plain gradient all-reduce, its own clipping, `torch.save` per
rank. On a GPU it uses megatron-core's DDP and optimizer with NCCL. The model, the
parallel layers and the 1F1B schedule are megatron-core's own everywhere.

Files: args (flags), data (corpus, samples), model (GPTModel + apply), optim (CPU
optimizer, LR schedule), gpu (the CUDA branch), rng, checkpoint, parallel (process
groups), trainer (one iteration), loop (the loop, `main`), compare (`llm-act train`); ds_train (the
DeepSpeed run behind launch/ds_train.py).
"""
from __future__ import annotations


def main(argv=None) -> int:
    from llm_act.train.loop import main as _main

    return _main(argv)


__all__ = ["main"]
