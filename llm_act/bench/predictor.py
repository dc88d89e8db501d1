"""Which measured quantity predicts a run's final loss gap (issue 42 item 2)?

Every non-stock run of a convergence JSON is one point: its final validation loss over stock's
at the same seed (`convergence.final`), and the candidates, each read from what the run saved:

- `noise ratio`: the last gradient-noise ratio (the compressed gradient's squared error over
  the gradient's mini-batch sampling variance): the quantity plan "auto" budgets;
- `gradient error`: the last fidelity report's relative gradient error ||g - g*|| / ||g*||;
- `early train gap`: the mean training loss over iterations 61-120 over stock's, minus 1 (the
  error early in training, before the plans of "auto" settle);
- `mid valid gap`: the validation loss at the middle point of the curve over stock's, minus 1;
- `plan changes`: how often the plan changed (0 for a fixed plan).

Candidates are ranked by Spearman's rank correlation with the final gap on one set of runs
(`--fit`, the seeds the causes were looked for on), and the ranking is reported on another
(`--report`, fresh seeds). A run lacking a candidate (the 1-ulp control has no fidelity
report) is left out of that candidate's correlation only.

    python -m llm_act.bench.predictor --fit docs/convergence_llama_2026-12-06.json ... \\
        --report docs/convergence_llama_fresh_2026-12-06.json ...
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable, Optional, Sequence

from llm_act.bench.convergence import final

#: iterations (1-based, inclusive) of the early training-loss gap
EARLY = (61, 120)


def _early_train_gap(run: dict, stock: dict) -> Optional[float]:
    lo, hi = EARLY
    ours, base = run.get("train") or [], stock.get("train") or []
    if len(ours) < hi or len(base) < hi:
        return None
    return sum(ours[lo - 1:hi]) / sum(base[lo - 1:hi]) - 1


def _mid_valid_gap(run: dict, stock: dict) -> Optional[float]:
    ours, base = run.get("valid") or [], stock.get("valid") or []
    if len(ours) < 3 or len(ours) != len(base):
        return None
    mid = len(ours) // 2
    return ours[mid] / base[mid] - 1


def _field(name: str) -> Callable[[dict, dict], Optional[float]]:
    def read(run: dict, stock: dict) -> Optional[float]:
        value = run.get(name)
        return None if value is None else float(value)
    return read


#: candidate -> how to read it from (run, stock at the same seed)
CANDIDATES: dict[str, Callable[[dict, dict], Optional[float]]] = {
    "noise ratio": _field("noise_ratio"),
    "gradient error": _field("fidelity"),
    "early train gap": _early_train_gap,
    "mid valid gap": _mid_valid_gap,
    "plan changes": lambda run, stock: float(run.get("changes") or 0),
}


def points(result: dict) -> list[dict]:
    """One point per non-stock run that has a stock run at its seed: its model, plan, seed,
    final gap and every candidate it has."""
    out = []
    for model, entry in result["models"].items():
        runs = entry["runs"]
        for key, run in runs.items():
            plan, _, seed = key.rpartition(" seed ")
            stock = runs.get(f"stock seed {seed}")
            if stock is None or plan.startswith("stock"):  # stock itself and its 1-ulp control
                continue
            point = {"model": model, "plan": plan, "seed": int(seed), "gap": final(run) / final(stock) - 1}
            for name, read in CANDIDATES.items():
                value = read(run, stock)
                if value is not None and math.isfinite(value):
                    point[name] = value
            out.append(point)
    return out


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks); nan with fewer than 3 points or
    a constant side."""
    if len(x) != len(y):
        raise ValueError("spearman: the two sides differ in length")
    if len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def correlations(pts: list[dict]) -> dict[str, tuple[float, int]]:
    """candidate -> (Spearman's rho with the final gap, runs that have it)."""
    out = {}
    for name in CANDIDATES:
        have = [p for p in pts if name in p]
        out[name] = (spearman([p[name] for p in have], [p["gap"] for p in have]), len(have))
    return out


def table(fit: list[dict], report: list[dict]) -> str:
    """Candidates ordered by |rho| on the fit set, with their rho on the report set."""
    on_fit, on_report = correlations(fit), correlations(report)
    order = sorted(CANDIDATES, key=lambda n: -abs(on_fit[n][0]) if math.isfinite(on_fit[n][0]) else 0.0)
    lines = ["| rank (fit) | candidate | Spearman rho, fit set (runs) | Spearman rho, report set (runs) |",
             "|---:|---|---:|---:|"]
    for i, name in enumerate(order, 1):
        (rf, nf), (rr, nr) = on_fit[name], on_report[name]
        lines.append(f"| {i} | {name} | {rf:+.2f} ({nf}) | {rr:+.2f} ({nr}) |")
    return "\n".join(lines)


def load(paths: Sequence[str]) -> list[dict]:
    """The points of every file, each run once (a file that went on from another holds the
    other's runs again: the same model, plan, seed and gap)."""
    seen: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            for point in points(json.load(f)):
                seen.setdefault((point["model"], point["plan"], point["seed"], point["gap"]), point)
    return list(seen.values())


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llm_act.bench.predictor", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", nargs="+", required=True, help="convergence JSONs the candidates are ranked on")
    p.add_argument("--report", nargs="+", required=True, help="convergence JSONs of other seeds")
    p.add_argument("--plans", nargs="+", default=None, help="only these plans' runs (default: every plan)")
    args = p.parse_args(argv)
    try:
        fit, report = load(args.fit), load(args.report)
    except (OSError, ValueError, KeyError) as err:
        print(f"predictor: cannot read the results: {err}", file=sys.stderr)
        return 2
    if args.plans:
        fit = [x for x in fit if x["plan"] in args.plans]
        report = [x for x in report if x["plan"] in args.plans]
    print(table(fit, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
