"""Convergence: a small GPT on the embedded corpus, each scheme against stock, same steps.

Every run is a `llm_act.train.Trainer` (megatron-core GPTModel, torch AdamW on CPU) with
the same flags and seed, so the same initial weights and batches; a scheme's run converts
the model's layers and binds the scheme's fixed plan (`llm_act.bench.memory.bind_layer`).
Validation loss (the same held-out batches every time) is taken every `eval_every` steps.
Stock runs with 2-3 seeds give the seed-to-seed spread to read the differences against.
The corpus's unigram entropy (nats per byte) is the loss of a model that learned only the
byte frequencies: stock must end well below it.
"""
from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from llm_act.bench import memory as M

#: schemes trained besides stock (names of llm_act.bench.memory's schemes)
SCHEMES = ("compress (Adacc)", "ActNN int2", "GACT 4-bit avg", "DIVISION dual2",
           "Few-bit GELU 3-bit", "planner middle")
DEFAULT_PLAN = "compress (Adacc)"


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the byte frequencies in nats (the loss of the best unigram model)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def train_args(steps: int, seed: int, quick: bool, extra=()):
    """The bench GPT's flags (`extra`: more flags, e.g. `--act-compress`)."""
    from llm_act.train.args import build_parser, check

    p = build_parser()
    argv = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
            "--seq-length", "128", "--micro-batch-size", "8" if not quick else "4",
            "--position-embedding-type", "rope", "--bf16",
            "--train-iters", str(steps), "--lr", "2e-3", "--min-lr", "2e-4",
            "--lr-warmup-iters", str(max(2, steps // 20)), "--eval-iters", "4",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--seed", str(seed),
            "--log-interval", "1000000", "--vocab-size", "256", *extra]
    return check(p, p.parse_args(argv), world_size=1)


def _layers(trainer):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for c in trainer.chunks for m in c.modules() if isinstance(m, TransformerLayer)]


def train_one(scheme: M.Scheme, steps: int, eval_every: int, seed: int, quick: bool, data) -> dict:
    """{"steps": [...], "valid": [...], "train": [...]} of one run (process group up)."""
    from llm_act.train.trainer import Trainer

    args = train_args(steps, seed, quick)
    trainer = Trainer(args, data)
    for layer in _layers(trainer):
        M.bind_layer(layer, int(layer.layer_number) - 1, scheme)
    out = {"steps": [0], "valid": [trainer.evaluate()], "train": []}
    for it in range(1, steps + 1):
        stats = trainer.train_step()
        out["train"].append(stats.loss)
        if it % eval_every == 0 or it == steps:
            out["steps"].append(it)
            out["valid"].append(trainer.evaluate())
    return out


