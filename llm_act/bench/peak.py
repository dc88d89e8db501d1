"""`llm-act bench peak`: the planner's peak of a training step against a measured one.

Why: fixed plans and "auto" share one memory model (design, third round): a plan's peak is
its stored bytes plus the larger of the end of forward (`static_memory.loss_bytes`, and
`input_bytes` when the first block encodes its checkpoint) and the heaviest backward stage
of a block (`analytic.stage_bytes`: its gradients in flight, its rebuilt and decoded sites;
a block recomputed whole holds `analytic.grad_bytes`). This bench sets that prediction
(`evaluate_plan` on the analytic profile, `DeviceModel.cpu()`) beside the peak of live tensor
storage over one real training step -- forward, loss and backward -- of a small
megatron-core GPT on CPU, measured by `live_storage.LiveStorageTracker` above the step's entry
state (weights, their gradients kept allocated and zeroed in place, the batch; after one
warm-up step). The codec kernels are opaque (`inside_custom_ops=False`: on a GPU each is one
kernel, and the CPU references' fp32 temporaries are not what a GPU holds) and the
references' rounding noise is not counted (`GPU_KERNEL_ONLY`: drawn by `torch.rand` beside
the encode on CPU, in registers by the kernels). Beside it stands the model before issue 27
(no gradients in flight, no loss event), which the new one replaced.

Model: 2 layers, hidden 256, 8 heads, sequence 128, micro-batch 2, vocabulary 1024, bf16,
RoPE, biases, untied embeddings, one thread, dropout 0 (with dropout the CPU "auto"
attention is the chunked backend, whose transients are not modelled). Plans: stock
("keep", stock attention), Megatron's "selective" (the softmax recomputed), "full"
recompute and "compress" (both on the memory-efficient attention), and "auto": `solve_plan`
on the analytic profile at a quarter, half and three quarters of the way from full
recompute's memory to stock's, and at a quarter without noise ("exact": keep and recompute
only), applied as fixed JSON plans. tests/planner/test_peak_vs_measured.py asserts on the
same figures (within 3%).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
from typing import Callable, Optional

import torch

from llm_act import ActConfig
from llm_act.bench.live_storage import LiveStorageTracker
from llm_act.measurement.measured_profile import runtime_block
from llm_act.plan import compress_layer, keep_layer, recompute_layer, selective_layer
from llm_act.planner import evaluate_plan, solve_plan
from llm_act.planner.analytic import block_profile, outer_profile
from llm_act.planner.model_shape import DeviceModel, ModelShape
from llm_act.planner.static_memory import input_bytes, loss_bytes, outer_bytes
from llm_act.sites import FINAL_NORM_INPUT

LAYERS, H, A, S, B, V = 2, 256, 8, 128, 2, 1024
DEVICE = DeviceModel.cpu()
FIXED = {  # name: (profile attention, analytic choice, ActConfig)
    "keep": ("stock", keep_layer(), dict(plan="keep")),
    "selective": ("stock", selective_layer(), dict(plan="selective", attention="stock")),
    "full": ("auto", recompute_layer(), dict(plan="recompute")),
    "compress": ("auto", compress_layer(), dict(plan="compress")),
}
#: "auto" budgets, as the share of the way from full recompute's memory to stock's
AUTO = (0.25, 0.5, 0.75)
#: ... and without noise (keep and recompute only): there a block's backward binds
AUTO_EXACT = (0.25,)
#: what the codecs' CPU references allocate and their GPU kernels do not: the stochastic
#: rounding noise, 4 bytes an element, drawn beside the encode (the kernels draw Philox bits)
GPU_KERNEL_ONLY = ("aten.rand.generator",)


def describe() -> str:
    return (f"GPT {LAYERS} layers, hidden {H}, {A} heads, seq {S}, micro-batch {B}, vocab {V}, "
            "bf16, RoPE, CPU")


def shape(attention: str) -> ModelShape:
    return ModelShape(num_layers=LAYERS, hidden_size=H, num_attention_heads=A, seq_length=S,
                      micro_batch_size=B, vocab_size=V, dtype="bf16", position_embedding="rope",
                      tie_embeddings=False, attention=attention)


def block(attention: str):
    return block_profile(shape(attention), DEVICE, count=LAYERS, gradients=True)


def outer(attention: str):
    """The final norm's input: planned, a block of its own after the layers."""
    return outer_profile(shape(attention), DEVICE)


def evaluate(attention: str, choice: dict, blk=None, loss: bool = True):
    """The planner's Plan (peak included) of `choice` in every layer."""
    blk = blk or block(attention)
    names = {s.name for s in blk.sites}
    return evaluate_plan([blk, outer(attention)], [{k: v for k, v in choice.items() if k in names},
                                                   {FINAL_NORM_INPUT: choice.get(FINAL_NORM_INPUT, "keep")}],
                         loss_bytes=loss_bytes(shape(attention), device=DEVICE) if loss else 0,
                         input_bytes=input_bytes(shape(attention)) if loss else 0)


def without_gradients(blk):
    return dataclasses.replace(blk, grad_bytes=0, stage_bytes=())


