"""The GPU branch: megatron-core's own DDP, optimizer and gradient finalisation (NCCL).

Ran on an H200 on 2026-11-26 through tools/gpu_suite.sh (10 iterations of
`launch/pretrain_gpt.py` under torchrun on one GPU, without and with `--act-compress`;
docs/benchmarks.md section 4). megatron-core's
training stack needs CUDA, so this module only runs where `torch.cuda.is_available()` and
no CPU test reaches it. It follows what Megatron-LM's
`training.py` does for a non-distributed optimizer: each chunk (in a Float16Module under
bf16) goes into `DistributedDataParallel` with fp32 grad buffers; the schedule's
`no_sync_func` / `finalize_model_grads_func` / `grad_scale_func` hooks come from the DDP
wrappers and the optimizer; `get_megatron_optimizer` builds Adam with fp32 main weights and
clips gradients itself. `GpuOptimizer` gives it the CPU optimizer's interface
(`zero_grad`, `step -> (stepped, grad norm)`, `param_groups`, `state_dict`).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch


def wrap(chunks: list[torch.nn.Module], tconfig: Any) -> list[torch.nn.Module]:
    """megatron-core DDP around each chunk (already in a Float16Module under bf16, see
    model.build); wires the schedule hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    wrapped = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    for c in wrapped:
        c.broadcast_params()  # identical replicas across data-parallel ranks
    tconfig.no_sync_func = wrapped[0].no_sync if len(wrapped) == 1 else [c.no_sync for c in wrapped]
    tconfig.finalize_model_grads_func = finalize_model_grads
    return wrapped


class GpuOptimizer:
    """megatron-core's optimizer behind the CPU optimizer's interface."""

    def __init__(self, chunks: list[torch.nn.Module], tconfig: Any, args: argparse.Namespace):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=tconfig.params_dtype,
            use_distributed_optimizer=False,
        )
        self.chunks = chunks
        self.optimizer = get_megatron_optimizer(config, chunks)
        tconfig.grad_scale_func = self.optimizer.scale_loss

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        # the schedule already ran finalize_model_grads (DP all-reduce, SP norms, embeddings)
        stepped, grad_norm, _ = self.optimizer.step()
        return bool(stepped), float("nan") if grad_norm is None else float(grad_norm)

    def reload_model_params(self) -> None:
        self.optimizer.reload_model_params()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