def run(steps: int = 300, quick: bool = False, seeds=(1234, 1235, 1236), schemes=SCHEMES,
        paired=(DEFAULT_PLAN,), log: Callable[[str], None] = lambda m: None) -> dict:
    """Stock per seed, every scheme at the first seed and the `paired` schemes at every seed
    (same initial weights and batches as stock at that seed, so the per-seed differences
    are paired); returns curves and the corpus entropy."""
    from llm_act.train import parallel
    from llm_act.train.data import embedded_corpus
    from llm_act.train.loop import quiet_megatron_warnings

    quiet_megatron_warnings()
    eval_every = max(1, steps // 10)
    data = embedded_corpus()
    shape = M.Shape(s=128, b=8 if not quick else 4, h=128, a=4, dropout=0.1)
    by_name = {s.name: s for s in M.all_schemes(shape)}
    args0 = train_args(steps, seeds[0], quick)
    parallel.init(args0)
    runs: dict[str, dict] = {}
    try:
        for seed in seeds:
            runs[f"stock seed {seed}"] = train_one(by_name["stock"], steps, eval_every, seed, quick, data)
            log(f"  stock seed {seed}: valid {runs[f'stock seed {seed}']['valid'][-1]:.4f}")
        for name in schemes:
            runs[name] = train_one(by_name[name], steps, eval_every, seeds[0], quick, data)
            log(f"  {name}: valid {runs[name]['valid'][-1]:.4f}")
        for name in (n for n in paired if n in schemes):
            for seed in seeds[1:]:
                key = f"{name} seed {seed}"
                runs[key] = train_one(by_name[name], steps, eval_every, seed, quick, data)
                log(f"  {key}: valid {runs[key]['valid'][-1]:.4f}")
    finally:
        parallel.teardown()
    return {"runs": runs, "entropy": unigram_entropy(data.train), "steps": steps,
            "seeds": tuple(seeds), "sha256": data.sha256, "describe": data.describe(),
            "model": "GPT 2 layers, hidden 128, 4 heads, seq 128, micro-batch "
                     f"{args0.micro_batch_size}, bf16, dropout 0.1, RoPE, AdamW lr 2e-3 cosine"}


def _seeded(name: str, seeds) -> tuple[str, int]:
    """("compress (Adacc)", 1235) from "compress (Adacc) seed 1235"; a bare scheme name is
    the first seed's run."""
    for seed in seeds:
        if name.endswith(f" seed {seed}"):
            return name[: -len(f" seed {seed}")], seed
    return name, seeds[0]


def summary(result: dict) -> dict:
    """Final losses against stock: `rel` against stock at the first seed for every run,
    `paired[scheme]` the per-seed differences (scheme at seed s against stock at seed s)
    for schemes trained at several seeds, and their mean."""
    runs, seeds = result["runs"], tuple(result["seeds"])
    stock = {seed: runs[f"stock seed {seed}"]["valid"][-1] for seed in seeds if f"stock seed {seed}" in runs}
    finals = list(stock.values())
    ref = finals[0]
    spread = (max(finals) - min(finals)) / ref if len(finals) > 1 else float("nan")
    rel, per_seed = {}, {}
    for k, v in runs.items():
        if k.startswith("stock"):
            continue
        name, seed = _seeded(k, seeds)
        rel[k] = v["valid"][-1] / ref - 1
        if seed in stock:
            per_seed.setdefault(name, {})[seed] = v["valid"][-1] / stock[seed] - 1
    paired = {n: {"per_seed": d, "mean": sum(d.values()) / len(d)} for n, d in per_seed.items() if len(d) > 1}
    return {"stock_final": ref, "stock_spread": spread, "stock_finals": finals, "rel": rel, "paired": paired}


def table(result: dict) -> str:
    runs = result["runs"]
    first = next(iter(runs.values()))
    steps = first["steps"]
    pick = sorted({0, steps[len(steps) // 4], steps[len(steps) // 2], steps[-1]})
    cols = [steps.index(p) for p in pick]
    s = summary(result)
    lines = ["| run | " + " | ".join(f"valid @ {steps[c]}" for c in cols) + " | final vs stock seed "
             f"{result['seeds'][0]} |", "|---|" + "---:|" * (len(cols) + 1)]
    for name, r in runs.items():
        rel = "" if name.startswith("stock") else f"{s['rel'][name]:+.2%}"
        if name.startswith("stock") and name != f"stock seed {result['seeds'][0]}":
            rel = f"{r['valid'][-1] / s['stock_final'] - 1:+.2%}"
        base, seed = _seeded(name, tuple(result["seeds"]))
        if not name.startswith("stock") and seed != result["seeds"][0]:
            rel += f" ({s['paired'][base]['per_seed'][seed]:+.2%} vs stock seed {seed})"
        lines.append(f"| {name} | " + " | ".join(f"{r['valid'][c]:.4f}" for c in cols) + f" | {rel} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in result["runs"].items():
        style = dict(color="black", alpha=0.5, linewidth=1) if name.startswith("stock") else {}
        if not name.startswith("stock") and _seeded(name, tuple(result["seeds"]))[1] != result["seeds"][0]:
            style = dict(linestyle="--", linewidth=0.8, alpha=0.6)
        ax.plot(r["steps"], r["valid"], label=name, **style)
    ax.axhline(result["entropy"], color="gray", linestyle=":", label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"convergence, {result['steps']} steps: {result['model']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def finite_decreasing(r: dict) -> bool:
    v = r["valid"]
    return all(math.isfinite(x) for x in v + r["train"]) and v[-1] < v[0]
