"""docs/benchmarks.md: every section with the machine, the versions and the command that
made it, tables from the suites and plots beside them (matplotlib, Agg)."""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from llm_act.bench import convergence as C, doc_tables, gpu as G, hf_peak, kernels, memory as M, \
    overhead as O, peak as PK, planner as P
from llm_act.bench.record import now_utc, provenance_line, run_record, write_json

GPU_PENDING = ("pending: no GPU in this run. One run fills this section in (about 9 minutes at "
               "most, every step under its own `timeout`): `bash tools/fetch_gpu_wheels.sh` (cp312 "
               "wheels of megatron-core, pulp and highspy into .whl/), then copy the tree and .whl/ "
               "to a GPU host with Python 3.12 and run `bash tools/gpu_suite.sh` there: the gpu tests, `llm-act bench kernels --size-mib 256`, "
               "`llm-act bench gpu` (GPT ~1.3B: stock, Megatron selective and full recompute as our "
               "plans and as megatron-core's own options, ours keep / compress / auto at each full "
               "recompute's memory; tokens/s, peak memory, "
               "the largest micro-batch, the issue's targets as PASS/FAIL lines) and 10 "
               "iterations of `launch/pretrain_gpt.py` with and without `--act-compress`; "
               "$OUT/SUMMARY.md holds the device, versions, commands and tables.")
#: seconds `llm-act bench gpu` spends measuring before it writes what it has (the suite
#: gives the step 240 s and sets 180); LLM_ACT_GPU_BENCH_SECONDS overrides
GPU_TIME_BUDGET_S = 210.0


def provenance(command: str, wall_s: Optional[float] = None, device: Optional[torch.device] = None,
               when: Optional[str] = None, reused_by: Optional[str] = None) -> str:
    """The machine, versions, command, wall time and date of a section (`when`/`reused_by`:
    a result made earlier by `command` and read back by `reused_by`)."""
    return provenance_line(run_record(command, wall_s, device, when), reused_by)


