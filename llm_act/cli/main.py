"""`llm-act`: the command people run.

  llm-act demo            compress the activations of a real megatron-core GPT block on CPU
                          and print the bytes each site stores, stock vs compressed
  llm-act bench kernels   codec encode+decode bandwidth against the device's copy bandwidth
  llm-act bench overhead  what plan "auto"'s measuring costs in a training run (1,000 steps)
  llm-act bench memory|convergence|planner|gpu|all [--quick]
                          the benchmark suite; `all` regenerates docs/benchmarks.md
  llm-act bench peak      the planner's peak of a training step against the measured one
  llm-act plan            plan a preset model (--model) or a Hugging Face config.json
                          (--hf-config) per pipeline stage from its shape (no GPU)
  llm-act train           train a small GPT on CPU, stock and compressed side by side
                          (saved-activation bytes per layer, losses, tokens/s; a plot)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

from llm_act.bench import kernels
from llm_act.bench.report import main as run_bench
from llm_act.cli.demo import run_demo
from llm_act.cli.parsing import POSITIVE_FLOAT, POSITIVE_INT, fail
from llm_act.cli.plan import add_parser as add_plan_parser, run as run_plan
from llm_act.cli.train import add_parser as add_train_parser, main as run_train
from llm_act.kernels import kernel_choice


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-act", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="compression demo on a megatron-core GPT block (CPU)",
                          allow_abbrev=False)
    demo.add_argument("--seq-length", type=POSITIVE_INT, default=256)
    demo.add_argument("--micro-batch-size", type=POSITIVE_INT, default=2)
    demo.add_argument("--hidden-size", type=POSITIVE_INT, default=512)
    demo.add_argument("--num-attention-heads", type=POSITIVE_INT, default=8)
    demo.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    demo.set_defaults(cmd_parser=demo)

    bench = sub.add_parser("bench", help="benchmarks (print tables, write under docs/)",
                           allow_abbrev=False)
    bsub = bench.add_subparsers(dest="suite", required=True)
    k = bsub.add_parser("kernels", help="codec bandwidth vs copy bandwidth", allow_abbrev=False)
    k.add_argument("--size-mib", type=POSITIVE_FLOAT, default=256.0,
                   help="tensor size per codec (the issue asks for >= 256 MiB on a GPU)")
    k.add_argument("--quick", action="store_true", help="8 MiB tensors, for a CPU smoke run")
    k.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    k.add_argument("--output", default=None, help="also write the table to this markdown file")
    k.set_defaults(cmd_parser=k)
    o = bsub.add_parser("overhead", help="what plan auto's measuring and planning cost in a run",
                        allow_abbrev=False)
    o.add_argument("--steps", type=POSITIVE_INT, default=1000, help="training steps of the run")
    o.add_argument("--budget-fraction", type=_budget_fraction, default=0.3, metavar="F|none",
                   help="the budget lets 'auto' store this fraction of stock's bytes in the layers "
                        "(default 0.3); none: no budget (the compress plan's memory)")
    o.add_argument("--quick", action="store_true", help="the small quick model (CI)")
    o.add_argument("--output-dir", default="docs", help="the run's figures go to overhead.json here")
    o.set_defaults(cmd_parser=o)
    for suite, text in (("memory", "saved bytes per layer of every scheme (ledger, CPU)"),
                        ("convergence", "validation loss of every scheme against stock (CPU)"),
                        ("planner", "MILP solve time; predicted vs measured bytes"),
                        ("gpu", "throughput vs micro-batch, peak memory (needs CUDA)"),
                        ("all", "every suite; regenerates docs/benchmarks.md")):
        sp = bsub.add_parser(suite, help=text, allow_abbrev=False)
        sp.add_argument("--quick", action="store_true", help="small shapes / ~30 steps (CI)")
        sp.add_argument("--output-dir", default="docs", help="plots (and benchmarks.md) go here")
        sp.set_defaults(cmd_parser=sp)
        if suite in ("convergence", "all"):
            sp.add_argument("--convergence-json", default=None, nargs="+", metavar="JSON",
                           help="reuse convergence results saved by `bench convergence "
                                "--save-json` instead of training again (several: merged per "
                                "setting, e.g. seeds run by two processes)")
        if suite == "planner":
            _save_json_option(sp)
        if suite == "convergence":
            sp.add_argument("--save-json", default=None,
                            help="save the result as JSON after every run; if the file holds an "
                                 "unfinished result of the same settings, its runs are kept")
            sp.add_argument("--setting", choices=("fp32", "bf16"), default=None,
                            help="fp32: the low-floor measurement (10 paired seeds, three models; the "
                                 "default when no --convergence-json is given); bf16: the same plans, "
                                 "models and seeds in bf16 (chaotic here), as confirmation, with a "
                                 "control of its own")
            sp.add_argument("--seeds", type=seed_range, default=None, metavar="A-B",
                            help="run only these seeds of the setting (a range A-B or a comma list), "
                                 "e.g. to split the bench over two processes with their own --save-json")
            sp.add_argument("--door", choices=("megatron", "deepspeed"), default="megatron",
                            help="megatron: megatron-core GPTs (default); deepspeed: a small Hugging Face "
                                 "Llama under the DeepSpeed door, auto against compress and stock over "
                                 "paired seeds (as `llm-act bench hf-convergence`)")

    hc = bsub.add_parser("hf-convergence", allow_abbrev=False,
                         help="a Hugging Face Llama under DeepSpeed: auto against compress and stock, paired seeds (CPU)")
    hc.add_argument("--seeds", type=seed_range, default=None, metavar="A-B",
                    help="the seeds (a range A-B or a comma list; default 1244-1253)")
    hc.add_argument("--steps", type=POSITIVE_INT, default=None, help="training steps per run (default 200)")
    hc.add_argument("--save-json", default=None, metavar="JSON",
                    help="save after every run; an unfinished result in it is continued")
    hc.set_defaults(cmd_parser=hc)

    hp = bsub.add_parser("hf-peak", allow_abbrev=False,
                         help="a Hugging Face decoder under DeepSpeed: predicted peak against the measured one (CPU)")
    _save_json_option(hp)
    hp.set_defaults(cmd_parser=hp)

    pk = bsub.add_parser("peak", help="the planner's peak of a step against the measured one (CPU)",
                         allow_abbrev=False)
    pk.add_argument("--output-dir", default="docs",
                    help="benchmarks.md here: its tables rendered from the saved JSON are rendered again")
    _save_json_option(pk)
    pk.set_defaults(cmd_parser=pk)

    add_plan_parser(sub)

    add_train_parser(sub)
    return p


def _save_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save-json", default=None, metavar="JSON",
                        help="also save the figures, with the command, machine and versions, as JSON; "
                             "the tables of <output-dir>/benchmarks.md marked as rendered from this "
                             "file are rendered again from it")


def _budget_fraction(text: str):
    """A fraction in (0, 1], or "none" (argparse type)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] or 'none', got {text!r}")
    return value


