"""Checkpoints: one `torch.save` file per rank, laid out like Megatron-LM's legacy format.

`<dir>/iter_0000010/mp_rank_<tp:02d>_<pp:03d>_<dp:03d>/model_optim_rng.pt` holds this
rank's model chunks, optimizer (with fp32 masters), LR scheduler, iteration, data position
(samples consumed), every RNG state (megatron's tracker included) and the act Controller's
state; `<dir>/latest_checkpointed_iteration.txt` names the newest complete one (written by
rank 0 after every rank has saved). megatron-core's `dist_checkpointing` needs CUDA, so
this format is used on every device; a checkpoint resumes only with the same parallel
layout and model shape (checked, with a ValueError naming what differs); turning
`--act-compress` on or off between runs is allowed (the parameters are the same).
As in Megatron-LM, an lr/weight-decay schedule flag that differs from the checkpoint's is
refused unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler says
which wins (`optim.check_schedule`); the `--act-compress-*` flags given now win over the
saved controller state (`Controller.load_state_dict` says what it restored).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from llm_act.runtime.agreement import timed

TRACKER = "latest_checkpointed_iteration.txt"
VERSION = 1
#: flags that must agree between the run that saved and the run that loads
SHAPE_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "seq_length", "vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "data_parallel_size", "sequence_parallel", "bf16", "swiglu", "normalization",
    "position_embedding_type", "untie_embeddings_and_output_weights", "disable_bias_linear",
)


def rank_dir(root: str, iteration: int) -> str:
    from megatron.core import parallel_state as ps

    return os.path.join(
        root, f"iter_{iteration:07d}",
        f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}_"
        f"{ps.get_pipeline_model_parallel_rank():03d}_{ps.get_data_parallel_rank():03d}",
    )


def save(root: str, iteration: int, state: dict[str, Any]) -> str:
    """Write this rank's `state` for `iteration`; returns the file. Collective (barrier)."""
    path = os.path.join(rank_dir(root, iteration), "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"version": VERSION, "iteration": iteration, **state}, path + ".tmp")
    os.replace(path + ".tmp", path)
    if dist.is_initialized():
        timed(lambda: dist.barrier(async_op=True), f"the barrier after saving iteration {iteration}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
            f.write(f"{iteration}\n")
        os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))
    if dist.is_initialized():
        timed(lambda: dist.barrier(async_op=True), f"the barrier after naming iteration {iteration}")
    return path


def latest_iteration(root: str) -> Optional[int]:
    """The iteration named by the tracker file, None when `root` holds no checkpoint."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration") from None


def load(root: str) -> Optional[dict[str, Any]]:
    """This rank's newest checkpoint under `root`, or None when there is none yet."""
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = os.path.join(rank_dir(root, iteration), "model_optim_rng.pt")
    if not os.path.exists(path):
        raise ValueError(f"--load {root}: iteration {iteration} has no file for this rank ({path}); "
                         "was it saved with another parallel layout?")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("version") != VERSION:
        raise ValueError(f"--load {root}: {path} is not a checkpoint of this loop (version "
                         f"{state.get('version')!r})")
    return state


def shape_args(args: Any) -> dict[str, Any]:
    return {k: getattr(args, k, None) for k in SHAPE_KEYS}


def check_compatible(saved: dict[str, Any], args: Any, root: str) -> None:
    now = shape_args(args)
    diff = [f"--{k.replace('_', '-')} saved {saved.get(k)!r}, now {v!r}"
            for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise ValueError(f"--load {root}: the checkpoint does not match this run: " + "; ".join(diff))
