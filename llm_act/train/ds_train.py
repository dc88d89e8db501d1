"""The small DeepSpeed training run behind `launch/ds_train.py`.

    deepspeed --num_gpus 2 launch/ds_train.py --deepspeed_config launch/ds_config.json

trains a small megatron-core GPT (or, with `--model hf`, a Hugging Face decoder of a
family with a site table, `--hf-kind`, or the one a model's `config.json` describes,
`--hf-config`, built with random weights) on the embedded byte-level corpus of `llm_act.train.data`, through
`llm_act.patches.deepspeed.initialize`, and prints per optimizer step the loss (averaged
over the data-parallel ranks) and the bytes the first micro-batch's forward left for
backward on this rank (`SavedTensorLedger`). Runs on CPU (gloo) and on GPUs. Flags other
than DeepSpeed's override the config: `--zero-stage`, `--no-act-compress` (the same run
with `"activation_compression": {"enabled": false}`), `--act-plan`, `--act-budget`.

A training loop, so it sits with the others in `llm_act.train` (above the patches: it
imports `llm_act.patches.deepspeed` and the loop's data, parallel and model helpers).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

import torch

from llm_act import cpu
from llm_act._imports import require
from llm_act.ledger import SavedTensorLedger
from llm_act.patches.deepspeed import ds_config, hf_decoder, initialize
from llm_act.plan import describe
from llm_act.runtime.agreement import timed
from llm_act.runtime.logs import stderr_line
from llm_act.train import data as data_lib, parallel, small_gpt


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                   help="set by the deepspeed launcher")
    p.add_argument("--model", choices=("gpt", "hf"), default="gpt",
                   help="gpt: megatron-core GPTModel; hf: a Hugging Face decoder, --hf-kind or "
                        "--hf-config (default gpt)")
    p.add_argument("--hf-kind", choices=hf_decoder.KINDS, default="llama",
                   help="with --model hf: the family of the decoder built at --hidden-size, "
                        "--num-layers, --num-attention-heads (default llama)")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="with --model hf: build the decoder a model's config.json describes (its "
                        "sizes, the corpus' vocabulary; random weights, no download) instead of --hf-kind")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="override zero_optimization.stage of the config")
    p.add_argument("--no-act-compress", action="store_true",
                   help='run with "activation_compression": {"enabled": false}')
    p.add_argument("--act-plan", default=None, help="override activation_compression.plan")
    p.add_argument("--act-budget", default=None, metavar="BYTES",
                   help='override activation_compression.budget (bytes, or e.g. "60GB")')
    p.add_argument("--compare", action="store_true",
                   help="run twice in the same processes, without then with compression, and "
                        "print both")
    p.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint at the end")
    p.add_argument("--json", default=None, help="write losses and saved bytes to this file (rank 0)")
    deepspeed = require("deepspeed", "ds_train.py")
    return deepspeed.add_config_arguments(p)


def ds_config_from(args: argparse.Namespace) -> dict[str, Any]:
    """The DeepSpeed config dict with the command-line overrides applied."""
    ds = ds_config.load(ds_config.source(args, None, None))
    if args.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    section = ds.get(ds_config.SECTION)
    if args.no_act_compress:
        section = dict(section or {})
        section["enabled"] = False
    if args.act_plan is not None:
        section = dict(section or {})
        section["plan"] = args.act_plan
    if args.act_budget is not None:
        section = dict(section or {})
        section["budget"] = int(args.act_budget) if args.act_budget.isdigit() else args.act_budget
    if section is not None:
        ds[ds_config.SECTION] = section
    ds_config.act_config(ds)  # a bad section is refused here, before any process group or build
    return ds


def _no_cpu_op_builds(ds: dict[str, Any]) -> None:
    """On a CPU host this script's processes build no DeepSpeed C++ op (about two minutes of
    compiling on a fresh machine, and a lock another job can leave behind): Adam and AdamW
    run as torch's (`torch_adam`, unless the config says otherwise), and the shared-memory
    all-reduce gives way to gloo's, which does the same job. Only here, where the script
    owns the process; `initialize()` changes nothing of DeepSpeed's."""
    import importlib

    # the module itself: `deepspeed.comm.torch` as an attribute is torch (comm imports it)
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    if hasattr(ds_comm, "build_shm_op"):
        ds_comm.build_shm_op = lambda: None


