"""The training loop's command line: Megatron-LM's flag names, plus `--act-compress*`.

Names and meanings follow Megatron-LM's `arguments.py` so a command line moves between
the two; only the subset this loop implements is accepted (argparse rejects the rest),
and `allow_abbrev=False` as in Megatron-LM. `parse_args` also checks the combinations
(divisibility of heads, batch sizes, ...) and reports them through `parser.error`, so
every bad command line ends with the usage line and exit code 2.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from llm_act.patches.megatron import compat
from llm_act.patches.megatron.args import add_arguments, config_from_args


def build_parser(prog: str = "pretrain_gpt.py", add_help: bool = True) -> argparse.ArgumentParser:
    """The loop's parser (`add_help=False`: for use as an argparse parent)."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False, add_help=add_help,
                                description="GPT pretraining on megatron-core (llm_act's loop; "
                                            "CPU with gloo, or GPUs with NCCL)")
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None,
                   help="grouped-query attention (sets --group-query-attention)")
    m.add_argument("--group-query-attention", action="store_true")
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--hidden-dropout", type=float, default=0.1)
    m.add_argument("--attention-dropout", type=float, default=0.1)
    m.add_argument("--vocab-size", type=int, default=None,
                   help="default: 256 for byte-level data, max token id + 1 for an indexed dataset")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

    par = p.add_argument_group("parallelism and precision")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--bf16", action="store_true")
    par.add_argument("--fp16", action="store_true", help="not supported (rejected)")
    par.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None,
                     help="default: nccl with CUDA, gloo without")
    par.add_argument("--seed", type=int, default=1234)

    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=4)
    t.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch-size x data-parallel size (no accumulation)")
    t.add_argument("--train-iters", type=int, default=40)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--min-lr", type=float, default=0.0)
    t.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"), default="cosine")
    t.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    t.add_argument("--lr-warmup-iters", type=int, default=0)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--adam-beta1", type=float, default=0.9)
    t.add_argument("--adam-beta2", type=float, default=0.999)
    t.add_argument("--adam-eps", type=float, default=1e-8)
    t.add_argument("--clip-grad", type=float, default=1.0, help="0 turns clipping off")

    d = p.add_argument_group("data")
    d.add_argument("--data-path", nargs="+", default=None,
                   help="a text file (byte-level) or the prefix of a Megatron indexed dataset "
                        "(prefix.bin + prefix.idx); default: the embedded stdlib corpus")

    new = p.add_argument_group(
        "megatron-core 0.17-0.19 options", "Megatron-LM's flags for options the compressed layers do not "
        "implement: passed to megatron-core in a stock run, refused with --act-compress")
    for flag in compat.GTP_SHARD_FLAGS.values():
        new.add_argument(flag, type=int, default=None, metavar="N",
                         help="weight shards over the TP and GTP axes (default: the TP size)")
    for name, flag in compat.NEW_OPTION_FLAGS.items():
        off = compat.NEW_OPTIONS[name]
        if isinstance(off, bool):
            new.add_argument(flag, dest=name, action="store_true")
        else:
            new.add_argument(flag, dest=name, type=int, default=off, metavar="N")

    io = p.add_argument_group("checkpointing and logging")
    io.add_argument("--save", default=None)
    io.add_argument("--load", default=None)
    io.add_argument("--save-interval", type=int, default=None)
    io.add_argument("--no-load-optim", action="store_true")
    io.add_argument("--no-load-rng", action="store_true")
    io.add_argument("--override-opt_param-scheduler", action="store_true",
                    help="on --load, use this run's --lr/--min-lr/--lr-warmup-iters/--lr-decay-iters/"
                         "--lr-decay-style/--weight-decay instead of the checkpoint's schedule")
    io.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                    help="on --load, keep the checkpoint's schedule (without either flag a "
                         "schedule that differs from the checkpoint's is an error)")
    io.add_argument("--eval-interval", type=int, default=1000)
    io.add_argument("--eval-iters", type=int, default=2)
    io.add_argument("--log-interval", type=int, default=10)
    io.add_argument("--ledger-interval", type=int, default=None,
                    help="measure saved-activation bytes every N iterations (default --log-interval)")
    return add_arguments(p)


