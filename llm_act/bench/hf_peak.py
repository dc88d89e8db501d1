"""`llm-act bench hf-peak`: the predicted peak of a Hugging Face decoder's training step under
the DeepSpeed door against a measured one (issue 45, item 2), per plan, at ZeRO-0 and ZeRO-3.

    llm-act bench hf-peak --save-json docs/hf_peak.json

What is compared: "auto"'s prediction for a plan, from the profile it measured on the real
steps (`evaluate_plan` on the profile's blocks with every codec it measured: the sites' stored
bytes and a block's backward transient with its gradients in flight, plus the bytes the
ledger saw outside the blocks), against the peak of live tensor storage over one forward and
backward (`live_storage.LiveStorageTracker`, above the step's entry state: weights, their
gradients allocated, the optimizer's state; after a warm-up step under the same plan). The
plans: "keep", "compress" (the plan "auto" starts from), INT4 at every site the blocks store,
whole-block recompute with the block input kept, the plan "auto" chose at the CPU's reference
budget (the "compress" plan's bytes), and "auto" at a looser budget (halfway between its plan's
memory and keep's).

What counts as the peak under ZeRO-3: the tracker counts every storage the step creates, so
parameters ZeRO-3 gathers for a block's forward and backward (and frees after) would be in
the measured figure, and the prediction does not model them (on CPU `memory.static_bytes`
counts this rank's partition of the weights and gradients). On one rank the partition is
the whole parameter and gathering allocates nothing, so ZeRO-3 measures as ZeRO-0 does; on
N ranks one block's gathered weights come on top (here 0.74 MB: 6 layers, hidden 128,
sequence 128, micro-batch 4, vocabulary 256, against peaks of 7-39 MB).

What the prediction prices (`MeasuredProfile.backward_priced`, the generic door): the loss's
backward (`Controller.loss_event_bytes`, the logits' gradients) with what the forward saved
after the blocks (logits, log-probabilities, the output layer's input: `after_blocks_bytes`),
freed before any block backpropagates; each block's gradients in flight per backward stage,
from its sites' shapes (`MeasuredProfile.grad_stages`); and whole-block recompute's checkpoint
at the block input alone (`BlockProfile.checkpoint_bytes`), the RMSNorm's normalised copy its
site also holds being rebuilt with the block. Every plan is then within 3% at each depth
measured (docs/benchmarks.md section 5).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from typing import Callable, Optional

import torch

from llm_act.bench.live_storage import LiveStorageTracker
from llm_act.bench.peak import GPU_KERNEL_ONLY, gap
from llm_act.bench.record import run_record, write_json
from llm_act.sites import SITES

MODEL = dict(hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2, ffn_hidden_size=352, max_positions=128)
SEQ, MICRO_BATCH = 128, 4
KINDS = ("llama", "qwen3")
STAGES = (0, 3)
#: what `site_rows` may set up for its one rank, and puts back (a caller's later child processes
#: would otherwise inherit a port this process listens on)
_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
#: (layers, sequence) the Llama is measured at besides `MODEL`'s, at ZeRO-0: the gaps by depth
DEPTHS = ((2, 64), (2, 128))


def _engine(kind: str, stage: int, model_kw: Optional[dict] = None):
    from llm_act.patches.deepspeed import hf_decoder, initialize

    model = hf_decoder.build(kind, seed=7, **(model_kw or MODEL))
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
              "activation_compression": {"plan": "auto", "adapt": False}}
    return initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def _step(engine, seed: int, tracker=None, seq: Optional[int] = None) -> None:
    ids = torch.randint(0, 256, (MICRO_BATCH, (seq or SEQ) + 1), generator=torch.Generator().manual_seed(seed))
    if tracker is not None:
        for p in engine.module.parameters():  # the gradients exist at entry, as the planner's static memory says
            if p.grad is None and getattr(p, "ds_tensor", None) is None:
                p.grad = torch.zeros_like(p)
        gc.collect()
    with tracker if tracker is not None else contextlib.nullcontext():
        engine.backward(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss)
    engine.step()


def measure_rows(kind: str, stage: int, layers: Optional[int] = None,
                 seq: Optional[int] = None) -> tuple[list[dict], list[dict]]:
    """([{model, stage, plan, predicted, stored, transient, measured, peak_at}] for each plan,
    [{model, stage, site, shape, keep, int8, int4, auto}] for each site of block 0), of `MODEL`
    or of it at `layers` layers and sequence `seq`."""
    from llm_act.plan import keep_layer, recompute_layer
    from llm_act.planner import evaluate_plan

    seq = seq or SEQ
    engine, model_kw, compress = _measured(kind, stage, layers, seq)
    c = engine.act_controller
    profile = c.adapter.measured.profile
    _, static = c.adapter.problem(profile)
    # per layer, with every codec it measured: fixed plans use biased ones, and a plan may split a group
    blocks = profile.blocks(recompute=True, per_layer=True)
    plans = {"keep": {i: keep_layer() for i in c.layers},
             "compress": compress,
             "int4": {i: {site: "int4" for (layer, site) in profile.sites if layer == i} for i in c.layers},
             "whole-block recompute": {i: recompute_layer() for i in c.layers},
             "auto": dict(c.plan)}
    # "auto" at a second budget: halfway between its own plan's memory and keep's
    need = {name: evaluate_plan(blocks, profile.choice_for(plans[name], per_layer=True), ordered=True,
                                loss_bytes=profile.loss_bytes).activation_bytes for name in ("keep", "auto")}
    looser = static + (need["keep"] + need["auto"]) // 2
    plans["auto, looser budget"] = c.adapter.solve_alone(profile, looser)
    sites = _sites(kind, stage, profile, plans["auto"])
    rows = []
    for name, plan in plans.items():
        c.set_plan(plan)
        _step(engine, 10, seq=seq)  # put in force at this boundary; its buffers exist
        choice = profile.choice_for(plan, per_layer=True)
        ev = evaluate_plan(blocks, choice, loss_bytes=profile.loss_bytes, ordered=True)
        bound = evaluate_plan(blocks, choice, loss_bytes=profile.loss_bytes)  # order-blind, as the planner prices
        tracker = LiveStorageTracker(engine.module, inside_custom_ops=False, ignore_ops=GPU_KERNEL_ONLY)
        _step(engine, 11, tracker, seq=seq)
        rows.append({"model": kind, "stage": stage, "plan": name, "layers": model_kw["num_layers"], "seq": seq,
                     "predicted": ev.activation_bytes + profile.other_bytes,
                     "stored": ev.activation_bytes - ev.peak_bytes, "transient": ev.peak_bytes,
                     "other": profile.other_bytes, "bound": bound.activation_bytes + profile.other_bytes,
                     "measured": tracker.peak_bytes,
                     "peak_at": f"{tracker.peak_phase} {tracker.peak_op}"})
    return rows, sites


def _measured(kind: str, stage: int, layers: Optional[int] = None, seq: Optional[int] = None):
    """(an engine of `kind` under plan "auto" after its first tracking point, the model's
    keywords, the plan it started from: "compress"'s): `MODEL`, or it at `layers` layers and
    sequence `seq`."""
    seq = seq or SEQ
    model_kw = {**MODEL, "num_layers": layers or MODEL["num_layers"], "max_positions": max(seq, MODEL["max_positions"])}
    engine = _engine(kind, stage, model_kw)
    start = {layer: dict(choice) for layer, choice in engine.act_controller.plan.items()}
    for i in range(2):  # the first tracking point measures and plans
        _step(engine, i, seq=seq)
    return engine, model_kw, start


def _sites(kind: str, stage: int, profile, auto: dict) -> list[dict]:
    """[{model, stage, site, shape, keep, int8, int4, auto}] for each site of block 0."""
    return [{"model": kind, "stage": stage, "site": site, "shape": list(st.shape), "keep": st.keep_bytes,
             "int8": st.stored("int8"), "int4": st.stored("int4"), "auto": auto[0].get(site, "keep")}
            for (layer, site), st in sorted(profile.sites.items(), key=lambda kv: SITES.index(kv[0][1]))
            if layer == 0]


def site_rows(layers: Optional[int] = None, seq: Optional[int] = None) -> list[dict]:
    """What block 0 of the Llama and the Qwen3 (`MODEL`, or at `layers` layers and sequence
    `seq`) stores per site at ZeRO-0, from "auto"'s measured profile (`llm-act bench memory`'s
    Hugging Face rows); one gloo rank is set up where none is."""
    from llm_act.bench.hf_convergence import one_rank

    dist = torch.distributed
    started = not dist.is_initialized()
    env = {key: os.environ.get(key) for key in _RANK_ENV}
    try:
        one_rank()
        for key, value in (("RANK", dist.get_rank()), ("LOCAL_RANK", 0), ("WORLD_SIZE", dist.get_world_size()),
                           ("LOCAL_WORLD_SIZE", 1)):
            os.environ.setdefault(key, str(value))
        out = []
        for kind in KINDS:
            engine, _, _ = _measured(kind, 0, layers, seq)
            c = engine.act_controller
            out += _sites(kind, 0, c.adapter.measured.profile, c.plan)
        return out
    finally:  # leave the process as it was: no rank of ours listening, no rank variables
        if started and dist.is_initialized():
            from llm_act.train.parallel import forget_deepspeed_groups

            dist.destroy_process_group()
            forget_deepspeed_groups()
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run(log: Callable[[str], None] = print) -> dict:
    from llm_act.bench.hf_convergence import one_rank

    one_rank()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows, sites = [], []
    try:
        for kind in KINDS:
            for stage in STAGES:
                more, per_site = measure_rows(kind, stage)
                rows += more
                if stage == 0:
                    sites += per_site
                log(f"  measured {kind} ZeRO-{stage}")
        depths = [r for layers, seq in DEPTHS for r in measure_rows("llama", 0, layers, seq)[0]]
        depths += [r for r in rows if r["model"] == "llama" and r["stage"] == 0]
        log("  measured llama at other depths")
    finally:
        torch.set_num_threads(threads)
    return {"model": {**MODEL, "seq": SEQ, "micro_batch": MICRO_BATCH}, "rows": rows, "sites": sites,
            "depths": depths}


def table(result: dict) -> str:
    """Per model, ZeRO stage and plan: the predicted peak (in layer order) with its parts, the
    planner's order-blind bound, the measured peak, the gap and where the peak was."""
    lines = ["| model | ZeRO | plan | predicted (MB) | stored + transient + outside | planner's bound (MB) | "
             "measured (MB) | gap | measured peak at |", "|---|---:|---|---:|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        bound = f"{r['bound'] / 1e6:.2f}" if "bound" in r else ""
        lines.append(f"| {r['model']} | {r['stage']} | {r['plan']} | {r['predicted'] / 1e6:.2f} | "
                     f"{r['stored'] / 1e6:.2f} + {r['transient'] / 1e6:.2f} + {r['other'] / 1e6:.2f} | {bound} | "
                     f"{r['measured'] / 1e6:.2f} | {100 * gap(r['predicted'], r['measured']):+.1f}% | "
                     f"{r['peak_at']} |")
    return "\n".join(lines)


def depth_table(result: dict) -> str:
    """The gap of each plan (predicted against measured) on the Llama at each depth and length."""
    plans = list(dict.fromkeys(r["plan"] for r in result.get("depths", [])))
    cells: dict = {}
    for r in result.get("depths", []):
        cells.setdefault((r["layers"], r["seq"]), {})[r["plan"]] = f"{100 * gap(r['predicted'], r['measured']):+.1f}%"
    lines = ["| layers x sequence | " + " | ".join(plans) + " |", "|---|" + "---:|" * len(plans)]
    for (layers, seq), row in cells.items():
        lines.append(f"| {layers} x {seq} | " + " | ".join(row.get(p, "") for p in plans) + " |")
    return "\n".join(lines)


def sites_table(result: dict) -> str:
    """Bytes one block stores per site (block 0, ZeRO-0): kept, under INT8 and INT4 (a site
    holding several tensors, all of them), and the choice of "auto" at the reference budget."""
    lines = ["| model | site | tensor shape | keep (KB) | int8 (KB) | int4 (KB) | auto's choice |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in result.get("sites", []):
        lines.append(f"| {r['model']} | {r['site']} | {'x'.join(map(str, r['shape']))} | {r['keep'] / 1e3:.1f} | "
                     f"{r['int8'] / 1e3:.1f} | {r['int4'] / 1e3:.1f} | {r['auto']} |")
    return "\n".join(lines)


def run_saved(save_json, command: str = "llm-act bench hf-peak", log: Callable[[str], None] = print) -> dict:
    start = time.perf_counter()
    result = run(log)
    log(table(result))
    log(depth_table(result))
    log(sites_table(result))
    if save_json:
        write_json(save_json, {**run_record(command, time.perf_counter() - start), **result})
    return result