def memory_plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    drops = sorted({r["shape"].dropout for r in rows})
    names = list(dict.fromkeys(r["scheme"] for r in rows))
    by = {(r["scheme"], r["shape"].dropout): r["per_sbh"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8 / len(drops)
    for k, d in enumerate(drops):
        ax.bar([i + k * w for i in range(len(names))], [by.get((n, d), 0) for n in names], w,
               label=f"dropout {d}")
    ax.set_xticks([i + w * (len(drops) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("bytes per s*b*h (ledger)")
    ax.set_title(f"saved activations of one GPT block: {M.describe(rows[0]['shape'])}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def memory_section(rows: list[dict], command: str, wall_s: float, plot: Optional[str],
                   hf_sites: Optional[list[dict]] = None, hf_why: str = "") -> str:
    shape = rows[0]["shape"]
    lines = [
        "## 1. Memory per layer (ledger)", "",
        provenance(command, wall_s), "",
        f"One megatron-core TransformerLayer ({M.describe(shape).rsplit(' dropout', 1)[0]}, local "
        "spec, RoPE, bias on), the same weights and input for every scheme. Bytes held for "
        "backward at the end of forward by the `SavedTensorLedger`, per s*b*h (RoPE tables "
        "and the causal mask included, as in the ledger test), and the ratio to stock. "
        "\"process\": bytes the process holds after forward (profiler), the independent check.",
        "", M.table(rows), "",
        "Choices per site (dropout 0.1):", "", M.plans_table(rows), "",
        "Notes: " + "; ".join(f"**{r['scheme']}**: {r['note']}" for r in rows
                              if r["shape"].dropout == shape.dropout),
    ]
    if plot:
        lines += ["", f"![memory per scheme]({os.path.basename(plot)})"]
    lines += ["", "Hugging Face decoders under the DeepSpeed door, per site: what block 0 of a Llama and a "
              "Qwen3 stores at ZeRO-0 (fp32), kept, in INT8 and INT4 (a site holding several tensors, all "
              "of them), and the choice of \"auto\" at the CPU's reference budget, from the profile it "
              "measured on its own steps (`llm_act.bench.hf_peak.site_rows`):", ""]
    lines += [hf_peak.sites_table({"sites": hf_sites}) if hf_sites else f"(not measured: {hf_why})"]
    return "\n".join(lines)


def convergence_section(results: list[dict], command: str, plot: Optional[str]) -> str:
    """Section 2 from one result per setting: the low-floor (fp32) measurement first, the
    bf16 runs after it as confirmation."""
    ordered = sorted(results, key=lambda r: C.setting_of(r) is not C.LOW_FLOOR)
    first = ordered[0]
    verdict = C.verdict_plan(first)
    named = (f"\"{verdict}\": `--act-compress` alone, plan \"auto\" at its default budget, what one "
             f"flag gives a user" if verdict == C.DEFAULT else f"\"{verdict}\"")
    gact = any(C.GACT in r["plans"] for r in results)
    lines = [f"## 2. Convergence ({first['steps']} steps{', quick' if first.get('quick') else ''})", "",
             "A plan meets the loss target only when the one-sided 95% upper bound on its paired gap "
             "to stock does (t over the seeds, not a point estimate), for the one plan named before "
             f"running ({named}); beside every plan stands a control, stock perturbed "
             "at the rounding scale, whose spread is the floor. Targets (issues 28 and 42): the bound at most "
             f"{C.TARGET_GAP:+.1%} against stock" + (f" and {C.TARGET_VS_GACT:+.1%} against {C.GACT}"
                                                     if gact else "")
             + f", storing at most {C.TARGET_FRACTION} of stock's layer bytes, and the positive control "
             f"({C.INT2_EVERYWHERE}) failing it. Plan changes are counted after warm-up (the first "
             f"{C.WARMUP_FRACTION:.0%} of the iterations), per 100 iterations."]
    for result in ordered:
        setting = C.setting_of(result)
        models = "; ".join(f"**{name}**: {e['describe']}" for name, e in result["models"].items())
        title = ("Low floor: fp32" if setting is C.LOW_FLOOR else
                 "Confirmation: bf16" if len(ordered) > 1 else "bf16")
        lines += [
            "", f"### {title} ({len(result['seeds'])} seeds)", "",
            provenance(result.get("command", command), result.get("wall_s"), when=result.get("when"),
                       reused_by=command), "",
            *([f"The seeds ran in {len(result['wall_parts'])} processes side by side (one thread each), "
               f"taking {', '.join(f'{w:.0f} s' for w in result['wall_parts'])}.", ""]
              if result.get("wall_parts") else []),
            f"{models}. {result['describe']}. Validation loss (nats/byte) at the end on "
            f"{C.evaluation(result)}; unigram entropy of the corpus: **{result['entropy']:.4f}** nats/byte. Every plan "
            f"is paired with stock at each seed (same initial weights and batches). Memory: the "
            f"saved-tensor ledger of the last step's first micro-batch in the layers, against stock's. "
            f"Measuring share: time spent measuring, planning and reporting gradient fidelity over the "
            f"run's wall time."
            + (f" \"{C.AUTO_TARGET} unbiased\": the same plan with biased codecs excluded "
               f"(`biased_codecs=\"exclude\"`) instead of charged their measured coherence."
               if f"{C.AUTO_TARGET} unbiased" in result["plans"] else "")
            + ("" if setting is C.LOW_FLOOR or len(ordered) == 1 else
               " These runs were saved on the date above and are read back as they are: they "
               "confirm how chaotic bf16 training is here (the control's spread), not today's "
               "codecs and planner."), "",
            C.table(result), "",
            *C.sentences(result), "",
            "Every run (fidelity: the relative error of the compressed gradient against the exact one "
            "on one micro-batch at the run's last report; noise ratio: its squared error over the "
            "gradient's mini-batch sampling variance):", "",
            C.runs_table(result),
        ]
    if plot:
        lines += ["", f"![loss gap against memory]({os.path.basename(plot)})"]
    return "\n".join(lines)


def planner_section(solve_rows: list[dict], compare_rows: list[dict], command: str, wall_s: float,
                    shape_desc: str, distinct_rows: Optional[list[dict]] = None,
                    overhead: Optional[dict] = None, jittered_rows: Optional[list[dict]] = None,
                    repeat: Optional[dict] = None) -> str:
    return "\n".join([
        "## 3. Planner", "",
        provenance(command, wall_s), "",
        f"Solve time of `solve_plan` on the analytic profile of {P.MODEL} (micro-batch 1), "
        f"budget {P.BUDGET_FRACTION:.0%} of stock activations, noise budget of the compress "
        "plan. Identical layers share one block (count = depth), as measured profiles group "
        "them.", "",
        P.solve_table(solve_rows), "",
        *([f"With per-layer sensitivities (each layer's scaled by a factor drawn from [0.5, 1.5)) "
           "every layer is its own block and the noise budget is set to 80% of the compress plan's, "
           "so it binds. Proving such a plan optimal can take minutes, so from 16 distinct blocks "
           "`solve_plan` takes its fast path (`llm_act.planner.lagrange`): the best uniform plan "
           "(the exact MILP of the merged blocks), then per-block choices under prices on the "
           "memory and noise budgets, checked exactly and kept only if faster. The table gives its "
           f"solve time and its gap to the best plan the full MILP finds in {distinct_rows[0]['time_limit']:g} s:",
           "",
           P.distinct_table(distinct_rows), ""] if distinct_rows else []),
        *([f"Measured profiles also differ per layer in their times: here every time (producer, "
           f"codec encode and decode, whole block) and every site's noise is also off by up to "
           f"{P.JITTER:.0%} per layer. The fast path merges layers of one structure (count-weighted "
           "mean times and noise, exact for a uniform plan) and prices each layer's own figures; "
           "the adapter rounds times to their measurement noise "
           f"({P.TIME_RESOLUTION:.0%}) so that near-ties go to the lower noise. Against the full MILP's "
           "best plan and the lower bound it proves:", "",
           P.jittered_table(jittered_rows), ""] if jittered_rows else []),
        *([P.reproducibility_line(repeat), ""] if repeat else []),
        f"Predicted (analytic profile, `evaluate_plan`, no transient peak) against measured "
        f"(ledger, the block's own sites) bytes per block, {shape_desc}:", "",
        P.compare_table(compare_rows), "",
        "The analytic profile is an idealised layout: it counts a norm's input without its "
        "fp32 statistics, with learned positions Q, K and V as three tensors (megatron's are "
        "views of one QKV buffer that stays whole while any of them is kept; with RoPE, as here, "
        "only V is a view, and keeping it is counted as the whole buffer), the stock softmax "
        "once in the model dtype (megatron keeps an fp32 softmax and a bf16 copy) and dropout masks at 1 byte (megatron on CPU keeps them in "
        "the model dtype); the measured profile (`llm_act.measurement.measure`) replaces it "
        "during training.",
        *(["", "What measuring costs: plan \"auto\" (no budget: the compress plan's memory) on the "
           "bench GPT of the convergence section, in our loop, measuring from its own training steps "
           "(`llm_act.measurement.replay`) as in every door; the share of the run's wall time spent at its "
           "tracking points (profile, sparse sensitivity passes, agreement, solve), target at most 2% "
           "over 300 steps:", "", O.table(overhead)] if overhead else []),
    ])


def gpu_section(result: Optional[dict], command: str, kernels_text: Optional[str] = None,
                wall_s: Optional[float] = None, kernel_rows: Optional[list[dict]] = None,
                kernel_header: str = "", plot: Optional[str] = None) -> str:
    lines = ["## 4. GPU", ""]
    if result is None:
        return "\n".join(lines + [GPU_PENDING])
    dev = torch.device("cuda" if result.get("memory_kind") == "cuda peak" else "cpu")
    lines += [provenance(command, wall_s, dev), "", G.markdown(result, kernel_rows, kernel_header)]
    if kernels_text and not kernel_rows:
        lines += ["", "Codec bandwidth against copy bandwidth:", "", kernels_text]
    if plot:
        lines += ["", f"![throughput and memory against micro-batch size]({os.path.basename(plot)})"]
    return "\n".join(lines)


def replace_section(path: str, text: str) -> bool:
    """Put `text` (a section starting "## N.") in place of section N of the benchmarks page at
    `path`, the rest untouched: how `llm-act bench convergence --convergence-json` re-renders
    section 2 from its saved runs without training again. False when the page or its
    section N is not there (nothing written)."""
    import re

    if not os.path.exists(path):
        return False
    number = re.match(r"## (\d+)\.", text)
    if number is None:
        raise ValueError("replace_section: the text must start with its '## N.' heading")
    with open(path) as f:
        page = f.read()
    found = re.search(rf"^## {number.group(1)}\..*?(?=^## \d+\.|\Z)", page, re.M | re.S)
    if found is None:
        return False
    with open(path, "w") as f:
        f.write(page[:found.start()] + text.rstrip("\n") + "\n\n" + page[found.end():].lstrip("\n"))
    return True


def write(path: str, sections: list[str]) -> str:
    head = ("# llm_act benchmarks\n\nGenerated by `llm-act bench all` (sections say which "
            "command made them). Bytes come from the ledger, cross-checked by process memory; "
            "times are ratios measured side by side in one run.\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(head + "\n" + "\n\n".join(sections) + "\n")
    return path


# ---- the suites behind `llm-act bench memory|convergence|planner|gpu|all` ----------------


def run_memory(quick: bool, output_dir: str, command: str, log=print) -> tuple[list[dict], str]:
    import time

    t0 = time.perf_counter()
    base = M.block_shape(s=128, b=2, h=256, a=8) if quick else M.block_shape()
    shapes = [base] if quick else [base, M.block_shape(dropout=0.1)]
    if quick:
        shapes.append(M.block_shape(s=128, b=2, h=256, a=8, dropout=0.1))
    rows = M.run(shapes, log=log)
    plot = memory_plot(rows, os.path.join(output_dir, "memory_per_layer.png"))
    hf_sites, hf_why = None, ""
    missing = [m for m in ("deepspeed", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        hf_why = f"needs {' and '.join(missing)}: pip install 'llm-act[deepspeed,hf]'"
    else:
        hf_sites = hf_peak.site_rows(2, 64) if quick else hf_peak.site_rows()
    text = memory_section(rows, command, time.perf_counter() - t0, plot, hf_sites, hf_why)
    log(text)
    return rows, text


def run_convergence(quick: bool, output_dir: str, command: str, log=print,
                    results: Optional[list[dict]] = None, save_json: Optional[str] = None,
                    setting: Optional[C.Setting] = None, seeds=None) -> tuple[list[dict], str]:
    """The convergence section. `results`: saved ones (merged per setting); `setting`: the
    one to train (default: the low floor), its unfinished result completed (its runs kept),
    `seeds` a subset of its seeds (to split the bench over processes); `save_json`: where
    its result is saved after every run. Without `setting` and with results, nothing trains."""
    import json
    import time

    by_setting: dict[str, list[dict]] = {}
    for r in results or []:
        by_setting.setdefault(C.setting_of(r).name, []).append(r)
    merged = {name: C.merge(rs) for name, rs in by_setting.items()}
    if setting is not None or not merged:
        setting = setting or C.LOW_FLOOR
        result = merged.get(setting.name)
        if result is None or not result.get("complete") or seeds:
            t0 = time.perf_counter() - (result or {}).get("wall_s", 0.0)

            def save(partial: dict) -> None:
                partial["wall_s"] = time.perf_counter() - t0
                if save_json:
                    with open(save_json, "w") as f:
                        json.dump(partial, f)

            if quick:
                result = C.run(steps=30, quick=True, seeds=(1234, 1235), plans=(C.DEFAULT, "compress", "auto 0.15"),
                               models=(C.QUICK_MODEL,), log=log, previous=result, save=save, setting=setting)
            else:
                result = C.run(log=log, previous=result, save=save, setting=setting, seeds=seeds)
            result["complete"] = True
            result["command"], result["when"] = command, now_utc()
            save(result)
            merged[setting.name] = result
    results = list(merged.values())
    primary = merged.get(C.LOW_FLOOR.name, results[0])
    plot = C.plot(primary, os.path.join(output_dir, "convergence.png"))
    text = convergence_section(results, command, plot)
    log(text)
    return results, text


def run_planner(quick: bool, command: str, memory_rows: Optional[list[dict]] = None,
                log=print) -> tuple[dict, str]:
    import time

    t0 = time.perf_counter()
    solve = P.solve_times(P.DEPTHS[:2] if quick else P.DEPTHS)
    distinct = P.distinct_solve_times(P.DEPTHS[:1], time_limit=2.0) if quick else P.distinct_solve_times()
    jittered = (P.jittered_solve_times(P.DEPTHS[:1], time_limit=2.0) if quick
                else P.jittered_solve_times((24, 96, 192)))
    repeat = P.reproducibility(24 if quick else 96, repeats=3 if quick else P.REPEATS)
    shape = (M.block_shape(s=128, b=2, h=256, a=8, dropout=0.1) if quick else M.block_shape(dropout=0.1))
    names = ("stock", "megatron full", "compress (Adacc)", "planner middle") if quick else P.COMPARED
    comp = P.compare(shape, memory_rows, names=names, log=log)

    over = O.run(steps=8 if quick else 300, quick=quick)  # quick: tracking at 1, 2, 4, 8
    wall = time.perf_counter() - t0
    text = planner_section(solve, comp, command, wall, M.describe(shape), distinct, over, jittered, repeat)
    log(text)
    return {**run_record(command, wall), "solve": solve, "distinct": distinct, "jittered": jittered,
            "repeat": repeat, "compare": comp, "compare_shape": M.describe(shape), "overhead": over}, text


def run_peak(command: str, log=print) -> tuple[dict, str]:
    """`llm-act bench peak`: the planner's peak of a step against the measured one
    (`llm_act.bench.peak`), with its run's record."""
    import time

    t0 = time.perf_counter()
    result = PK.run(log)
    result = {**run_record(command, time.perf_counter() - t0), **result}
    text = "\n".join([provenance_line(result), "", result["model"], "", PK.table(result)])
    log(text)
    return result, text


def saved(result: dict, path: str, output_dir: str, log=print) -> None:
    """`--save-json`: write `result` to `path`, then render again the tables of
    `output_dir`/benchmarks.md marked as rendered from that file."""
    log(f"wrote {write_json(path, result)}")
    page = os.path.join(output_dir, "benchmarks.md")
    if os.path.exists(page):
        kinds = doc_tables.refresh(page, source=path)
        if kinds:
            log(f"rendered {', '.join(kinds)} in {page} from {path}")


def run_gpu(command: str, log=print, output_dir: Optional[str] = None) -> tuple[Optional[dict], str]:
    """The GPU section: the kernels' bandwidth (256 MiB tensors), then `bench.gpu.run` within
    `GPU_TIME_BUDGET_S`; with `output_dir`: gpu.md, gpu.json and gpu_throughput.png there.
    Without CUDA: the "pending" text."""
    import time

    if not torch.cuda.is_available():
        text = gpu_section(None, command)
        log(text)
        return None, text

    t0 = time.perf_counter()
    header, krows = kernels.run(size_mib=256.0, device="cuda")
    log(kernels.table(header, krows))
    budget = float(os.environ.get("LLM_ACT_GPU_BENCH_SECONDS", GPU_TIME_BUDGET_S))
    result = G.run(log=log, time_budget_s=max(0.0, budget - (time.perf_counter() - t0)))
    plot = os.path.join(output_dir, "gpu_throughput.png") if output_dir else None
    text = gpu_section(result, command, None, time.perf_counter() - t0, krows, header, plot)
    if output_dir:
        G.save(result, output_dir, text, krows)
    log(text)
    return result, text


def main(args, argv=None) -> int:
    """`llm-act bench <suite>` (not kernels): print the tables, write plots (and, for
    `all`, benchmarks.md) under --output-dir."""
    import json
    import sys
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|CUDA_DEVICE_MAX).*")
    words = list(sys.argv[1:] if argv is None else argv)
    command = "llm-act " + " ".join(words)
    say = lambda m: print(m, flush=True)  # noqa: E731
    conv = []
    for path in getattr(args, "convergence_json", None) or []:
        with open(path) as f:
            conv.append(json.load(f))
    if args.suite == "memory":
        run_memory(args.quick, args.output_dir, command, say)
    elif args.suite == "convergence" and getattr(args, "door", "megatron") == "deepspeed":
        from llm_act.bench import hf_convergence

        others = [flag for flag, given in (("--setting", args.setting), ("--convergence-json", conv),
                                           ("--quick", args.quick)) if given]
        if others:
            raise SystemExit(f"llm-act bench convergence: --door deepspeed trains its own Hugging Face Llama "
                             f"setting; drop {', '.join(others)}")
        hf_convergence.run_saved(args.seeds, None, args.save_json, command, say)
    elif args.suite == "convergence":
        setting = C.SETTINGS[args.setting] if args.setting else (None if conv else C.LOW_FLOOR)
        if args.save_json and os.path.exists(args.save_json):
            with open(args.save_json) as f:
                conv.append(json.load(f))  # an interrupted run goes on where it stopped
        _, text = run_convergence(args.quick, args.output_dir, command, say, conv, args.save_json,
                                  setting, args.seeds)
        page = os.path.join(args.output_dir, "benchmarks.md")
        if replace_section(page, text):  # section 2 of an existing page, re-rendered in place
            say(f"wrote section 2 of {page}")
    elif args.suite == "planner":
        result, _ = run_planner(args.quick, command, None, say)
        if args.save_json:
            saved(result, args.save_json, args.output_dir, say)
    elif args.suite == "peak":
        result, _ = run_peak(command, say)
        if args.save_json:
            saved(result, args.save_json, args.output_dir, say)
    elif args.suite == "hf-peak":
        from llm_act.bench import hf_peak

        hf_peak.run_saved(args.save_json, command, say)
    elif args.suite == "hf-convergence":
        from llm_act.bench import hf_convergence

        hf_convergence.run_saved(args.seeds, args.steps, args.save_json, command, say)
    elif args.suite == "gpu":
        run_gpu(command, say, args.output_dir)
    elif args.suite == "overhead":
        row = O.run(steps=args.steps, quick=args.quick, budget_fraction=args.budget_fraction)
        say(O.table(row))
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, "overhead.json")
        with open(path, "w") as f:
            json.dump({"command": command, **row}, f, indent=1)
        say(f"wrote {path}")
    elif args.suite == "all":
        rows, mem = run_memory(args.quick, args.output_dir, command, say)
        _, con = run_convergence(args.quick, args.output_dir, command, say, conv)
        _, pla = run_planner(args.quick, command, rows, say)
        _, gpu = run_gpu(command, say, args.output_dir)
        path = write(os.path.join(args.output_dir, "benchmarks.md"), [mem, con, pla, gpu])
        say(f"wrote {path}")
    else:
        raise ValueError(f"suite: unknown benchmark suite {args.suite!r}")
    return 0