def _positive(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")


def check(p: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Validate combinations and fill the derived values (data_parallel_size, ...)."""
    if args.fp16:
        p.error("--fp16: not supported (fp16 needs a loss scaler this loop does not have on CPU); "
                "use --bf16 or fp32")
    _positive(p, args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size", "global_batch_size", "train_iters", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "log_interval", "eval_interval", "save_interval",
              "ffn_hidden_size", "num_query_groups", "vocab_size", "ledger_interval",
              "make_vocab_size_divisible_by", "lr_decay_iters")
    if args.eval_iters < 0 or args.lr_warmup_iters < 0:
        p.error("--eval-iters / --lr-warmup-iters: expected >= 0")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            p.error(f"--{name.replace('_', '-')}: expected a probability in [0, 1), got {getattr(args, name)}")
    if args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        p.error(f"--lr / --min-lr: need 0 <= min-lr <= lr and lr > 0, got lr={args.lr} min-lr={args.min_lr}")
    if args.hidden_size % args.num_attention_heads:
        p.error(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                f"{args.num_attention_heads}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        p.error(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} does not "
                f"divide the world size {world_size}")
    if args.num_attention_heads % tp:
        p.error(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        p.error(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron-LM does the same: SP needs TP > 1
    if args.sequence_parallel and args.seq_length % tp:
        p.error(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                f"--tensor-model-parallel-size {tp}")
    args.data_parallel_size = world_size // (tp * pp)
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        p.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
    args.num_micro_batches = args.global_batch_size // per_step
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        p.error(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length {args.seq_length}")
    if args.num_query_groups is not None:
        args.group_query_attention = True
        if args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp:
            p.error(f"--num-query-groups {args.num_query_groups}: must divide --num-attention-heads "
                    f"and be divisible by --tensor-model-parallel-size")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        p.error("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give at "
                "most one (use this run's schedule, or the checkpoint's)")
    args.lr_decay_iters_default = args.lr_decay_iters is None  # named so in resume errors
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters >= args.lr_decay_iters:
        p.error(f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters "
                f"(default --train-iters) {args.lr_decay_iters}")
    if args.data_path is not None and len(args.data_path) != 1:
        p.error(f"--data-path: this loop reads one dataset (no blending), got {len(args.data_path)} entries")
    if args.save_interval is not None and args.save is None:
        p.error("--save-interval: needs --save DIR")
    if args.ledger_interval is None:
        args.ledger_interval = args.log_interval
    _check_new_options(p, args)
    try:
        args.act_config = config_from_args(args)
    except ValueError as err:
        p.error(str(err))
    return args


def _check_new_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A newer megatron-core's option: known to the installed one, and refused with
    --act-compress in the library's one line (`unsupported.check_new_options`)."""
    from llm_act.patches.megatron.unsupported import check_new_options

    tp = args.tensor_model_parallel_size
    for name, flag in compat.GTP_SHARD_FLAGS.items():  # Megatron-LM's rule: remat = shards / TP
        shards = getattr(args, flag[2:].replace("-", "_"))
        if shards is not None and (shards < tp or shards % tp):
            p.error(f"{flag} {shards}: must be a multiple of --tensor-model-parallel-size {tp}")
        setattr(args, name, 1 if shards is None else shards // tp)
    for name, flag in {**compat.GTP_SHARD_FLAGS, **compat.NEW_OPTION_FLAGS}.items():
        value = getattr(args, name)
        if value != compat.NEW_OPTIONS[name] and not compat.has_option(name):
            from megatron.core import __version__

            p.error(f"{flag}: the installed megatron-core {__version__} has no option {name} "
                    f"(megatron-core 0.17 or newer has); drop the flag")
    if args.act_compress:
        try:
            check_new_options(args)
        except NotImplementedError as err:  # a refusal, not a syntax error: the line alone
            p.exit(2, f"{p.prog}: error: {err}\n")


def parse_args(argv: Optional[Sequence[str]] = None, world_size: int = 1,
               prog: str = "pretrain_gpt.py") -> argparse.Namespace:
    """Parse and check `argv` for a run over `world_size` ranks (SystemExit(2) when bad)."""
    p = build_parser(prog)
    return check(p, p.parse_args(argv), world_size)
