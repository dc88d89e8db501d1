"""A part of a convergence bench setting: some models, plans and seeds.

`llm-act bench convergence --setting fp32` trains every model, plan and seed of
`convergence.LOW_FLOOR` (about 180 runs; `--setting bf16`: `convergence.BF16`, its
confirmation in bf16). This runs a part of one, in one process, into a JSON that
`llm-act bench convergence --convergence-json` reads back and merges with the other parts
(the same setting, steps and corpus):

    OMP_NUM_THREADS=1 python -m llm_act.bench.convergence_pilot --models llama \\
        --plans default compress "stock, 1 ulp" --seeds 1234-1243 --save-json out.json

The result is saved after every run; started again with the same --save-json, it goes on
where it stopped (the runs it holds are kept), also with more plans or seeds than before
(every command that trained its runs is kept in "commands").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from llm_act.bench import convergence as C


def _seeds(text: str) -> tuple[int, ...]:
    from llm_act.cli.main import seed_range

    return seed_range(text)


def _models() -> dict:
    """Every bench model by name, over the settings (they share the low floor's three)."""
    return {m.name: m for s in C.SETTINGS.values() for m in s.models}


def parser() -> argparse.ArgumentParser:
    setting = C.LOW_FLOOR
    models = _models()
    p = argparse.ArgumentParser(prog="python -m llm_act.bench.convergence_pilot", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=tuple(C.SETTINGS), default=C.LOW_FLOOR.name,
                   help="fp32: the low floor, where verdicts come from (default); bf16: its "
                        "confirmation in bf16, with its own control")
    p.add_argument("--models", nargs="+", choices=tuple(models), default=None,
                   help="default: the setting's models")
    def plan(text: str) -> str:
        try:
            if text in (*setting.plans, C.DEFAULT_UNBIASED, C.DEFAULT_CHARGED) or C.noise_fraction_of(text) is not None:
                return text
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(repr, setting.plans))}, "
                                         f"{C.DEFAULT_UNBIASED!r}, {C.DEFAULT_CHARGED!r} or "
                                         f"'{C.DEFAULT_AT_NOISE}X', got {text!r}")

    p.add_argument("--plans", nargs="+", type=plan, default=None, metavar="PLAN",
                   help="besides stock, which every seed runs first (default: the setting's): its plans, or "
                        f"'{C.DEFAULT_AT_NOISE}X' (the default plan at noise fraction X), or "
                        f"{C.DEFAULT_UNBIASED!r} / {C.DEFAULT_CHARGED!r} (the default plan with biased codecs "
                        "excluded / charged, said explicitly)")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="A-B",
                   help="a range A-B or a comma list (default: the setting's 10)")
    p.add_argument("--steps", type=int, default=setting.steps)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--save-json", required=True)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    setting = C.SETTINGS[args.setting]
    models = _models()
    previous = None
    if os.path.exists(args.save_json):
        with open(args.save_json) as f:
            previous = json.load(f)
        held = (C.setting_of(previous).name, previous.get("steps"))
        if held != (setting.name, args.steps):  # `run` would start afresh and save over it
            raise SystemExit(f"convergence_pilot: {args.save_json} holds runs of setting {held[0]!r} at "
                             f"{held[1]} steps, not {setting.name!r} at {args.steps}; give another --save-json")
    command = "python -m llm_act.bench.convergence_pilot " + " ".join(
        a if a and " " not in a and "," not in a else json.dumps(a) for a in (sys.argv[1:] if argv is None else argv))
    t0 = time.perf_counter() - (previous or {}).get("wall_s", 0.0)
    # every command that trained runs of this JSON, in order (one that went on with more plans
    # or seeds after another is added to it)
    commands = list((previous or {}).get("commands") or ([previous["command"]] if previous and previous.get("command")
                                                          else []))
    if command not in commands:
        commands.append(command)

    def save(result: dict) -> None:
        result["wall_s"] = time.perf_counter() - t0
        result["command"], result["commands"] = command, commands
        tmp = args.save_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.save_json)

    result = C.run(steps=args.steps, seeds=args.seeds, plans=args.plans and tuple(args.plans),
                   models=args.models and tuple(models[n] for n in args.models),
                   log=lambda m: print(m, flush=True), previous=previous, save=save, setting=setting)
    from llm_act.bench.record import now_utc, versions

    result["complete"] = True
    result["when"], result["versions"] = now_utc(), versions()
    save(result)
    print(C.table(result))
    print("\n".join(C.sentences(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
