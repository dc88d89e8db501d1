"""The CPU optimizer: fp32 gradient accumulators, the gradient reductions megatron-core's
DDP and `finalize_model_grads` would do, global-norm clipping, and torch AdamW on fp32
master weights.

megatron-core's DDP grad buffers, optimizer and clip_grads hard-code CUDA, so on CPU this
class does their job with plain torch and gloo collectives:
- each parameter gets an fp32 `main_grad`; a post-accumulate-grad hook adds every
  micro-batch's gradient into it (bf16 gradients are never summed in bf16);
- after the last micro-batch: all-reduce (mean) over the data-parallel group; sum over the
  TP group for the sequence-parallel norms' parameters; sum over the embedding group for
  the word embedding that the first and last pipeline stages share;
- the global gradient norm counts a TP-duplicated parameter once (tensor-parallel rank 0)
  and the last stage's copy of the shared embedding not at all, summed over the
  model-parallel group; gradients are scaled by clip / (norm + 1e-6) when that is < 1;
- torch.optim.AdamW (decoupled weight decay, as Megatron's Adam) steps fp32 masters, which
  are copied back into bf16 parameters; biases and 1-D parameters get no weight decay.
A non-finite gradient norm skips the step (reported by `step`).
"""
from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import torch.distributed as dist


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron-LM's default: biases and 1-D parameters (norms) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def scheduler(optimizer: Any, args: argparse.Namespace):
    """megatron-core's OptimizerParamScheduler (linear warmup, then cosine/linear/constant
    decay to --min-lr), stepped once per iteration.

    On resume `check_schedule` refuses a schedule that differs from the checkpoint's
    unless a flag says which one wins, so megatron-core's own check (an assert naming
    internal fields) is left with nothing to catch: it takes the new values under
    --override-opt_param-scheduler and the checkpoint's otherwise."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    override = bool(getattr(args, "override_opt_param_scheduler", False))
    values = scheduler_values(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, **values, end_wd=values["start_wd"], wd_incr_steps=args.train_iters,
        wd_incr_style="constant",
        override_opt_param_scheduler=override, use_checkpoint_opt_param_scheduler=not override,
    )


#: (scheduler state key, the flag that sets it) for every value `check_schedule` compares;
#: weight decay is constant here (start == end), so wd_incr_steps (--train-iters) never
#: changes it and is not compared
SCHEDULE_FLAGS = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "--lr-warmup-iters"),
    ("lr_decay_steps", "--lr-decay-iters"), ("lr_decay_style", "--lr-decay-style"),
    ("start_wd", "--weight-decay"),
)


def check_schedule(saved: dict[str, Any], args: argparse.Namespace, root: str) -> list[str]:
    """Megatron-LM's resume rule for the LR/WD schedule in `saved` (a scheduler state):
    a value that differs from this run's flags is a ValueError naming both values and the
    two flags that settle it, unless one of them is given. Returns the log lines saying
    which schedule is used (empty when nothing differs)."""
    now = scheduler_values(args)
    diff = []
    for key, flag in SCHEDULE_FLAGS:
        if saved.get(key) != now[key]:
            name = flag
            if key == "lr_decay_steps" and getattr(args, "lr_decay_iters_default", False):
                name = "--lr-decay-iters (default: --train-iters)"
            diff.append(f"{name} {saved.get(key)!r} in the checkpoint, {now[key]!r} now")
    if not diff:
        return []
    if getattr(args, "override_opt_param_scheduler", False):
        return ["--override-opt_param-scheduler: using this run's schedule, not the checkpoint's: "
                + "; ".join(diff)]
    if getattr(args, "use_checkpoint_opt_param_scheduler", False):
        return ["--use-checkpoint-opt_param-scheduler: using the checkpoint's schedule, not this "
                "run's flags: " + "; ".join(diff)]
    raise ValueError(
        f"--load {root}: the lr/weight-decay schedule differs from the checkpoint's: "
        + "; ".join(diff) + "; pass --override-opt_param-scheduler to use the new values or "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def scheduler_values(args: argparse.Namespace) -> dict[str, Any]:
    """The schedule this run's flags set: OptimizerParamScheduler's arguments, named as in
    its state (the `SCHEDULE_FLAGS` keys)."""
    return {"max_lr": float(args.lr), "min_lr": args.min_lr, "lr_warmup_steps": args.lr_warmup_iters,
            "lr_decay_steps": args.lr_decay_iters, "lr_decay_style": args.lr_decay_style,
            "start_wd": args.weight_decay}


class CpuOptimizer:
    """See the module docstring. `param_groups` is AdamW's (the scheduler sets lr there)."""

    def __init__(self, chunks: list[torch.nn.Module], args: argparse.Namespace):
        from megatron.core import parallel_state as ps

        self.args = args
        self.params: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        decay, no_decay = [], []
        seen: set[int] = set()
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate)
                master = p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float())
                self.params.append(p)
                self.masters.append(master)
                (no_decay if no_weight_decay(name, p) else decay).append(master)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps, weight_decay=args.weight_decay, foreach=False)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.dp_size = ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.mp_group = ps.get_model_parallel_group()
        self.shared_embedding = self._shared_embedding(chunks, args)

    def _shared_embedding(self, chunks, args):
        """The word embedding that the first and last stage share (megatron marks both
        copies `shared_embedding`), None without pipeline parallelism or when untied."""
        if args.pipeline_model_parallel_size == 1 or args.untie_embeddings_and_output_weights:
            return None
        shared = [p for p in self.params if getattr(p, "shared_embedding", False)]
        return shared[0] if shared else None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None

    def _reduce(self) -> None:
        if self.dp_size > 1:
            for p in self.params:
                dist.all_reduce(p.main_grad, group=self.dp_group)
                p.main_grad.div_(self.dp_size)
        if self.args.sequence_parallel:
            for p in self.params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.main_grad, group=self.tp_group)
        if self.shared_embedding is not None:
            from megatron.core import parallel_state as ps

            dist.all_reduce(self.shared_embedding.main_grad, group=ps.get_embedding_group())

    def grad_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            duplicate = not getattr(p, "tensor_model_parallel", False) and self.tp_rank != 0
            if duplicate or getattr(p, "shared", False):
                continue
            total += p.main_grad.double().square().sum()
        dist.all_reduce(total, group=self.mp_group)
        return math.sqrt(float(total))

    def reload_model_params(self) -> None:
        """Copy the parameters into their fp32 masters after something outside the optimizer
        changed them (megatron-core's name for it): a bf16 parameter's next step would
        otherwise copy the unchanged master back over it."""
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    m.copy_(p)

    def step(self) -> tuple[bool, float]:
        """Reduce, clip, step. Returns (stepped, grad norm before clipping)."""
        self._reduce()
        norm = self.grad_norm()
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm
        if self.args.clip_grad > 0:
            coeff = self.args.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for p in self.params:
                    p.main_grad.mul_(coeff)
        for p, m in zip(self.params, self.masters):
            m.grad = p.main_grad
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                m.grad = None
                if m is not p:
                    p.copy_(m)
        return True, norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [None if m is p else m.detach().clone() for p, m in zip(self.params, self.masters)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                if saved is not None and m is not p:
                    m.copy_(saved)


def _accumulate(p: torch.nn.Parameter) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None