def old_prediction(attention: str, choice: dict) -> int:
    """The model before issue 27: no gradients in flight, no loss event, the outer activations
    added to the stored bytes and the transient as a constant."""
    return evaluate(attention, choice, without_gradients(block(attention)), loss=False).activation_bytes + sum(
        outer_bytes(shape(attention), 0).values())


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def measure(config: ActConfig, attention: str) -> int:
    """The tracker's peak of one training step above its entry state, after a warm-up step
    (megatron-core's parallel state must be up)."""
    from llm_act.patches.megatron import apply
    from llm_act.train.small_gpt import gpt_batch, gpt_model, small_config

    _seed(0)
    cfg = small_config(hidden_size=H, num_attention_heads=A, num_layers=LAYERS, dtype=torch.bfloat16,
                       dropout=0.0, add_bias_linear=True)
    model = gpt_model(cfg, vocab_size=V, max_sequence_length=S)
    controller = apply(model, config)
    if controller.attention_mode() != attention:
        raise RuntimeError(f"plan {config.plan!r} runs attention {controller.attention_mode()!r}, "
                           f"the prediction assumed {attention!r}")
    ids, pos, labels = gpt_batch(B, S, V, generator=torch.Generator().manual_seed(1))

    def step():
        out = model(ids, pos, None, labels=labels)
        out.float().mean().backward()

    _seed(5)
    step()  # megatron's buffers, the codecs' state and every parameter's .grad now exist
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    gc.collect()
    _seed(5)
    with LiveStorageTracker(model, inside_custom_ops=False, ignore_ops=GPU_KERNEL_ONLY) as tracker:
        step()
    return tracker.peak_bytes


def auto_plans():
    """[(name, Plan)] of the "auto" plans: solved on the analytic profile at `AUTO` (with
    the compress plan's noise) and `AUTO_EXACT` (no noise) of the way from full recompute's
    memory to stock's; "recompute" only where the layers offer it site by site."""
    blk, shp = block("auto"), shape("auto")
    low, high = (evaluate("auto", c).activation_bytes for c in (recompute_layer(), keep_layer()))
    out = []
    for name, fraction, noise in ([(f"auto {f}", f, None) for f in AUTO]
                                  + [(f"exact {f}", f, 0.0) for f in AUTO_EXACT]):
        plan = solve_plan([runtime_block(blk), outer("auto")], int(low + fraction * (high - low)),
                          loss_bytes=loss_bytes(shp, device=DEVICE), input_bytes=input_bytes(shp),
                          variance_budget=noise)
        out.append((name, plan))
    return out


def _row(name: str, plan, measured: int, old: int, choice: Optional[dict]) -> dict:
    return {"plan": name, "predicted": plan.activation_bytes, "transient": plan.peak_bytes,
            "measured": measured, "old": old, "choice": choice}


def measure_rows(log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """[{plan, predicted, transient, measured, old, choice}] for every plan (`choice`: the
    non-keep sites of an "auto" plan, None for a fixed one); megatron-core's parallel state
    must be up."""
    rows = []
    for name, (attention, choice, config) in FIXED.items():
        measured = measure(ActConfig(**config), "stock" if attention == "stock" else "auto")
        rows.append(_row(name, evaluate(attention, choice), measured, old_prediction(attention, choice), None))
        log(f"  measured {name}")
    with tempfile.TemporaryDirectory() as folder:
        for name, plan in auto_plans():
            path = os.path.join(folder, f"{name.replace(' ', '_')}.json")
            with open(path, "w") as f:
                json.dump(plan.to_dict(), f)
            measured = measure(ActConfig(plan=path), "auto")
            choice = {k: v for k, v in {**plan.layer_choices(0)[0], **plan.choice[1]}.items() if v != "keep"}
            rows.append(_row(name, plan, measured, old_prediction("auto", plan.layer_choices(0)[0]), choice))
            log(f"  measured {name}")
    return rows


def run(log: Callable[[str], None] = lambda m: None) -> dict:
    """The bench in its own process: the CPU stand-ins, one gloo rank, one thread (the model
    is tiny); {model, rows}."""
    from llm_act import cpu
    from llm_act.train import parallel

    cpu.install()  # the bench owns its process: megatron-core on CPU needs the stand-ins
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    parallel.init_parallel(tp=1)
    try:
        rows = measure_rows(log)
    finally:
        parallel.destroy_parallel()
        torch.set_num_threads(threads)
    return {"model": describe(), "rows": rows}


def gap(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def _choice_text(choice: Optional[dict], name: str) -> str:
    """"qkv_input, fc1_input recompute; v int1": the non-keep sites by choice, short names."""
    if choice is None:
        return "every site at its default codec" if name == "compress" else ""
    by: dict[str, list[str]] = {}
    for site, how in choice.items():
        by.setdefault(how, []).append(site.split(".", 1)[1] if site.startswith(("attn.", "mlp.")) else site)
    return "; ".join(f"{', '.join(sites)} {how}" for how, sites in by.items())


def table(result: dict) -> str:
    lines = ["| plan | predicted B | measured B | gap | the model before issue 27 | gap | choice (non-keep sites) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['plan']} | {r['predicted']} | {r['measured']} | {gap(r['predicted'], r['measured']):+.2%} "
                     f"| {r['old']} | {gap(r['old'], r['measured']):+.2%} | {_choice_text(r['choice'], r['plan'])} |")
    return "\n".join(lines)
