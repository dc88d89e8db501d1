"""The training loop behind `launch/pretrain_gpt.py`: iterate, log, validate, checkpoint.

One line per `--log-interval` (iteration, lr, loss, grad norm, tokens/s, saved-activation
bytes of one micro-batch -- the largest over ranks -- and the plan), the validation loss
every `--eval-interval` and at the end, checkpoints every `--save-interval` and at the end
(when `--save` is given), then a summary. Output comes from the last rank, which holds the
loss, as in Megatron-LM.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from llm_act.kernels import codec_backend
from llm_act.plan import describe as describe_plan
from llm_act.runtime.agreement import timed
from llm_act.runtime.logs import default_handlers, stderr_line
from llm_act.train import checkpoint, data as data_lib, parallel
from llm_act.train.args import build_parser, check
from llm_act.train.trainer import Trainer

MiB = 2**20


def load_data(args: argparse.Namespace) -> data_lib.TokenData:
    """The token data, with --vocab-size filled in (or checked against the data)."""
    data = data_lib.load(args.data_path[0] if args.data_path else None)
    data.check_fits(args.seq_length)
    if args.vocab_size is None:
        args.vocab_size = data.vocab_size
    elif args.vocab_size < data.vocab_size:
        raise ValueError(f"--vocab-size {args.vocab_size}: the data holds token ids up to "
                         f"{data.vocab_size - 1}")
    return data


def max_over_ranks(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    timed(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), "all_reduce of the saved bytes")
    return int(t.item())


def plan_name(args: argparse.Namespace) -> str:
    return "stock" if args.act_config is None else args.act_config.plan


def describe_run(args: argparse.Namespace, trainer: Trainer, data: data_lib.TokenData) -> list[str]:
    params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
    device = "cuda (megatron-core DDP + optimizer, nccl)" if trainer.cuda else "cpu (gloo, torch AdamW)"
    return [
        data.describe(),
        f"model: GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
        f"heads, seq {args.seq_length}, vocab {args.vocab_size}; {params:,} parameters on this rank; "
        f"{'bf16' if args.bf16 else 'fp32'}",
        f"parallel: TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x "
        f"DP {args.data_parallel_size}{' + SP' if args.sequence_parallel else ''}; global batch "
        f"{args.global_batch_size} = micro-batch {args.micro_batch_size} x {args.num_micro_batches} "
        f"accumulation x DP {args.data_parallel_size}; device {device}",
        f"activations: {'stock megatron-core' if args.act_config is None else args.act_config}",
    ]


def train(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the whole loop on an initialised process group; returns the summary (the
    per-iteration losses are filled on the logging rank only)."""
    data = load_data(args)
    trainer = Trainer(args, data)
    say = log if parallel.is_logging_rank() else (lambda _msg: None)
    with _controller_log(say):
        return _train(args, trainer, data, say)