def seed_range(text: str) -> tuple[int, ...]:
    """'1234-1238' or '1234,1236' -> the seeds (argparse type)."""
    try:
        if "-" in text.strip("-"):
            a, b = text.split("-", 1)
            seeds = tuple(range(int(a), int(b) + 1))
        else:
            seeds = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a seed range A-B or a comma list, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seed in {text!r}")
    return seeds


def _check_user_input(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the user got wrong before any work starts, with one line naming it: the
    environment, and every path a command reads or writes (these failed, with a traceback,
    only after minutes of training or benchmarking)."""
    try:
        kernel_choice()
    except ValueError as err:
        fail(parser, str(err))
    if args.command == "demo":
        if args.hidden_size % args.num_attention_heads:
            fail(parser, f"--hidden-size {args.hidden_size} is not divisible by "
                              f"--num-attention-heads {args.num_attention_heads}")
        return
    out_dir = getattr(args, "output_dir", None)
    if out_dir is not None:  # created when written; its nearest existing folder must take it
        probe = os.path.abspath(out_dir)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            fail(parser, f"--output-dir {out_dir}: {probe} is a file, not a folder; choose another folder")
        if not os.access(probe, os.W_OK | os.X_OK):
            fail(parser, f"--output-dir {out_dir}: {probe} is not writable; choose another folder")
    for flag in ("output", "save_json"):  # files written at the end: their folder must exist now
        path = getattr(args, flag, None)
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail(parser, f"--{flag.replace('_', '-')} {path}: its folder does not exist; create it first")
    reads = [("convergence_json", p) for p in getattr(args, "convergence_json", None) or []]
    if getattr(args, "suite", None) == "convergence":  # it resumes from its --save-json
        reads += [("save_json", getattr(args, "save_json", None))]
    for flag, path in reads:  # read back: an existing one must be ours
        if path is None or (flag == "save_json" and not os.path.exists(path)):
            continue
        name = "--" + flag.replace("_", "-")
        try:
            with open(path) as f:
                saved = json.load(f)
        except OSError as err:
            fail(parser, f"{name} {path}: cannot read it ({err.strerror})")
        except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
            fail(parser, f"{name} {path}: not a JSON file saved by `llm-act bench "
                         f"convergence --save-json` ({err})")
        if not isinstance(saved, dict) or "models" not in saved:
            fail(parser, f"{name} {path}: not a result of this version of `llm-act bench convergence "
                         f"--save-json` (no 'models'); remove it or name another file")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # megatron-core warns at import that apex / Transformer Engine are absent; we know.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*")
    # errors are reported by the subcommand's parser (its usage line, its name)
    sub = next((getattr(args, n) for n in ("cmd_parser", "train_parser", "plan_parser")
                if getattr(args, n, None) is not None), parser)
    _check_user_input(sub, args)
    if args.command == "demo":
        print(run_demo(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                       hidden_size=args.hidden_size, num_heads=args.num_attention_heads,
                       bf16=args.bf16))
        return 0
    if args.command == "bench" and args.suite == "kernels":
        size = 8.0 if args.quick else args.size_mib
        header, rows = kernels.run(size_mib=size, device=args.device)
        text = kernels.table(header, rows)
        print(text)
        if args.output:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        return 0
    if args.command == "bench":
        return run_bench(args, argv)
    if args.command == "train":
        return run_train(args)
    if args.command == "plan":
        return run_plan(args, parser)
    return 2


if __name__ == "__main__":
    sys.exit(main())
