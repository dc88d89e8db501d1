"""`Trainer`: one model, its optimizer and data position, and one training iteration.

An iteration runs the global batch through megatron-core's schedule
(`get_forward_backward_func`: 1F1B under pipeline parallelism, plain accumulation
otherwise) as `num_micro_batches` micro-batches, then the optimizer step and the LR
schedule; with `--act-compress` the iteration runs inside `controller.step()`, so plans
switch only between iterations; plan "auto" measures from the training steps themselves
(`llm_act.measurement.replay`), on every pipeline stage. On iterations asked to measure, the first micro-batch's
forward runs inside a `SavedTensorLedger`, giving the bytes it leaves for backward per
(layer, site). The loop (`loop.py`) and `llm-act train` (`compare.py`) drive Trainers.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from llm_act.ledger import SavedTensorLedger
from llm_act.runtime.agreement import timed
from llm_act.train import checkpoint, gpu, model as model_lib, optim, rng
from llm_act.train.data import Batch, Samples, TokenData, micro_batch


@dataclass
class StepStats:
    loss: Optional[float]  # mean per-token loss of the global batch (None off the last stage)
    grad_norm: float
    lr: float
    seconds: float
    stepped: bool
    saved_bytes: Optional[int]  # this rank's first micro-batch, when measured


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float()
    total = (losses * loss_mask).sum()
    count = loss_mask.sum()
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count])}


class Trainer:
    """See the module docstring. Needs the process group and parallel state (`parallel.init`)."""

    def __init__(self, args: argparse.Namespace, data: TokenData):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.args = args
        self.cuda = torch.cuda.is_available()
        rng.seed_all(args.seed)
        self.chunks, self.tconfig, self.controller = model_lib.build(args, args.act_config)
        if self.cuda:  # megatron-core's DDP and optimizer (see gpu.py; untested here)

            self.chunks = gpu.wrap(self.chunks, self.tconfig)
            self.optimizer: Any = gpu.GpuOptimizer(self.chunks, self.tconfig, args)
        else:
            self.optimizer = optim.CpuOptimizer(self.chunks, args)
        self.scheduler = optim.scheduler(self.optimizer, args)
        self.train_samples = Samples(data.train, args.seq_length, args.seed, shuffle=True)
        self.valid_samples = Samples(data.valid, args.seq_length, args.seed, shuffle=False)
        self.iteration = 0
        self.consumed_samples = 0
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_group = ps.get_data_parallel_group()
        self.last_stage = ps.is_pipeline_last_stage()
        self.forward_backward = get_forward_backward_func()
        self.ledger = None  # the last SavedTensorLedger measurement
        self._measure_next = False
        # plan "auto" measures from the training steps (`Controller.watch`, installed by
        # `apply`): the same way on one stage and under pipeline parallelism

    # ---- one iteration ---------------------------------------------------------------
    def _batches(self, samples: Samples, start: int) -> list[Batch]:
        a = self.args
        return [micro_batch(samples, start, i, a.micro_batch_size, self.dp_rank, a.data_parallel_size)
                for i in range(a.num_micro_batches)]

    def _forward_step(self, data_iterator, model):
        batch: Batch = next(data_iterator)
        if self.cuda:
            batch = Batch(*(t.cuda(non_blocking=True) for t in
                            (batch.tokens, batch.labels, batch.loss_mask, batch.position_ids)))
        run = functools.partial(model, batch.tokens, batch.position_ids, None, labels=batch.labels)
        if self._measure_next:
            self._measure_next = False
            self.ledger = SavedTensorLedger()
            with self.ledger:
                output = run()
        else:
            output = run()
        return output, functools.partial(_loss_func, batch.loss_mask)

    def _run_schedule(self, batches: list[Batch], forward_only: bool):
        a = self.args
        return self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iter(batches), model=self.chunks,
            num_microbatches=len(batches), seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size, forward_only=forward_only)

    def _mean_loss(self, losses: list[dict]) -> Optional[float]:
        """Per-token mean over the micro-batches and the data-parallel group (last stage)."""
        if not self.last_stage:
            return None
        pair = torch.stack([d["lm loss"].float().cpu() for d in losses]).sum(0)
        if self.args.data_parallel_size > 1:
            timed(lambda: dist.all_reduce(pair, group=self.dp_group, async_op=True),
                  "all_reduce of the loss", self.dp_group)
        return float(pair[0] / pair[1])

    def train_step(self, measure: bool = False) -> StepStats:
        """One iteration over the next global batch; `measure`: ledger the first micro-batch."""
        start = time.perf_counter()
        step = self.controller.step() if self.controller is not None else contextlib.nullcontext()
        self.ledger = None if measure else self.ledger
        self._measure_next = measure
        lr = float(self.optimizer.param_groups[0]["lr"])
        with step:
            self.optimizer.zero_grad()
            losses = self._run_schedule(self._batches(self.train_samples, self.consumed_samples), False)
            stepped, norm = self.optimizer.step()
            if stepped:
                self.scheduler.step(1)
        self.iteration += 1
        self.consumed_samples += self.args.global_batch_size
        seconds = time.perf_counter() - start
        saved = self.ledger.total_bytes if measure and self.ledger is not None else None
        return StepStats(self._mean_loss(losses), norm, lr, seconds, stepped, saved)

    def evaluate(self) -> Optional[float]:
        """Mean per-token validation loss over --eval-iters global batches (always the same
        ones); None when the validation split holds no sample or --eval-iters is 0."""
        a = self.args
        need = a.global_batch_size
        if a.eval_iters == 0 or len(self.valid_samples) == 0:
            return None
        for c in self.chunks:
            c.eval()
        pairs = []
        try:
            with torch.no_grad():
                for k in range(a.eval_iters):
                    losses = self._run_schedule(self._batches(self.valid_samples, k * need), True)
                    if self.last_stage:
                        pairs.append(torch.stack([d["lm loss"].float().cpu() for d in losses]).sum(0))
        finally:
            for c in self.chunks:
                c.train()
        if not self.last_stage:
            return None
        pair = torch.stack(pairs).sum(0)
        if a.data_parallel_size > 1:
            timed(lambda: dist.all_reduce(pair, group=self.dp_group, async_op=True),
                  "all_reduce of the validation loss", self.dp_group)
        return float(pair[0] / pair[1])

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "args": checkpoint.shape_args(self.args),
            "model": [c.state_dict() for c in self.chunks],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "consumed_train_samples": self.consumed_samples,
            "rng": rng.get_state(),
            "act_controller": None if self.controller is None else self.controller.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], root: str = "checkpoint",
                        load_optim: bool = True, load_rng: bool = True) -> list[str]:
        """Resume from `state` (`checkpoint.load`); returns the lines that say what of it was
        used and what this run's flags replaced. Every check (layout, schedule) runs before
        anything is changed, and each rank decides from the same flags and its own file, so a
        refused checkpoint raises the same ValueError on every rank (no collective here)."""
        checkpoint.check_compatible(state["args"], self.args, root)
        notes = optim.check_schedule(state["scheduler"], self.args, root) if load_optim else []
        for c, sd in zip(self.chunks, state["model"]):
            c.load_state_dict(sd)
        if load_optim:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        else:
            self.scheduler.step(int(state["iteration"]))
            self.optimizer.reload_model_params()  # the fp32 masters must follow the loaded weights
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_train_samples"])
        if load_rng:
            rng.set_state(state["rng"])
        if self.controller is not None:
            if state.get("act_controller") is not None:
                notes += self.controller.load_state_dict(state["act_controller"])
            else:  # saved without --act-compress: the plan of the flags, from this iteration
                self.controller.iteration = self.iteration
                notes.append(f"act controller: the checkpoint has none (saved without --act-compress); "
                             f"starting at iteration {self.iteration} with the plan of this run's flags")
        return notes
