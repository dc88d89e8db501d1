"""`llm-act train`: the stock and compressed runs side by side (`llm_act.train.compare`),
with every flag of the training loop and demo-sized defaults."""
from __future__ import annotations

import argparse

from llm_act.cli.parsing import fail
from llm_act.train import compare
from llm_act.train.args import build_parser, check
from llm_act.train.loop import quiet_megatron_warnings


def add_parser(sub) -> argparse.ArgumentParser:
    """The `llm-act train` subcommand: every flag of the loop, demo-sized defaults."""
    p = sub.add_parser("train", help="stock vs compressed training side by side on CPU (table + plot)",
                       parents=[build_parser("llm-act train", add_help=False)],
                       allow_abbrev=False, description=compare.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=compare.OUTPUT_DIR,
                   help=f"where the run's outputs (the plot) go; created if missing (default: {compare.OUTPUT_DIR})")
    p.set_defaults(train_iters=40, lr=2e-3, min_lr=2e-4, lr_warmup_iters=None, log_interval=10,
                   eval_iters=4, hidden_size=128, num_layers=2, seq_length=128, micro_batch_size=4,
                   train_parser=p)
    return p


def main(args: argparse.Namespace) -> int:
    """Entry from `llm-act train`: the compressed run always has --act-compress (plan
    "compress" unless --act-compress-plan says otherwise)."""
    parser = args.train_parser
    quiet_megatron_warnings()
    if args.tensor_model_parallel_size * args.pipeline_model_parallel_size != 1:
        parser.error("--tensor-model-parallel-size / --pipeline-model-parallel-size: llm-act train "
                     "compares two runs in one process; run launch/pretrain_gpt.py under torchrun "
                     "for tensor or pipeline parallelism")
    if args.lr_warmup_iters is None:  # demo default: 4, fewer for a run too short for 4
        args.lr_warmup_iters = max(0, min(4, (args.lr_decay_iters or args.train_iters) - 1))
    args.act_compress = True
    if args.act_compress_plan is None:
        args.act_compress_plan = "compress"
    args = check(parser, args, world_size=1)
    try:
        compare.run(args, args.output_dir, log=lambda m: print(m, flush=True))
    except (ValueError, FileNotFoundError, NotImplementedError) as err:  # user errors: one line
        fail(parser, str(err))
    return 0
