"""`llm-act bench hf-convergence`: a small Hugging Face Llama under the DeepSpeed door, "auto"
against "compress" at the same bytes, paired over seeds (issue 45, item 4).

    OMP_NUM_THREADS=1 llm-act bench hf-convergence --seeds 1244-1253 --save-json docs/hf_convergence.json

Why: plan "auto" on the generic door measures and re-plans the Hugging Face blocks; whether
that keeps the loss is a question for paired seeds, as on megatron-core (`bench convergence`).
Each seed trains the same model from the same weights on the same batches under four plans,
through `llm_act.patches.deepspeed.initialize` (ZeRO-0, one gloo rank, torch's AdamW at 2e-3,
warm-up over a twentieth of the run and cosine to a tenth, gradients clipped at norm 1, as the
megatron-core bench trains), in fp32:

- "stock": `"activation_compression": {"enabled": false}`;
- "stock, 1 ulp": the same with every weight moved by one ulp at the start (the control: how
  far two stock runs that differ at the rounding scale end apart);
- "compress": the fixed default codecs per site;
- "auto": no budget, which on CPU is the memory of the "compress" plan (`solving.default_budget`):
  the same bytes, planned from the measured blocks and re-planned at growing intervals.

The verdict is the final validation loss (the whole validation split of the embedded corpus),
as paired relative differences: each plan against stock (mean and one-sided 95% bound), and
"auto" against "compress" (mean and two-sided 95% interval). The bytes column is what one
training forward holds for backward (`SavedTensorLedger`: all of it, the embedding's and the
logits' included), over stock's.

CPU evidence: the CPU's SDPA keeps q, k, v, its output and the log-sum-exp (its flash
kernel); a GPU's flash kernel keeps the same tensors, the math kernel (with dropout, or
eager) the probabilities instead (`attn.softmax`): the sites planned differ there.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from typing import Callable, Optional

import torch

from llm_act.bench import convergence as C
from llm_act.bench.record import run_record, write_json
from llm_act.ledger import SavedTensorLedger

MODEL = dict(kind="llama", hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=352,
             max_positions=128)
SEQ, MICRO_BATCH, STEPS, LR = 128, 4, 200, 2e-3
SCHEDULE = "AdamW, warm-up 1/20 of the steps, cosine to 0.1 of the rate, gradient clipping 1.0"
STOCK, ULP = "stock", "stock, 1 ulp"
PLANS = (STOCK, ULP, "compress", "auto")
SEEDS = tuple(range(1244, 1254))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_rank() -> None:
    """One gloo rank in this process (DeepSpeed's engine needs a process group)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo")


def _engine(model: torch.nn.Module, plan: str, steps: int):
    from llm_act.patches.deepspeed import initialize

    section = {"enabled": False} if plan in (STOCK, ULP) else {"plan": plan}
    # the megatron-core bench's schedule (`convergence.train_args`): warm-up over a twentieth of
    # the run, cosine to a tenth of the rate, gradients clipped at norm 1
    schedule = {"type": "WarmupCosineLR", "params": {"total_num_steps": steps, "warmup_num_steps": max(2, steps // 20),
                                                     "warmup_type": "linear", "cos_min_ratio": 0.1}}
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "scheduler": schedule, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "activation_compression": section}
    return initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def validation_loss(engine, tokens) -> float:
    """Mean next-token loss over every target of `tokens` (eval mode, no gradients)."""
    total, count = 0.0, 0.0
    engine.module.eval()
    try:
        with torch.no_grad():
            for b in C.whole_split_batches(tokens, SEQ, MICRO_BATCH):
                logits = engine.module(input_ids=b.tokens, use_cache=False).logits.float()
                each = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), reduction="none")
                total += float((each * b.loss_mask.flatten()).sum())
                count += float(b.loss_mask.sum())
    finally:
        engine.module.train()
    return total / count


def train_one(plan: str, seed: int, steps: int = STEPS) -> dict:
    """{plan, seed, final, saved_bytes, changes, seconds} of one run (`saved_bytes`: what the
    last step's forward held for backward, all of it)."""
    from llm_act.patches.deepspeed import hf_decoder
    from llm_act.train import data as data_lib

    corpus = data_lib.embedded_corpus()
    model = hf_decoder.build(vocab_size=corpus.vocab_size, seed=seed, **MODEL)
    if plan == ULP:
        C.nudge_one_ulp(list(model.parameters()), seed)
    torch.manual_seed(seed)
    engine = _engine(model, plan, steps)
    samples = data_lib.Samples(corpus.train, SEQ, seed=seed)
    start, saved_bytes = time.perf_counter(), 0
    for step in range(steps):
        b = data_lib.micro_batch(samples, step * MICRO_BATCH, 0, MICRO_BATCH, 0, 1)
        if step == steps - 1:
            with SavedTensorLedger() as ledger:
                loss = hf_decoder.lm_loss(engine, b.tokens, b.labels)
            saved_bytes = ledger.total_bytes
        else:
            loss = hf_decoder.lm_loss(engine, b.tokens, b.labels)
        engine.backward(loss)
        engine.step()
    history = engine.act_controller.history if plan == "auto" else []
    return {"plan": plan, "seed": seed, "final": validation_loss(engine, corpus.valid),
            "saved_bytes": saved_bytes, "changes": len(history),
            "seconds": time.perf_counter() - start}


