"""Where a 4-bit plan's loss gap comes from (issue 42, item 2): one site group lossy at a
time, and one kept at a time, on the convergence bench's Llama-style model in fp32.

Every variant is a fixed plan (the same choice in every layer), paired with stock at the
same seed as every convergence run is:
- "only G int4": every site kept but group G, which stores stochastic per-group INT4
  (unbiased); "only G int4_channel": the same with nearest-rounding per-channel INT4, the
  biased codec the default plan picks most (and, for q/k/v, "only qkv int2": the stochastic
  INT2 it picks there at times, and "only qk int2" / "only v int2" to tell the softmax's
  inputs from V);
- "compress but G": the "compress" plan (no few-bit codec: the gated MLP refuses it) with
  group G kept;
- "compress": that plan whole.

    OMP_NUM_THREADS=1 python -m llm_act.bench.attribution --seeds 1234-1236 \\
        --previous docs/convergence_llama_2026-12-06.json --save-json out.json

`--previous`: a convergence JSON of the same setting whose stock and "compress" runs at these
seeds are reused (fp32 on one thread reproduces them bit for bit). Saved after every run, and started
again with the same --save-json it goes on where it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from llm_act.sites import (
    ATTN_K,
    ATTN_OUT,
    ATTN_Q,
    ATTN_QKV_INPUT,
    ATTN_V,
    FINAL_NORM_INPUT,
    LN1_INPUT,
    LN2_INPUT,
    MLP_ACT_INPUT,
    MLP_FC1_INPUT,
    MLP_FC2_INPUT,
)

#: the site groups of a Llama-style block, by what their tensor is
GROUPS = {
    "residual": (LN1_INPUT, LN2_INPUT, FINAL_NORM_INPUT),   # the norms' inputs
    "normed": (ATTN_QKV_INPUT, MLP_FC1_INPUT),              # the norms' outputs, linears' inputs
    "qkv": (ATTN_Q, ATTN_K, ATTN_V),
    "attn.out": (ATTN_OUT,),
    "act": (MLP_ACT_INPUT,),
    "fc2": (MLP_FC2_INPUT,),
}
SR_CODEC, BIASED_CODEC = "int4", "int4_channel"


def compress_choice() -> dict[str, str]:
    """The "compress" plan of a gated MLP: every site at its default codec, no few-bit codec."""
    from llm_act.plan import compress_layer

    return dict(compress_layer(fewbit=False))


def variants() -> dict[str, dict[str, str]]:
    """{plan name: {site: choice}}, sites not named kept."""
    out: dict[str, dict[str, str]] = {}
    for name, sites in GROUPS.items():
        for codec in (SR_CODEC, BIASED_CODEC):
            out[f"only {name} {codec}"] = {s: codec for s in sites}
    out["only qkv int2"] = {s: "int2" for s in GROUPS["qkv"]}
    # which of them: q and k reach the loss through the softmax, v linearly
    out["only qk int2"] = {ATTN_Q: "int2", ATTN_K: "int2"}
    out["only v int2"] = {ATTN_V: "int2"}
    full = compress_choice()
    for name, sites in GROUPS.items():
        out[f"compress but {name}"] = {s: c for s, c in full.items() if s not in sites}
    out["compress"] = full
    return out


def gap_curve(result: dict, model: str, plan: str, window: int = 30) -> list[tuple[int, int, float]]:
    """(first, last iteration, mean relative gap in training loss to stock over the seeds)
    per `window` iterations: where in training a plan's loss gap comes from. Every run of
    one seed sees the same batches, so the per-iteration gap is paired."""
    import numpy as np

    runs = result["models"][model]["runs"]
    seeds = [s for s in result["seeds"] if f"{plan} seed {s}" in runs and f"stock seed {s}" in runs]
    gaps = np.array([np.asarray(runs[f"{plan} seed {s}"]["train"]) / np.asarray(runs[f"stock seed {s}"]["train"]) - 1
                     for s in seeds])
    mean = gaps.mean(axis=0)
    return [(a + 1, min(a + window, len(mean)), float(mean[a:a + window].mean()))
            for a in range(0, len(mean), window)]


def curve_table(result: dict, model: str, plans, window: int = 30) -> str:
    """Markdown: each plan's `gap_curve`, one column per window."""
    curves = {p: gap_curve(result, model, p, window) for p in plans}
    spans = [f"{a}-{b}" for a, b, _ in next(iter(curves.values()))]
    lines = ["| plan | " + " | ".join(spans) + " |", "|---|" + "---:|" * len(spans)]
    lines += [f"| {p} | " + " | ".join(f"{100 * g:+.2f}%" for _, _, g in c) + " |" for p, c in curves.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from llm_act.cli.main import seed_range

    p = argparse.ArgumentParser(prog="python -m llm_act.bench.attribution", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=seed_range, default=(1234, 1235, 1236), metavar="A-B")
    p.add_argument("--plans", nargs="+", default=None, help="a subset of the variants (default: all)")
    p.add_argument("--steps", type=int, default=None, help="default: the fp32 setting's")
    p.add_argument("--previous", default=None, help="a convergence JSON whose stock runs are reused")
    p.add_argument("--save-json", default=None, help="where the runs go (required unless --curve)")
    p.add_argument("--curve", default=None, metavar="JSON",
                   help="print the per-iteration training-loss gap of every plan of a convergence JSON "
                        "(Llama-style model), averaged over its seeds, and exit")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    from llm_act.bench import convergence as C

    p = parser()
    args = p.parse_args(argv)
    if args.curve:
        try:
            with open(args.curve) as f:
                done = json.load(f)
            print(curve_table(done, C.LLAMA_MODEL.name, done["plans"]))
        except (OSError, ValueError, KeyError) as err:
            p.error(f"--curve {args.curve}: not a convergence JSON with the Llama-style model ({err})")
        return 0
    if not args.save_json:
        p.error("--save-json: required (where the runs go)")
    torch.set_num_threads(1)
    table = variants()
    plans = tuple(args.plans or table)
    unknown = [p for p in plans if p not in table]
    if unknown:
        raise SystemExit(f"--plans: unknown variant(s) {unknown}; expected some of {list(table)}")
    steps = C.LOW_FLOOR.steps if args.steps is None else args.steps
    previous = None
    if os.path.exists(args.save_json):
        with open(args.save_json) as f:
            previous = json.load(f)
    elif args.previous:  # only its stock and "compress" runs at these seeds
        with open(args.previous) as f:
            donor = json.load(f)
        runs = donor["models"][C.LLAMA_MODEL.name]["runs"]
        previous = {**{k: donor[k] for k in ("steps", "quick", "setting")},
                    "models": {C.LLAMA_MODEL.name: {"model": donor["models"][C.LLAMA_MODEL.name]["model"], "runs": {
                        f"{plan} seed {s}": runs[f"{plan} seed {s}"] for s in args.seeds
                        for plan in ("stock", "compress") if f"{plan} seed {s}" in runs}}}}
    command = "python -m llm_act.bench.attribution " + " ".join(
        a if " " not in a else json.dumps(a) for a in (sys.argv[1:] if argv is None else argv))
    t0 = time.perf_counter() - (previous or {}).get("wall_s", 0.0)

    def save(result: dict) -> None:
        result["wall_s"] = time.perf_counter() - t0
        result["command"], result["variants"] = command, {p: table[p] for p in plans}
        tmp = args.save_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.save_json)

    result = C.run(steps=steps, seeds=args.seeds, plans=plans, models=(C.LLAMA_MODEL,),
                   log=lambda m: print(m, flush=True), previous=previous, save=save,
                   setting=C.LOW_FLOOR, choices=table)
    from llm_act.bench.record import now_utc, versions

    result["complete"] = True
    result["when"], result["versions"] = now_utc(), versions()
    save(result)
    print(C.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