@contextlib.contextmanager
def _controller_log(say: Callable[[str], None]):
    """llm_act's own log lines (a re-plan with its predicted bytes and reason, a budget or
    noise warning) go to the run's log like the loop's lines; on the other ranks warnings
    still reach stderr."""
    class Say(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if parallel.is_logging_rank():
                say(msg)
            elif record.levelno >= logging.WARNING:
                stderr_line(msg)

    logger = logging.getLogger("llm_act")
    handler, level = Say(logging.INFO), logger.level
    defaults = default_handlers()  # the run log replaces them (no line twice)
    for h in defaults:
        logger.removeHandler(h)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        for h in defaults:
            logger.addHandler(h)
        logger.setLevel(level)


def _train(args: argparse.Namespace, trainer: Trainer, data: data_lib.TokenData,
           say: Callable[[str], None]) -> dict[str, Any]:
    for line in describe_run(args, trainer, data):
        say(line)
    if trainer.controller is not None and trainer.controller.enabled:
        say("plan in force (" + ("'auto' starts from 'compress' and re-plans from iteration 1"
                                 if args.act_config.plan == "auto" else repr(args.act_config.plan))
            + "): " + describe_plan(trainer.controller.plan).replace("\n", "; "))
    if args.load:
        state = checkpoint.load(args.load)
        if state is None:
            say(f"--load {args.load}: no checkpoint there yet, starting from scratch")
        else:
            notes = trainer.load_state_dict(state, args.load, load_optim=not args.no_load_optim,
                                            load_rng=not args.no_load_rng)
            say(f"loaded checkpoint of iteration {trainer.iteration} from {args.load} "
                f"({trainer.consumed_samples} samples consumed)")
            for note in notes:
                say(f" > {note}")
    tokens_per_iter = args.global_batch_size * args.seq_length
    losses: list[float] = []
    first_iter = trainer.iteration
    window_time = total_time = 0.0
    window_iters = 0
    saved: Optional[int] = None
    last_saved_iter = None
    valid_loss = None
    while trainer.iteration < args.train_iters:
        it = trainer.iteration + 1
        measure = it == first_iter + 1 or it % args.ledger_interval == 0
        request_final_fidelity(trainer, it, args.train_iters)
        stats = trainer.train_step(measure=measure)
        if measure:
            saved = max_over_ranks(stats.saved_bytes or 0)
        if stats.loss is not None:
            losses.append(stats.loss)
        window_time += stats.seconds
        window_iters += 1
        if it > first_iter + 1:  # the first iteration pays one-off costs
            total_time += stats.seconds
        if it % args.log_interval == 0 or it == args.train_iters:
            loss_txt = f"{stats.loss:.6E}" if stats.loss is not None else "n/a"
            say(f" iteration {it:8d}/{args.train_iters:8d} | consumed samples: "
                f"{trainer.consumed_samples:10d} | lr: {stats.lr:.4E} | lm loss: {loss_txt} | "
                f"grad norm: {stats.grad_norm:.3f} | tokens/s: {tokens_per_iter * window_iters / window_time:9.1f} | "
                f"saved activations: {_mib(saved)} MiB/micro-batch | plan: {plan_name(args)}"
                + ("" if stats.stepped else " | step skipped (non-finite gradient)"))
            window_time, window_iters = 0.0, 0
        if args.eval_interval and it % args.eval_interval == 0 and it != args.train_iters:
            valid_loss = trainer.evaluate()
            _log_valid(say, it, valid_loss)
        if args.save and args.save_interval and it % args.save_interval == 0:
            checkpoint.save(args.save, it, trainer.state_dict())
            last_saved_iter = it
            say(f"saved checkpoint of iteration {it} to {args.save}")
    valid_loss = trainer.evaluate()
    _log_valid(say, trainer.iteration, valid_loss)
    if args.save and last_saved_iter != trainer.iteration:
        checkpoint.save(args.save, trainer.iteration, trainer.state_dict())
        say(f"saved checkpoint of iteration {trainer.iteration} to {args.save}")
    timed = trainer.iteration - first_iter - 1
    tps = tokens_per_iter * timed / total_time if timed > 0 and total_time > 0 else float("nan")
    adapter = trainer.controller.adapter if trainer.controller is not None else None
    summary = {
        "iterations": trainer.iteration, "losses": losses,
        "final_loss": losses[-1] if losses else None, "valid_loss": valid_loss,
        "tokens_per_s": tps, "saved_bytes": saved, "plan": plan_name(args),
        "sha256": data.sha256, "trainer": trainer,
        "solver_failures": adapter.solver_failures if adapter is not None else 0,
    }
    if losses:
        say(f"summary: {trainer.iteration} iterations ({trainer.iteration - first_iter} run now), "
            f"lm loss {losses[0]:.4f} -> {losses[-1]:.4f}, validation loss "
            f"{'n/a' if valid_loss is None else f'{valid_loss:.4f}'}, {_rate(tps)}, saved "
            f"activations {_mib(saved)} MiB/micro-batch (largest rank), plan {plan_name(args)}, "
            f"corpus sha256 {data.sha256[:16]}"
            + ("" if args.act_config is None else f"; {codec_backend(parallel.device())}"))
        if adapter is not None and adapter.active:
            say(f"summary: {adapter.summary()}")
        elif adapter is not None and trainer.controller.enabled:
            fidelity = f"{adapter.measured.fidelity[-1].format()}; " if adapter.measured.fidelity else ""
            say(f"summary: {fidelity}{adapter.overflow_text()}")
        if adapter is not None and adapter.measured.fidelity:
            summary["noise_ratio"] = adapter.measured.fidelity[-1].noise_ratio
            summary["fidelity"] = adapter.measured.fidelity[-1].total
    return summary


def request_final_fidelity(trainer: Trainer, it: int, last: int) -> bool:
    """Before iteration `it` of `last`: ask the run's last iteration for a gradient-fidelity
    report (with its gradient-noise ratio, for the summary) when compression is on, reports
    are not turned off (`fidelity_every` 0: on request only) and none is scheduled there
    anyway. Returns whether it asked."""
    c = trainer.controller
    ask = (it == last and c is not None and c.enabled and c.config.fidelity_every > 0
           and c.adapter.measured.measurable and not c.adapter.measured.fidelity_due())
    if ask:
        c.request_fidelity()
    return ask


def _rate(tps: float) -> str:
    """Tokens/s of the timed iterations; the first pays one-off costs and is not timed."""
    return f"{tps:.1f} tokens/s" if math.isfinite(tps) else "tokens/s n/a (needs 2 or more iterations)"


def _mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / MiB:.3f}"


def _log_valid(say: Callable[[str], None], it: int, loss: Optional[float]) -> None:
    if loss is None:
        say(f" validation loss at iteration {it}: n/a (empty validation split or --eval-iters 0)")
    else:
        say(f" validation loss at iteration {it}: {loss:.6E} | ppl: {math.exp(min(loss, 50)):.3f}")


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's warnings that say nothing to a CPU run (no apex / TE, CUDA
    connection hints, a deprecated config default it sets itself)."""
    import warnings

    for pattern in (r".*(Apex|Transformer Engine).*", r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
                    r".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`pretrain_gpt.py` / `torchrun ... pretrain_gpt.py`: parse, init, train, tear down."""
    quiet_megatron_warnings()
    parser = build_parser()
    args = check(parser, parser.parse_args(argv), parallel.world_size())
    try:
        parallel.init(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        train(args, log=lambda msg: print(msg, flush=True))
    except (ValueError, FileNotFoundError, NotImplementedError) as err:  # user errors: one line
        stderr_line(f"{parser.prog}: error: {err}")
        return 2
    finally:
        parallel.destroy_parallel()
    return 0
