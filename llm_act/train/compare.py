"""`llm-act train`: stock and compressed training side by side on the embedded corpus.

Two Trainers in one process, same seed, same initial weights, same batches. Their
iterations alternate (stock, compressed, stock, ...), each with its own RNG state swapped
in, so each run draws exactly what it would alone and both see the same machine load: the
tokens/s ratio is measured side by side, as every time figure here is. Saved-activation
bytes come from the ledger around the first micro-batch's forward. Prints a table (bytes
per layer, losses, tokens/s ratio) and writes a plot of memory per site and the two loss
curves (matplotlib, Agg backend) to `--output-dir`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from typing import Callable, Iterator, Optional

from llm_act.kernels import codec_backend
from llm_act.sites import OUTER_SITES, SITES
from llm_act.train import parallel, rng
from llm_act.train.loop import load_data, request_final_fidelity
from llm_act.train.trainer import Trainer

MiB = 2**20
PLOT_NAME = "train_memory_per_site.png"
#: Relative to the working directory; never docs/, whose committed plots a run from a checkout
#: would overwrite (`llm-act bench` is what regenerates those).
OUTPUT_DIR = "llm_act_out"


class _Run:
    """One Trainer with its own RNG state and what it measured."""

    def __init__(self, name: str, args: argparse.Namespace, data) -> None:
        self.name = name
        self.trainer = Trainer(args, data)  # seeds every generator from args.seed
        self.rng = rng.get_state()
        self.losses: list[float] = []
        self.seconds = 0.0
        self.timed = 0
        self.by_site: dict = {}
        self.valid_loss: Optional[float] = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        outer = rng.get_state()
        rng.set_state(self.rng)
        try:
            yield
        finally:
            self.rng = rng.get_state()
            rng.set_state(outer)

    def step(self, measure: bool, timed: bool) -> None:
        with self.active():
            stats = self.trainer.train_step(measure=measure)
        self.losses.append(stats.loss)
        if timed:
            self.seconds += stats.seconds
            self.timed += 1
        if measure and self.trainer.ledger is not None:
            self.by_site = self.trainer.ledger.by_site()

    def evaluate(self) -> None:
        with self.active():
            self.valid_loss = self.trainer.evaluate()

    @property
    def tokens_per_s(self) -> Optional[float]:
        """None until an iteration after the first (which pays one-off costs) was timed."""
        a = self.trainer.args
        return a.global_batch_size * a.seq_length * self.timed / self.seconds if self.seconds else None

    def per_layer(self) -> dict:
        out: dict = {}
        for (layer, _site), n in self.by_site.items():
            out[layer] = out.get(layer, 0) + n
        return out

    def per_site(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_layer, site), n in self.by_site.items():
            out[site] = out.get(site, 0) + n
        return out


def _stock_args(args: argparse.Namespace) -> argparse.Namespace:
    stock = argparse.Namespace(**vars(args))
    stock.act_config = None
    return stock


def _table(stock: _Run, comp: _Run, args: argparse.Namespace, sha256: str) -> str:
    lines = [
        f"llm-act train: megatron-core GPT, {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{args.num_attention_heads} heads, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
        f"{'bf16' if args.bf16 else 'fp32'}, dropout {args.hidden_dropout}/{args.attention_dropout}, "
        f"{args.train_iters} iterations, seed {args.seed}",
        f"data: embedded stdlib corpus, sha256 {sha256}" if not args.data_path
        else f"data: {args.data_path[0]}, sha256 {sha256}",
        f"compressed: {args.act_config}",
        "",
        "saved activations per micro-batch (SavedTensorLedger, first micro-batch of the last "
        "measured iteration)",
        f"{'layer':<24}{'stock MiB':>12}{'compressed MiB':>16}{'ratio':>8}",
    ]
    if stock.tokens_per_s and comp.tokens_per_s:
        speed = f"{comp.tokens_per_s / stock.tokens_per_s:.3f}"
    else:
        speed = "n/a (needs --train-iters >= 2)"
    s_layer, c_layer = stock.per_layer(), comp.per_layer()
    keys = sorted({k for k in s_layer} | {k for k in c_layer}, key=lambda k: (k is None, k or 0))
    for k in keys:
        name = "outside blocks" if k is None else f"layer {k}"
        s, c = s_layer.get(k, 0), c_layer.get(k, 0)
        lines.append(f"{name:<24}{s / MiB:>12.3f}{c / MiB:>16.3f}{_ratio(c, s):>8}")
    s_tot, c_tot = sum(s_layer.values()), sum(c_layer.values())
    lines.append(f"{'total':<24}{s_tot / MiB:>12.3f}{c_tot / MiB:>16.3f}{_ratio(c_tot, s_tot):>8}")
    lines += [
        "",
        f"{'':<24}{'stock':>12}{'compressed':>16}",
        f"{'first train loss':<24}{stock.losses[0]:>12.4f}{comp.losses[0]:>16.4f}",
        f"{'final train loss':<24}{stock.losses[-1]:>12.4f}{comp.losses[-1]:>16.4f}",
        f"{'validation loss':<24}{_fmt(stock.valid_loss):>12}{_fmt(comp.valid_loss):>16}",
        _gap_line(stock.losses, comp.losses),
        f"{'tokens/s':<24}{_fmt(stock.tokens_per_s, '.1f'):>12}{_fmt(comp.tokens_per_s, '.1f'):>16}",
        "",
        f"tokens/s ratio compressed/stock: {speed} "
        f"(iterations alternate in one process; the first iteration of each is not timed; "
        f"{codec_backend(parallel.device())})",
        f"saved activations: {s_tot / MiB:.3f} MiB -> {c_tot / MiB:.3f} MiB per micro-batch "
        f"({_ratio(c_tot, s_tot)} of stock)",
    ]
    c = comp.trainer.controller
    if c is not None and c.adapter.measured.fidelity:
        lines.append(c.adapter.measured.fidelity[-1].format())
    return "\n".join(lines)


def largest_gap(stock: list[float], compressed: list[float]) -> tuple[float, int]:
    """(largest |compressed - stock| training loss over the iterations, its iteration, 1-based)."""
    gaps = [abs(c - s) for s, c in zip(stock, compressed)]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    return gaps[i], i + 1


def _gap_line(stock: list[float], compressed: list[float]) -> str:
    """The plot's loss panel in words: where the two curves are furthest apart."""
    gap, it = largest_gap(stock, compressed)
    return (f"{'largest loss gap':<24}{gap:>12.4f}{'':>16}  nats, at iteration {it} "
            f"(stock {stock[it - 1]:.4f}, compressed {compressed[it - 1]:.4f})")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1%}" if b else "n/a"


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def plot(stock: _Run, comp: _Run, path: str, title: str) -> str:
    """Bars of saved bytes per site (summed over layers), stock vs compressed, and the two
    loss curves; written to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    s_site, c_site = stock.per_site(), comp.per_site()
    order = [s for s in SITES + OUTER_SITES + ("other",) if s in s_site or s in c_site]
    order += sorted((set(s_site) | set(c_site)) - set(order))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    xs = range(len(order))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [s_site.get(s, 0) / MiB for s in order], w, label="stock")
    ax.bar([x + w / 2 for x in xs], [c_site.get(s, 0) / MiB for s in order], w, label="compressed")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(order, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("MiB saved for backward (all layers)")
    ax.set_title("saved activations per site, one micro-batch")
    ax.legend()
    its = range(1, len(stock.losses) + 1)
    bx.plot(its, stock.losses, label="stock")
    bx.plot(its, comp.losses, label="compressed", linestyle="--")
    bx.set_xlabel("iteration")
    bx.set_ylabel("train loss")
    bx.set_title("loss")
    bx.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace, output_dir: str, log: Callable[[str], None] = print) -> dict:
    """Train both runs (one process, one rank) and print the comparison; returns the numbers."""
    parallel.init(args)
    try:
        data = load_data(args)
        log(data.describe())
        stock = _Run("stock", _stock_args(args), data)
        comp = _Run("compressed", args, data)
        for it in range(1, args.train_iters + 1):
            measure = it == 1 or it % args.ledger_interval == 0 or it == args.train_iters
            # the summary's gradient fidelity and noise ratio; that step is not timed
            report = request_final_fidelity(comp.trainer, it, args.train_iters)
            for r in (stock, comp):
                r.step(measure, timed=it > 1 and not (report and r is comp))
            if it % args.log_interval == 0 or it == args.train_iters:
                log(f" iteration {it:4d}/{args.train_iters} | stock loss {stock.losses[-1]:.4f} | "
                    f"compressed loss {comp.losses[-1]:.4f} | saved MiB/micro-batch stock "
                    f"{sum(stock.by_site.values()) / MiB:.3f}, compressed "
                    f"{sum(comp.by_site.values()) / MiB:.3f}")
        for r in (stock, comp):
            r.evaluate()
        table = _table(stock, comp, args, data.sha256)
        path = plot(stock, comp, os.path.abspath(os.path.join(output_dir, PLOT_NAME)),
                    f"llm-act train: GPT {args.num_layers}x{args.hidden_size}, seq {args.seq_length}, "
                    f"micro-batch {args.micro_batch_size}, plan {args.act_config.plan}")
        log("")
        log(table)
        log(f"plot: {path} (--output-dir {output_dir})")
        return {"stock": stock, "compressed": comp, "table": table, "plot": path}
    finally:
        parallel.destroy_parallel()