def run(seeds=SEEDS, plans=PLANS, steps: int = STEPS, done: Optional[list] = None,
        save: Callable[[dict], None] = lambda r: None, log: Callable[[str], None] = print) -> dict:
    """Every (seed, plan) run not in `done` (a saved result's runs), saving after each."""
    one_rank()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = list(done or [])
    have = {(r["seed"], r["plan"]) for r in runs}
    model = {**MODEL, "seq": SEQ, "micro_batch": MICRO_BATCH, "steps": steps, "lr": LR, "schedule": SCHEDULE}
    try:
        for seed in seeds:
            for plan in plans:
                if (seed, plan) in have:
                    continue
                r = train_one(plan, seed, steps)
                runs.append(r)
                log(f"  seed {seed} {plan}: validation loss {r['final']:.5f}, saved bytes {r['saved_bytes']:,}, "
                    f"{r['changes']} plan changes, {r['seconds']:.0f} s")
                save({"model": model, "runs": runs})
    finally:
        torch.set_num_threads(threads)
    return {"model": model, "runs": runs}


def _paired(runs: list, plan: str, against: str) -> list[float]:
    by = {(r["seed"], r["plan"]): r["final"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    return [(by[(s, plan)] - by[(s, against)]) / by[(s, against)] for s in seeds
            if (s, plan) in by and (s, against) in by]


def two_sided(diffs: list[float], confidence: float = C.CONFIDENCE) -> tuple[float, float, float]:
    """(mean, low, high): the mean of paired differences and its two-sided interval."""
    stats = C.paired_stats(diffs)
    if stats["n"] < 2:
        return stats["mean"], -math.inf, math.inf
    half = C.t_quantile(1 - (1 - confidence) / 2, stats["n"] - 1) * stats["se"]
    return stats["mean"], stats["mean"] - half, stats["mean"] + half


def table(result: dict) -> str:
    """The markdown table of a result: each plan against stock, and "auto" against "compress"."""
    runs = result["runs"]
    stock_bytes = [r["saved_bytes"] for r in runs if r["plan"] == STOCK]
    lines = ["| plan | seeds | saved bytes (of stock) | paired mean vs stock | one-sided 95% bound | "
             "plan changes per run |", "|---|---:|---:|---:|---:|---|"]
    for plan in PLANS[1:]:
        diffs = _paired(runs, plan, STOCK)
        if not diffs:
            continue
        stats = C.paired_stats(diffs)
        mine = [r for r in runs if r["plan"] == plan]
        ratio = sum(r["saved_bytes"] for r in mine) / len(mine) / (sum(stock_bytes) / len(stock_bytes))
        changes = sorted({r["changes"] for r in mine})
        lines.append(f"| {plan} | {stats['n']} | {ratio:.3f} | {100 * stats['mean']:+.2f}% | "
                     f"{100 * stats['upper']:+.2f}% | {changes[0]}-{changes[-1]} |")
    diffs = _paired(runs, "auto", "compress")
    if diffs:
        mean, low, high = two_sided(diffs)
        lines.append("")
        lines.append(f"\"auto\" against \"compress\" at the same bytes, {len(diffs)} seeds: mean "
                     f"{100 * mean:+.2f}%, two-sided 95% interval [{100 * low:+.2f}%, {100 * high:+.2f}%]")
    return "\n".join(lines)


def run_saved(seeds=None, steps: Optional[int] = None, save_json: Optional[str] = None,
              command: str = "llm-act bench hf-convergence", log: Callable[[str], None] = print) -> dict:
    """`run`, continuing and saving to `save_json` after every run; prints the table."""
    done = None
    if save_json and os.path.exists(save_json):
        with open(save_json) as f:
            done = json.load(f)["runs"]
    start = time.perf_counter()

    def save(result: dict) -> None:
        if save_json:
            write_json(save_json, {**run_record(command, time.perf_counter() - start), **result})

    result = run(seeds or SEEDS, PLANS, steps or STEPS, done, save, log)
    log(table(result))
    return result