def _model(args: argparse.Namespace, vocab: int):
    """(module, loss function(module, batch) -> loss)."""
    if args.hf_config is not None and args.model != "hf":
        raise ValueError("--hf-config builds a Hugging Face decoder; add --model hf")
    if args.model == "hf":
        if args.hf_config is not None:
            model = hf_decoder.from_config_file(args.hf_config, seed=args.seed, vocab_size=vocab)
        else:
            model = hf_decoder.build(args.hf_kind, vocab_size=vocab, hidden_size=args.hidden_size,
                                     num_layers=args.num_layers, num_heads=args.num_attention_heads,
                                     num_kv_heads=max(1, args.num_attention_heads // 2),
                                     max_positions=args.seq_length, seed=args.seed)
        return model, lambda m, b: hf_decoder.lm_loss(m, b.tokens, b.labels)

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cpu.install()  # the launcher owns its process: megatron-core on CPU needs the stand-ins
    parallel.init_parallel(rank=rank, world_size=world, seed=args.seed)
    torch.manual_seed(args.seed)
    config = small_gpt.small_config(hidden_size=args.hidden_size,
                                    num_attention_heads=args.num_attention_heads,
                                    num_layers=args.num_layers)
    # untied output layer: under ZeRO-3 a weight shared by two modules is gathered only by
    # its owner's hooks
    model = small_gpt.gpt_model(config, vocab_size=vocab, max_sequence_length=args.seq_length,
                                share_embeddings_and_output_weights=False)

    def loss(m, b):
        return m(b.tokens, b.position_ids, None, labels=b.labels).float().mean()

    return model, loss


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train for `args.steps` optimizer steps; returns {"losses", "saved_bytes", "plan", ...}
    (with `--compare`: {"off": that of the run without compression, "on": with it})."""
    deepspeed = require("deepspeed", "ds_train.py")
    from deepspeed.accelerator import get_accelerator

    ds = ds_config_from(args)
    args.deepspeed_config = None  # the (overridden) dict goes in as `config`
    if not torch.cuda.is_available():
        _no_cpu_op_builds(ds)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if not args.compare:
        result = _train(args, ds, log)
    else:
        off = json.loads(json.dumps(ds))
        off[ds_config.SECTION] = {**off.get(ds_config.SECTION, {}), "enabled": False}
        result = {"off": _train(args, off, log), "on": _train(args, ds, log)}
        on, off_ = result["on"], result["off"]
        log_rank0 = log if torch.distributed.get_rank() == 0 else (lambda _m: None)
        log_rank0(f"compare: final loss {off_['losses'][-1]:.4f} -> {on['losses'][-1]:.4f}; "
                  f"saved bytes {off_['saved_bytes'][-1]:,} -> {on['saved_bytes'][-1]:,} "
                  f"({on['saved_bytes'][-1] / max(1, off_['saved_bytes'][-1]):.3f}x)")
    if args.json and torch.distributed.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _train(args: argparse.Namespace, ds: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    say = log if rank == 0 else (lambda _msg: None)
    corpus = data_lib.embedded_corpus()
    samples = data_lib.Samples(corpus.train, args.seq_length, seed=args.seed)
    model, loss_fn = _model(args, corpus.vocab_size)
    engine, _, _, _ = initialize(args=args, model=model, model_parameters=model.parameters(),
                                 config=ds)
    device = engine.device
    mbs = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    ctl = engine.act_controller
    say(f"ds_train: model {args.model}, ZeRO stage {engine.zero_optimization_stage()}, "
        f"{world} ranks, micro-batch {mbs} x {gas} accumulation, seq {args.seq_length}; "
        f"activation compression {'on' if ctl.enabled else 'off'}")
    if ctl.enabled:
        say("plan: " + ("per-block recompute" if getattr(engine.act_generic, "recompute", False)
                        else _plan_line(ctl.plan)))
    losses, saved = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        total, step_saved = 0.0, 0
        for i in range(gas):
            b = data_lib.micro_batch(samples, step * mbs * gas * world, i, mbs, rank, world)
            b = type(b)(*(t.to(device) for t in (b.tokens, b.labels, b.loss_mask, b.position_ids)))
            if i == 0:
                with SavedTensorLedger() as ledger:
                    loss = loss_fn(engine, b)
                step_saved = ledger.total_bytes
            else:
                loss = loss_fn(engine, b)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float().item() / gas
        mean = torch.tensor([total], dtype=torch.float64)
        timed(lambda: torch.distributed.all_reduce(mean, async_op=True), "all_reduce of the loss")
        losses.append(mean.item() / world)
        saved.append(step_saved)
        say(f"step {step + 1:3d}  loss {losses[-1]:.4f}  saved {step_saved:,} B "
            f"({step_saved / 2**20:.3f} MiB)  controller iteration {ctl.iteration}")
    seconds = time.perf_counter() - start
    say(f"done: {args.steps} steps in {seconds:.1f} s; final loss {losses[-1]:.4f}; "
        f"saved bytes per micro-batch {saved[-1]:,}")
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    result = {"losses": losses, "saved_bytes": saved, "seconds": seconds,
              "zero_stage": engine.zero_optimization_stage(), "model": args.model,
              "compressed": ctl.enabled, "iteration": ctl.iteration,
              "plan": {str(k): v for k, v in ctl.plan.items()},
              "tracked": list(ctl.adapter.tracked), "plan_changes": [dict(h) for h in ctl.history]}
    return result


def _plan_line(plan: dict) -> str:
    return describe(plan).replace("\n", "; ")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:  # what the user got wrong: one line per rank
        stderr_line(f"ds_train.py: error: {err}")
        return 2
    timed(lambda: torch.distributed.barrier(async_op=True), "the closing barrier")
    return 0
