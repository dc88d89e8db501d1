"""GPU: throughput and the largest micro-batch, stock and Megatron's recompute modes against ours.

The comparison of issue 17. A megatron-core GPT of ~1.3B parameters (default `SHAPE`, a
`ModelShape`: 24 layers, hidden 2048, 16 heads, seq 2048, bf16) on one GPU trains forward+backward under each
scheme of `SCHEMES`:

- "stock": megatron-core as built (local spec), its core attention in SDPA mode;
- "megatron selective" / "megatron full": Megatron's recompute modes (core attention /
  whole block recomputed) written as plans on our sites and run by our recompute machinery
  (our emulations);
- "megatron-core full" / "megatron-core selective" / "megatron-core offload": megatron-core's
  OWN options on a pure megatron-core model (local spec, no Transformer Engine, no llm_act
  binding, so its own unfused core attention): `recompute_granularity="full"`,
  `recompute_method="uniform"`, `recompute_num_layers=1`; `recompute_granularity="selective"`
  with `recompute_modules=["core_attn"]`; fine-grained activation offloading of
  `NATIVE_OFFLOAD_MODULES` (CUDA streams and Transformer Engine's `cpu_offload`: on CPU a row
  saying so, on CUDA without Transformer Engine a row with megatron-core's refusal; where it
  runs, what it moved to the host is not in the cuda peak). What megatron-core 0.16.1 cannot
  run on the local spec is listed in `NATIVE_NOT_RUN`;
- "ours keep": our converted layers, every site kept (what plan "keep" costs);
- "ours compress": the default compress plan (design brief: every site at its codec);
- "ours auto @ full memory": the MILP solved per micro-batch size with the budget = the
  memory full recompute *measured* at that size (cuda peak; on CPU the ledger's bytes);
- "ours auto @ megatron-core full memory": the same, with the budget = the memory
  megatron-core's own full recompute measured at that size (`AUTOS`);
- "ours": the MILP per micro-batch size at the card's memory (what plan "auto" does), the
  scheme whose largest micro-batch the target compares.

Every scheme but megatron-core's own uses the same attention kernel (SDPA through
`ActCoreAttention`, mode "sdpa"), so the comparison isolates what is stored. The memory the
MILP plans is the blocks' activations; what else a step holds (weights, gradients,
embedding, logits and loss) is "static" and is measured, not guessed: static(m) = full
recompute's measured memory at micro-batch m minus the analytic bytes of the full plan (24
kept block inputs + one block rebuilt in backward), fitted as a + b*m over the measured
sizes.

Per scheme and micro-batch size: tokens/s (CUDA events, median of `repeat` steps after a
warm-up; ratios only within one run) and the memory of a step (`torch.cuda.max_memory_allocated`
after `reset_peak_memory_stats`; on CPU the `SavedTensorLedger`'s bytes held at the end of
forward, since CPU has no peak counter). Then the largest micro-batch that fits: doubling from
the sweep's largest size until one fails (CUDA out of memory, caught and freed; with
`capacity_bytes` a step whose memory exceeds it also fails, which is how the CPU test
emulates a small card), then bisection. `time_budget_s` stops measuring (remaining cells say
"not measured") so the run always ends with its table; schemes are measured in `ORDER`
(the targets' schemes first).

On CPU `run(device="cpu", tiny shape)` runs the same code end to end; its numbers mean
nothing there. The targets of the issue are printed as PASS/FAIL lines by `targets`.
"""
from __future__ import annotations

import functools
import gc
import json
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from llm_act import cpu
from llm_act.bench import kernels, memory as M
from llm_act.bench.timing import machine_line, median_ms
from llm_act.process.fresh import apply_environ, fresh_context
from llm_act.ledger import SavedTensorLedger
from llm_act.plan import recompute_layer, selective_layer
from llm_act.planner import InfeasibleBudget, InfeasibleVariance, solve_plan
from llm_act.planner.analytic import block_profile
from llm_act.planner.budget import min_budget, reference_variance
from llm_act.planner.model_shape import ModelShape
from llm_act.train import parallel, small_gpt
from llm_act.sites import ATTN_DROPOUT_MASK, CHECKPOINT_SITE


def gpt_shape(num_layers: int = 24, hidden_size: int = 2048, num_attention_heads: int = 16,
              seq_length: int = 2048, vocab_size: int = 50304) -> ModelShape:
    """The bench's GPT as a `ModelShape`: bf16, RoPE, bias on, no dropout, the core attention
    in SDPA mode (every scheme but megatron-core's own). Its micro-batch size (1) is a
    placeholder: each measurement sets its own (`shape.with_(micro_batch_size=mbs)`)."""
    return ModelShape(num_layers=num_layers, hidden_size=hidden_size,
                      num_attention_heads=num_attention_heads, seq_length=seq_length,
                      micro_batch_size=1, vocab_size=vocab_size, position_embedding="rope",
                      attention="sdpa")


#: the default model: GPT ~1.3B (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304)
SHAPE = gpt_shape()


def params(shape: ModelShape) -> int:
    """Parameters, roughly: 12 h^2 per layer plus the (tied) embedding."""
    return 12 * shape.num_layers * shape.hidden_size ** 2 + shape.vocab_size * shape.hidden_size


def describe(shape: ModelShape) -> str:
    return (f"GPT {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_attention_heads} heads, "
            f"seq {shape.seq_length}, vocab {shape.vocab_size}, {shape.dtype} "
            f"(~{params(shape) / 1e9:.2f}B parameters)")


def shape_record(shape: ModelShape) -> dict:
    """The dimensions gpu.json keeps: {layers, hidden, heads, seq, vocab}."""
    return {"layers": shape.num_layers, "hidden": shape.hidden_size, "heads": shape.num_attention_heads,
            "seq": shape.seq_length, "vocab": shape.vocab_size}


STOCK, SELECTIVE, FULL = "stock", "megatron selective", "megatron full"
KEEP, COMPRESS, AUTO_AT_FULL, OURS = "ours keep", "ours compress", "ours auto @ full memory", "ours"
#: megatron-core's own options (pure megatron-core models, local spec, no llm_act binding)
NATIVE_FULL, NATIVE_SELECTIVE, NATIVE_OFFLOAD = ("megatron-core full", "megatron-core selective",
                                                 "megatron-core offload")
AUTO_AT_NATIVE_FULL = "ours auto @ megatron-core full memory"
#: what fine-grained activation offloading moves to the host: every `offload_modules` choice a
#: dense local-spec GPT has ("expert_fc1" and "moe_act" are MoE's)
NATIVE_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
#: each native scheme's TransformerConfig fields
NATIVE = {
    NATIVE_FULL: dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    NATIVE_SELECTIVE: dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
    NATIVE_OFFLOAD: dict(fine_grained_activation_offloading=True,
                         offload_modules=list(NATIVE_OFFLOAD_MODULES)),
}
#: megatron-core options not run here, and why (found on CPU with megatron-core 0.16.1 and
#: 0.19.2, local spec; tests/bench/test_native_baselines.py names every recompute module)
NATIVE_NOT_RUN = (
    'recompute_modules "layernorm": needs Transformer Engine (megatron-core\'s '
    "CheckpointWithoutOutput takes its FP8 path whatever fp8 is; without Transformer Engine: "
    "`NameError: name 'FP8GlobalStateManager' is not defined`, tensor_parallel/random.py)",
    'recompute_modules "mlp": does not train on the local spec with its biased linears '
    "(add_bias_linear, megatron-core's default): the checkpointed MLP returns linear_fc2's bias "
    "Parameter through CheckpointFunction, which becomes its grad_fn, so backward re-enters the "
    "checkpoint without end (memory grows until the process dies); with add_bias_linear=False "
    "(another model) it runs",
    'recompute_modules "moe", "moe_act", "shared_experts", "mla_up_proj", "gdn_norm_out": each '
    "recomputes a part the bench's dense GPT does not have (MoE layers, grouped-GEMM experts, "
    "shared experts, multi-latent attention, 0.19's GatedDeltaNet attention): megatron-core "
    "refuses them without it (`gdn_norm_out in recompute_modules is only supported with "
    "experimental_attention_variant='gated_delta_net'`); llm_act refuses MLA, and GatedDeltaNet "
    "is a HybridModel layer, which llm_act refuses too",
    "fine-grained activation offloading: needs CUDA (its copies run on `torch.cuda.Stream`s) and "
    "Transformer Engine (its `cpu_offload`; without it megatron-core raises `RuntimeError: TE CPU "
    "offload is not available` at the first offloaded module)",
)
#: each "auto at X's memory" scheme -> X, the scheme whose measured memory is its MILP budget
AUTOS = {AUTO_AT_FULL: FULL, AUTO_AT_NATIVE_FULL: NATIVE_FULL}
#: the table's rows, in this order
SCHEMES = (STOCK, SELECTIVE, FULL, NATIVE_SELECTIVE, NATIVE_FULL, NATIVE_OFFLOAD, KEEP, COMPRESS,
           AUTO_AT_FULL, AUTO_AT_NATIVE_FULL, OURS)
#: the order they are measured in: the schemes the targets compare first (each auto scheme
#: after the scheme whose memory is its budget; AUTO_AT_FULL and OURS's static memory need
#: FULL's measured memory)
ORDER = (STOCK, KEEP, FULL, NATIVE_FULL, AUTO_AT_NATIVE_FULL, NATIVE_SELECTIVE, NATIVE_OFFLOAD,
         AUTO_AT_FULL, OURS, COMPRESS, SELECTIVE)
MARGIN = 0.08  # share of the card kept free for the allocator and workspace
GPU_SIZES = (1, 2, 4, 8)
#: the issue's targets
#: issue 27: "auto" at full recompute's memory >= 1.15x its throughput, largest micro-batch
#: at least full recompute's; issue 26: "compress" >= 0.90x and "keep" >= 0.98x stock at every
#: size, every codec's encode and decode >= 85% of copy bandwidth (bytes each must move)
TARGET_AUTO_VS_FULL = 1.15
TARGET_LARGEST_VS_FULL = 1.0
TARGET_COMPRESS_VS_STOCK = 0.90
TARGET_KEEP_VS_STOCK = 0.98
TARGET_KERNEL_OF_COPY = 0.85


def _scheme(name: str, choice=None) -> M.Scheme:
    """A scheme of the table; `choice`: one {site: choice} for every layer, or a list of them
    (one per layer: a plan that recomputes some identical layers whole)."""
    base = {STOCK: {}, SELECTIVE: selective_layer(), FULL: recompute_layer(), KEEP: {},
            COMPRESS: M.compress_choice()}
    layers = tuple(dict(c) for c in choice) if isinstance(choice, list) else ()
    one = layers[-1] if layers else (choice if choice is not None else base[name])
    return M.Scheme(name, "", dict(one), attention="sdpa", convert_attention=True, layers=layers)


@functools.lru_cache(maxsize=256)
def _analytic_block(shape: ModelShape, mbs: int):
    return block_profile(shape.with_(micro_batch_size=mbs), count=shape.num_layers)


def full_activation_bytes(shape: ModelShape, mbs: int) -> int:
    """Analytic activation bytes of full recompute: every block's kept input plus one block
    rebuilt at once in backward (the MILP's transient peak)."""
    block = _analytic_block(shape, mbs)
    ln1 = next(s.nbytes for s in block.sites if s.name == CHECKPOINT_SITE)
    return shape.num_layers * ln1 + sum(s.nbytes for s in block.sites)


def ours_choice(shape: ModelShape, mbs: int, budget: int, static_bytes: int = 0):
    """The MILP's choice for this micro-batch size within `budget` bytes of which
    `static_bytes` are not activations: one {site: choice} for every layer, or one per layer
    when the plan recomputes some of them whole (None: nothing fits)."""
    choice, note = _solve(shape, mbs, budget, static_bytes)
    return None if note else choice


def _solve(shape: ModelShape, mbs: int, budget: int, static_bytes: int = 0,
           least: bool = False) -> tuple[Optional[dict], Optional[str]]:
    """(choice, None), or (None, why there is none); `least`: when the budget is infeasible,
    solve at the least feasible budget instead and say so in the note."""
    block = M.restricted_block(_analytic_block(shape, mbs))
    noise = reference_variance([block])
    note = None
    try:
        plan = solve_plan([block], budget, static_bytes=static_bytes, variance_budget=noise)
    except (InfeasibleBudget, InfeasibleVariance) as err:
        if not least:
            need = getattr(err, "min_budget_bytes", None)
            return None, "MILP infeasible" + ("" if need is None else f" (needs >= {_size(need)})")
        need = min_budget([block], static_bytes, noise)
        try:
            plan = solve_plan([block], need, static_bytes=static_bytes, variance_budget=noise)
        except (InfeasibleBudget, InfeasibleVariance):
            return None, f"MILP infeasible (needs {_size(need)})"
        note = (f"infeasible at this budget: solved at the MILP's least, {_size(need)} "
                f"({_size(need - budget)} more)")
    layers = [{ATTN_DROPOUT_MASK: "regen", **c} for c in plan.layer_choices(0)]
    return (layers[0] if all(c == layers[0] for c in layers) else layers), note


def _model(shape: ModelShape, device: torch.device, seed: int = 1234, **config):
    """The bench's GPT; `config`: more TransformerConfig fields (a native scheme's `NATIVE`)."""
    cfg = small_gpt.small_config(hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                                 num_layers=shape.num_layers, dtype=shape.torch_dtype, dropout=shape.dropout,
                                 use_cpu_initialization=device.type == "cpu", **config)
    torch.manual_seed(seed)
    model = small_gpt.gpt_model(cfg, vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length).to(device)
    # as Megatron-LM under --bf16: every parameter in bf16 (on CUDA megatron-core's torch
    # LayerNorm fallback builds fp32 weights, which CUDA's layer_norm refuses beside bf16 input)
    from megatron.core.transformer.module import Float16Module

    return Float16Module(cfg, model)


def _layers(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def bind(model, scheme: M.Scheme) -> None:
    """Bind `scheme` to every layer. Stock: only the core attention is converted (to SDPA
    mode, every site kept), the rest stays megatron-core's own modules."""
    from llm_act.patches.megatron.swap import convert_attention

    for layer in _layers(model):
        index = int(layer.layer_number) - 1
        if scheme.name == STOCK:
            convert_attention(layer, index)
            layer.self_attention.core_attention.set_attention_mode(scheme.attention)
        else:
            M.bind_layer(layer, index, replace(scheme, choice=scheme.layers[index]) if scheme.layers else scheme)


OOM = "out of memory"
#: timed steps per cell on CUDA: at least `repeat`, more until they add up to TIMED_MS (at most
#: MAX_REPEAT), after one untimed warm-up beside the memory step (allocator growth, autotuning)
TIMED_MS = 1000.0
MAX_REPEAT = 30
#: what a failed step may leave allocated before the model is rebuilt for the next probe (an
#: H200 run saw 102 GiB left after an out-of-memory at the logits under a recompute chain, and
#: every later probe of that scheme fail: a reference cycle, fixed since, tests/test_failed_step_frees.py)
LEAK_BYTES = 2**28


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:240]


class _Failed(Exception):
    """A step did not fit (out of memory, or above `capacity_bytes`); `why`: the allocator's
    first line (how much it asked for and had), which tells a real edge from a bug that
    asks for far too much."""

    def __init__(self, why: str = "", left: int = 0):
        super().__init__(why)
        self.why = why
        self.left = left  # bytes the failed step left allocated after freeing (CUDA)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure(model, shape: ModelShape, mbs: int, device: torch.device, repeat: int,
             capacity: Optional[int], after_step: Optional[Callable[[], None]] = None) -> dict:
    """One cell: {"ms", "tokens_per_s", "mem_bytes"}; repeat=0: one step for memory only.
    Raises `_Failed` when it does not fit (memory freed first). `after_step`: called after
    every forward-backward (what megatron-core's schedules do after one)."""
    cuda = device.type == "cuda"
    ids = torch.randint(0, shape.vocab_size, (mbs, shape.seq_length), device=device)
    pos = torch.arange(shape.seq_length, device=device).unsqueeze(0).expand(mbs, -1)

    def step(ledger: Optional[SavedTensorLedger] = None):
        if ledger is None:
            loss = model(ids, pos, None, labels=ids).float().mean()
        else:
            with ledger:
                loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()

    oom = False
    why = ""
    out: dict = {}
    before = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        if cuda:
            _free(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            out["mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
        else:
            led = SavedTensorLedger()
            t0 = time.perf_counter()
            step(led)
            first_ms = (time.perf_counter() - t0) * 1e3
            out["mem_bytes"] = int(led.total_bytes)
        if capacity is not None and out["mem_bytes"] > capacity:
            oom, why = True, f"{_size(out['mem_bytes'])} > capacity {_size(capacity)}"
        elif repeat > 0:
            # the memory step above was the warm-up; on CPU with repeat=1 it is also the timed
            # step (a smoke run: half the steps; CPU numbers mean nothing anyway)
            ms = first_ms if (not cuda and repeat == 1) else median_ms(
                step, device, warmup=1 if cuda else 0, repeat=repeat,
                min_total_ms=TIMED_MS if cuda else 0.0, max_repeat=MAX_REPEAT)
            out.update(ms=ms, tokens_per_s=mbs * shape.seq_length / ms * 1e3)
    except torch.cuda.OutOfMemoryError as err:
        oom, why = True, _first_line(err)
    except RuntimeError as err:  # allocation failures outside the caching allocator
        if not any(t in str(err) for t in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")):
            raise
        oom, why = True, _first_line(err)
    if oom:
        if os.environ.get("LLM_ACT_BENCH_TRACEBACK") and why:
            import traceback

            traceback.print_exc()
        model.zero_grad(set_to_none=True)
        del ids, pos
        _free(device)
        left = 0
        if cuda:  # what the failed step left allocated (tells a leak from the edge)
            left = max(0, torch.cuda.memory_allocated(device) - before)
            if left > LEAK_BYTES:
                why += f"; {_size(left)} still allocated after it"
        raise _Failed(why, left)
    return out


def run(shape: ModelShape = SHAPE, device: Optional[str] = None, sizes=None, repeat: int = 3,
        search: Optional[bool] = None, capacity_bytes: Optional[int] = None,
        max_mbs: int = 1024, time_budget_s: Optional[float] = None, resolution: Optional[float] = None,
        schemes=ORDER, log: Callable[[str], None] = lambda m: None,
        isolate: Optional[bool] = None) -> dict:
    """Measure every scheme. Returns {"rows": [...], "largest": {scheme: {...}}, "machine",
    "shape", "memory_kind", "capacity", "static", "measured", "skipped"}; a row is {scheme,
    mbs, fits, ms, tokens_per_s, mem_bytes, plan, budget, note} (`fits` False: out of memory,
    no plan, or a native option megatron-core refuses or that needs CUDA: its note says which;
    rows not measured for time are absent and listed in "skipped"). "measured": {scheme: {mbs:
    memory}} of the schemes whose memory is an auto scheme's budget (`AUTOS`).

    `search`: find the largest micro-batch per scheme (default: on CUDA, or when
    `capacity_bytes` emulates a card); the bisection stops within `resolution` of the edge
    (a share of the size; default 1/16 on CUDA, where every probe of a big micro-batch costs
    seconds, exact on CPU). `capacity_bytes`: the memory a step may use (CUDA
    default: the card's total minus `MARGIN`; it is also the budget of "ours").
    `isolate` (default: on CUDA): each scheme in a fresh process, so that what one scheme
    leaves on the card (seen on an H200: after a scheme's out-of-memory probes the next
    scheme failed at micro-batch 1, and fitted in a fresh process) never decides another's
    numbers; a scheme that crashes there is a row with its error, not the end of the run."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    sizes = tuple(sizes or (GPU_SIZES if cuda else (1, 2)))
    if search is None:
        search = cuda or capacity_bytes is not None
    if resolution is None:
        resolution = 1 / 16 if cuda else 0.0
    if isolate is None:
        isolate = cuda
    if isolate and cuda:
        _free(dev)  # what this process cached (the kernels' bench) is the children's to use
    card = None
    if cuda:
        card = int(torch.cuda.get_device_properties(dev).total_memory * (1 - MARGIN))
    deadline = None if time_budget_s is None else time.perf_counter() + time_budget_s
    sweep = _Sweep(shape=shape, device=str(dev), sizes=sizes, repeat=repeat, search=search,
                   capacity=capacity_bytes, ours_total=capacity_bytes if capacity_bytes is not None else card,
                   max_mbs=max_mbs, resolution=resolution)
    rows: list[dict] = []
    largest_found: dict = {}
    skipped: list[str] = []
    # scheme -> {mbs: its measured memory}, for the schemes whose memory is an auto scheme's
    # budget (`AUTOS`); FULL's also gives the static memory
    measured: dict[str, dict[int, int]] = {}
    for name in schemes:
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            skipped.append(f"{name}: every size")
            continue
        if isolate:
            got = _in_child(sweep, name, measured, left)
        else:
            got = sweep.scheme(name, measured, left, log)
        rows += got["rows"]
        skipped += got["skipped"]
        for src, mem in got["measured"].items():
            measured.setdefault(src, {}).update(mem)
        if got.get("largest") is not None:
            largest_found[name] = got["largest"]
    return {"rows": rows, "largest": largest_found, "machine": machine_line(dev), "shape": shape,
            "memory_kind": "cuda peak" if cuda else "ledger", "capacity": capacity_bytes or card,
            "card": card, "skipped": skipped, "sizes": sizes, "measured": measured,
            "static": {m: sweep.static_at(measured, m) for m in sizes} if measured.get(FULL) else {}}


#: what the schemes' processes share, imported once by their server (no llm_act code: the
#: kernels' modules stay the children's own)
_CHILD_PRELOAD = ("torch", "megatron.core", "megatron.core.models.gpt.gpt_model")


def _in_child(sweep: "_Sweep", name: str, measured: dict, left: Optional[float]) -> dict:
    """`sweep.scheme(name, ...)` in a fresh process (its log lines go to stdout), forked from
    a server that imported torch and megatron-core once (`llm_act.process.fresh`): no CUDA state of
    this process or of another scheme's."""
    import concurrent.futures

    ctx = fresh_context(_CHILD_PRELOAD)
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        try:
            return pool.submit(_child_scheme, sweep, name, dict(measured), left, dict(os.environ)).result()
        except Exception as err:  # the child died (or its result could not come back)
            print(f"  {name}: the process measuring it failed: {_first_line(err)}", flush=True)
            return _error(sweep, name, _first_line(err))


def _child_scheme(sweep: "_Sweep", name: str, measured: dict, left: Optional[float],
                  environ: Optional[dict] = None) -> dict:
    import warnings

    if environ is not None:
        apply_environ(environ)

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|CUDA_DEVICE_MAX).*")
    try:
        return sweep.scheme(name, measured, left, lambda m: print(m, flush=True))
    except Exception as err:
        import traceback

        traceback.print_exc()
        return _error(sweep, name, f"{type(err).__name__}: {_first_line(err)}")


def _error(sweep: "_Sweep", name: str, why: str) -> dict:
    """`_Sweep.scheme`'s result for a scheme whose measurement crashed: one row saying why."""
    return _one_row(sweep, name, f"error: {why}")


def _one_row(sweep: "_Sweep", name: str, note: str) -> dict:
    """`_Sweep.scheme`'s result for a scheme not measured: one row saying why."""
    return {"rows": [{"scheme": name, "mbs": sweep.sizes[0], "fits": False, "note": note}],
            "skipped": [], "measured": {}, "largest": None}


#: the note of the native offload row where there is no CUDA
OFFLOAD_NEEDS_CUDA = ("not run: needs CUDA (megatron-core's fine-grained activation offloading "
                      "copies on torch.cuda.Stream) and Transformer Engine (its cpu_offload)")


def _native_step_hooks(name: str) -> tuple[Optional[Callable[[], None]], Optional[Callable[[], None]]]:
    """(before a cell, after every step) for a native scheme. Fine-grained offloading keeps its
    state in a process-wide manager that megatron-core's schedules reset after every
    forward-backward; each cell starts from a fresh one (its first step is the warm-up that
    sizes the offload groups, as a training run's first iteration)."""
    if name != NATIVE_OFFLOAD:
        return None, None
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )

    return off.reset_instance, off.reset


@dataclass(frozen=True)
class _Sweep:
    """What every scheme's measurement shares (picklable: it crosses into a child process)."""
    shape: ModelShape
    device: str
    sizes: tuple
    repeat: int
    search: bool
    capacity: Optional[int]
    ours_total: Optional[int]  # what "ours" plans against
    max_mbs: int
    resolution: float

    def static_at(self, measured: dict, mbs: int) -> int:
        """Non-activation memory at `mbs`: a + b*m fitted to full recompute's residuals
        (`measured`: scheme -> {mbs: measured memory}; FULL's is used)."""
        full_mem = measured.get(FULL, {})
        pts = sorted((m, mem - full_activation_bytes(self.shape, m)) for m, mem in full_mem.items())
        if not pts:
            return 0
        if len(pts) == 1:
            return max(0, pts[0][1])
        (m0, r0), (m1, r1) = pts[0], pts[-1]
        slope = (r1 - r0) / (m1 - m0)
        return max(0, int(r0 + slope * (mbs - m0)))

    def plan_for(self, name: str, mbs: int, measured: dict):
        """(scheme, budget, static, reason-if-none); an auto scheme's budget is the memory its
        source scheme (`AUTOS`) measured at `mbs`, its static memory estimated from FULL's."""
        if name in AUTOS:
            src = AUTOS[name]
            mem = measured.get(src, {})
            if mbs not in mem:
                return None, None, None, f"{src} did not fit or was not measured at this size"
            budget = mem[mbs]
            static = min(budget, self.static_at(measured, mbs))
        elif name == OURS:
            budget = self.ours_total if self.ours_total is not None else 2**62
            static = self.static_at(measured, mbs) if self.ours_total is not None else 0
        else:
            return _scheme(name), None, None, None
        choice, note = _solve(self.shape, mbs, budget, static, least=name in AUTOS)
        if choice is None:
            return None, budget, static, note
        return _scheme(name, choice), budget, static, note

    def scheme(self, name: str, measured: dict, left: Optional[float], log: Callable[[str], None]) -> dict:
        """One scheme over the sizes, then its largest micro-batch: {"rows", "skipped",
        "measured" ({name: its measured memory per size} when it is a budget of `AUTOS`),
        "largest"}. A native scheme (`NATIVE`) is a pure megatron-core model built with its
        TransformerConfig fields, never bound; what megatron-core refuses is its row's note."""
        dev = torch.device(self.device)
        if name == NATIVE_OFFLOAD and dev.type != "cuda":
            log(f"  {name}: {OFFLOAD_NEEDS_CUDA}")
            return _one_row(self, name, OFFLOAD_NEEDS_CUDA)
        native = name in NATIVE
        deadline = None if left is None else time.perf_counter() + left
        measured = {k: dict(v) for k, v in measured.items()}
        mine: dict[int, int] = {}
        rows: list[dict] = []
        skipped: list[str] = []
        found = None

        def over() -> bool:
            return deadline is not None and time.perf_counter() > deadline

        def refused(err: Exception) -> str:
            return f"error: megatron-core refused it: {type(err).__name__}: {_first_line(err)}"

        cpu.install()  # a no-op on a GPU; the CPU smoke run needs the stand-ins
        parallel.init_parallel(seed=1234)
        try:
            t0 = time.perf_counter()
            try:
                model = _model(self.shape, dev, **NATIVE.get(name, {}))
            except Exception as err:  # a native config megatron-core refuses
                if not native:
                    raise
                log(f"  {name}: {refused(err)}")
                return _one_row(self, name, refused(err))
            before_cell, after_step = _native_step_hooks(name)
            bound = None

            def cell(mbs: int, reps: int) -> dict:
                nonlocal bound, model
                if native:
                    scheme, row = None, {"scheme": name, "mbs": mbs, "budget": None, "static": None}
                else:
                    scheme, budget, static, why = self.plan_for(name, mbs, measured)
                    row = {"scheme": name, "mbs": mbs, "budget": budget, "static": static}
                    if why:
                        row["note"] = why
                    if scheme is None:
                        return {**row, "fits": False}
                    key = json.dumps([scheme.choice, scheme.layers], sort_keys=True)
                    if key != bound:
                        bind(model, scheme)
                        bound = key
                try:
                    if before_cell is not None:
                        before_cell()
                    got = _measure(model, self.shape, mbs, dev, reps, self.capacity, after_step)
                except _Failed as failed:
                    bound = None  # rebind before the next step: drops whatever the failed one left
                    if failed.left > LEAK_BYTES:  # and a new model, if that is what holds it
                        del model
                        _free(dev)
                        model = _model(self.shape, dev, **NATIVE.get(name, {}))
                    return {**row, "fits": False, "note": OOM, "why": failed.why}
                except Exception as err:  # megatron-core refusing its own option at run time
                    if not native:
                        raise
                    model.zero_grad(set_to_none=True)
                    _free(dev)
                    return {**row, "fits": False, "note": refused(err), "refused": True}
                plan = (list(scheme.layers) or scheme.choice) if name in AUTOS or name == OURS else None
                return {**row, "fits": True, "plan": plan,
                        **got}

            try:
                fitted, failed_at, stop = [], None, False
                for mbs in self.sizes:
                    if over():
                        skipped.append(f"{name}: mbs {mbs}")
                        continue
                    row = cell(mbs, self.repeat)
                    rows.append(row)
                    if row["fits"]:
                        fitted.append(mbs)
                        if name in AUTOS.values():
                            mine[mbs] = row["mem_bytes"]
                        speed = f"{row['tokens_per_s']:.0f} tokens/s, " if "tokens_per_s" in row else ""
                        log(f"  {name} mbs {mbs}: {speed}{_size(row['mem_bytes'])}")
                    else:
                        failed_at, stop = mbs, bool(row.get("refused"))
                        log(f"  {name} mbs {mbs}: {row['note']}"
                            + (f" ({row['why']})" if row.get("why") else ""))
                        break
                if self.search and name not in AUTOS and not stop:
                    found = _search(name, max(fitted, default=0), failed_at, cell, over,
                                    self.max_mbs, log, self.resolution)
            finally:
                del model
                _free(dev)
            log(f"  {name}: {time.perf_counter() - t0:.1f} s")
        finally:
            parallel.destroy_parallel()
        return {"rows": rows, "skipped": skipped, "largest": found,
                "measured": {name: mine} if name in AUTOS.values() else {}}


def _search(name, lo, failed, cell, over, max_mbs, log, resolution: float = 0.0) -> dict:
    """Double from `lo` (the sweep's largest fitting size) until a step fails, then bisect
    down to `failed` - 1 (`failed`: the sweep's failing size, or None).
    {"mbs": largest fitting, "failed": smallest failing or None, "exact": bool}."""
    if lo == 0:
        return {"mbs": 0, "failed": failed, "exact": True}
    probe = cell  # one step each: memory only

    def fits(m: int) -> Optional[bool]:
        if over():
            return None
        r = probe(m, 0)
        log(f"  {name} search mbs {m}: {'fits' if r['fits'] else r['note']}"
            + (f" ({r['why']})" if r.get("why") else ""))
        return r["fits"]

    while failed is None:
        m = lo * 2
        if m > max_mbs:
            return {"mbs": lo, "failed": None, "exact": False, "note": f"capped at {max_mbs}"}
        ok = fits(m)
        if ok is None:
            return {"mbs": lo, "failed": None, "exact": False, "note": "time budget"}
        if ok:
            lo = m
        else:
            failed = m
    while failed - lo > max(1, int(lo * resolution)):
        m = (lo + failed) // 2
        ok = fits(m)
        if ok is None:
            return {"mbs": lo, "failed": failed, "exact": False, "note": "time budget"}
        if ok:
            lo = m
        else:
            failed = m
    if failed - lo > 1:
        return {"mbs": lo, "failed": failed, "exact": False, "note": f"{failed} fails"}
    return {"mbs": lo, "failed": failed, "exact": True}


# ---- the table, the targets, the files ----------------------------------------------------


def largest(rows_or_result, scheme: str) -> int:
    """The largest micro-batch `scheme` fits: the search's result when there is one, else
    the largest fitting size of the sweep (`rows_or_result`: a `run` result or its rows)."""
    if isinstance(rows_or_result, dict):
        found = rows_or_result.get("largest", {}).get(scheme)
        if found is not None:
            return found["mbs"]
        rows = rows_or_result["rows"]
    else:
        rows = rows_or_result
    fit = [r["mbs"] for r in rows if r["scheme"] == scheme and r["fits"]]
    return max(fit) if fit else 0


def _by(result: dict) -> dict:
    return {(r["scheme"], r["mbs"]): r for r in result["rows"]}


def _ratio(result: dict, a: str, b: str, mbs: int) -> Optional[float]:
    by = _by(result)
    ra, rb = by.get((a, mbs)), by.get((b, mbs))
    if not (ra and rb and ra["fits"] and rb["fits"] and "tokens_per_s" in ra and "tokens_per_s" in rb):
        return None
    return ra["tokens_per_s"] / rb["tokens_per_s"]


def table(result: dict) -> str:
    """Tokens/s (memory GiB) per scheme and micro-batch size, the largest micro-batch, the
    throughput ratios against stock, full recompute (ours) and megatron-core's full recompute,
    and each auto scheme's plans."""
    sizes = list(result.get("sizes") or sorted({r["mbs"] for r in result["rows"]}))
    by = _by(result)
    kind = result.get("memory_kind", "cuda peak")
    unit, div = _unit(result)
    lines = [f"Tokens/s per micro-batch size (memory of a step in {unit}: {kind}):", "",
             "| scheme | " + " | ".join(f"mbs {m}" for m in sizes) + " | largest mbs |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    notes: list[str] = []  # why a scheme did not run (too long for a cell)
    for name in SCHEMES:
        cells = []
        for m in sizes:
            r = by.get((name, m))
            if r is None:
                cells.append("-")
            elif not r["fits"]:
                note = r.get("note") or ""
                if note.startswith(("not run", "error")):
                    cells.append(f"{note.split(':')[0]} (†)")
                    notes.append(f"{name}: {note}")
                else:
                    cells.append("OOM" if note == OOM else (note or "no fit"))
            elif "tokens_per_s" not in r:  # a memory-only step (repeat=0)
                cells.append(f"({r['mem_bytes'] / div:.2f})")
            else:
                star = "*" if r.get("note") else ""
                cells.append(f"{r['tokens_per_s']:.0f} ({r['mem_bytes'] / div:.2f}){star}")
        found = result.get("largest", {}).get(name)
        big = str(largest(result, name))
        if found is not None and not found.get("exact", True):
            big += f" (>=; {found.get('note', '')})"
        elif found is None and not any(r["fits"] for r in result["rows"] if r["scheme"] == name):
            big = "-"
        elif found is None and result.get("largest"):
            big += " (sweep only)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {big} |")
    if notes:
        lines += [""] + [f"(†) {n}" for n in notes]
    for ref in (STOCK, FULL, NATIVE_FULL):
        lines += ["", f"Throughput against {ref} (same micro-batch size):", "",
                  "| scheme | " + " | ".join(f"mbs {m}" for m in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for name in SCHEMES:
            cells = []
            for m in sizes:
                x = _ratio(result, name, ref, m)
                cells.append("" if x is None else f"{x:.3f}x")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for scheme, src in AUTOS.items():
        auto = [r for r in result["rows"] if r["scheme"] == scheme]
        if not auto:
            continue
        lines += ["", f"{scheme}: MILP budget = {src}'s measured memory at the same "
                  f"size ({kind}); static = non-activation memory estimated from {FULL}'s measured "
                  "memory:", "",
                  f"| mbs | budget {unit} | static {unit} | measured {unit} | plan |", "|---:|---:|---:|---:|---|"]
        for r in auto:
            plan = r.get("plan")
            text = "; ".join(x for x in (r.get("note"), _plan_text(plan) if plan and r["fits"] else "") if x)
            mem = f"{r['mem_bytes'] / div:.2f}" if r.get("fits") else ""
            b, st = r.get("budget"), r.get("static")
            lines.append(f"| {r['mbs']} | {'' if b is None else f'{b / div:.2f}'} | "
                         f"{'' if st is None else f'{st / div:.2f}'} | {mem} | {text} |")
    lines += ["", "`-`: not measured (a smaller size did not fit, or the time budget ran out); "
              "`*`: see the note in the plan table below.", "",
              "megatron-core options not run here: " + "; ".join(NATIVE_NOT_RUN) + "."]
    if result.get("skipped"):
        lines += ["", "Not measured (time budget): " + "; ".join(result["skipped"])]
    return "\n".join(lines)


def _unit(result: dict) -> tuple[str, int]:
    """GiB on a GPU; MiB for a CPU run's tiny shapes."""
    return ("GiB", 2**30) if result.get("memory_kind") == "cuda peak" else ("MiB", 2**20)


def _size(x: int) -> str:
    """Bytes in GiB, or MiB below 1 GiB (a CPU run's tiny shapes)."""
    return f"{x / 2**30:.2f} GiB" if abs(x) >= 2**30 else f"{x / 2**20:.3f} MiB"


def _plan_text(choice) -> str:
    """One plan as text; per-layer plans (a list) as how many layers take each choice."""
    if isinstance(choice, list):
        counts: dict[str, int] = {}
        for c in choice:
            text = _plan_text(c)
            counts[text] = counts.get(text, 0) + 1
        return " | ".join(f"{n} layers: {text}" for text, n in counts.items())
    groups: dict[str, list[str]] = {}
    for site, name in sorted(choice.items()):
        groups.setdefault(name, []).append(site)
    return "; ".join(f"{name}: {', '.join(sites)}" for name, sites in sorted(groups.items()))


def targets(result: dict, kernel_rows: Optional[list[dict]] = None) -> list[str]:
    """The issue's targets as "PASS"/"FAIL"/"n/a" lines (ratios within this run): ours at full
    recompute's memory >= TARGET_AUTO_VS_FULL x its throughput; the same at megatron-core's own
    full recompute's memory; that auto scheme >= every native option's throughput; our largest
    micro-batch >= both full recomputes'; keep and compress against stock; the kernels."""
    out = []
    sizes = list(result.get("sizes") or [])
    # 1. ours at full recompute's memory >= 1.15x full recompute's throughput
    out.append(_auto_vs(result, AUTO_AT_FULL, "ours at full recompute's memory"))
    # 1b. the same at megatron-core's own full recompute's memory, and >= every native option
    out.append(_auto_vs(result, AUTO_AT_NATIVE_FULL, "ours auto at megatron-core full's memory"))
    out.append(_auto_vs_natives(result))
    # 2. our largest micro-batch >= full recompute's (ours emulated and megatron-core's own)
    fulls = {s: largest(result, s) for s in (FULL, NATIVE_FULL)}
    ref = max(fulls, key=lambda s: fulls[s])
    full = fulls[ref]
    best = max((OURS, COMPRESS), key=lambda s: largest(result, s))
    ours = largest(result, best)
    each = ", ".join(f"{s} {n}" for s, n in fulls.items())
    if full:
        x = ours / full
        out.append(f"- {'PASS' if x >= TARGET_LARGEST_VS_FULL else 'FAIL'}: our largest micro-batch >= "
                   f"{TARGET_LARGEST_VS_FULL:g}x full recompute's: {ours} ({best}) / {full} ({ref}) = "
                   f"{x:.2f}x ({each})")
    else:
        out.append(f"- n/a: our largest micro-batch >= {TARGET_LARGEST_VS_FULL:g}x full recompute's: "
                   "full recompute fitted nothing")
    # 3. keep >= 0.98x and compress >= 0.90x stock, at every size both ran
    for scheme, word, target in ((KEEP, "keep", TARGET_KEEP_VS_STOCK),
                                 (COMPRESS, "compress", TARGET_COMPRESS_VS_STOCK)):
        pairs = [(m, _ratio(result, scheme, STOCK, m)) for m in sizes]
        pairs = [(m, x) for m, x in pairs if x is not None]
        if pairs:
            m, x = min(pairs, key=lambda p: p[1])
            out.append(f"- {'PASS' if x >= target else 'FAIL'}: {word} >= {target}x "
                       f"stock throughput at every size: lowest {x:.3f}x at mbs {m}")
        else:
            out.append(f"- n/a: {word} >= {target}x stock throughput: no size where both ran")
    # 4. kernels >= 85% of copy bandwidth
    if kernel_rows:
        worst = min(kernel_rows, key=lambda r: r["of_copy"])
        below = [r["codec"] for r in kernel_rows if r["of_copy"] < TARGET_KERNEL_OF_COPY]
        out.append(f"- {'PASS' if not below else 'FAIL'}: kernels >= {TARGET_KERNEL_OF_COPY:.0%} of copy "
                   f"bandwidth: lowest {worst['of_copy']:.0%} ({worst['codec']})"
                   + (f"; below: {', '.join(below)}" if below else ""))
    else:
        out.append(f"- n/a: kernels >= {TARGET_KERNEL_OF_COPY:.0%} of copy bandwidth: not measured")
    return out


def _auto_vs(result: dict, auto: str, what: str) -> str:
    """"auto at X's memory >= TARGET_AUTO_VS_FULL x X's throughput" (X = AUTOS[auto]) at the
    largest size both ran; FAIL where the plan there is above the budget (its note)."""
    src = AUTOS[auto]
    sizes = list(result.get("sizes") or [])
    pairs = [(m, _ratio(result, auto, src, m)) for m in sizes]
    pairs = [(m, x) for m, x in pairs if x is not None]
    if not pairs:
        return (f"- n/a: {what} >= {TARGET_AUTO_VS_FULL}x its throughput: no size where both ran")
    m, x = pairs[-1]
    per = ", ".join(f"mbs {a}: {b:.2f}x" for a, b in pairs)
    above = _by(result)[(auto, m)].get("note")
    ok = x >= TARGET_AUTO_VS_FULL and not above
    return (f"- {'PASS' if ok else 'FAIL'}: {what} >= {TARGET_AUTO_VS_FULL}x its throughput: "
            f"{x:.2f}x at mbs {m} ({per})" + (f"; NOT at equal memory at mbs {m}: {above}" if above else ""))


def _auto_vs_natives(result: dict) -> str:
    """"auto at megatron-core full's memory >= every native option's throughput" at the
    largest size where it and at least one native option ran."""
    what = "ours auto at megatron-core full's memory >= every native option's throughput at that size"
    by = _by(result)
    sizes = list(result.get("sizes") or [])
    ran = [m for m in sizes if any(_ratio(result, AUTO_AT_NATIVE_FULL, n, m) is not None for n in NATIVE)]
    if not ran:
        return f"- n/a: {what}: no size where it and a native option ran"
    m = ran[-1]
    ratios = {n: _ratio(result, AUTO_AT_NATIVE_FULL, n, m) for n in NATIVE}
    done = {n: x for n, x in ratios.items() if x is not None}
    worst = min(done, key=lambda n: done[n])
    above = by[(AUTO_AT_NATIVE_FULL, m)].get("note")
    ok = done[worst] >= 1.0 and not above
    missing = [n for n in NATIVE if n not in done]
    return (f"- {'PASS' if ok else 'FAIL'}: {what}: lowest {done[worst]:.2f}x ({worst}) at mbs {m} ("
            + ", ".join(f"{n}: {x:.2f}x" for n, x in done.items()) + ")"
            + (f"; not run at mbs {m}: {', '.join(missing)}" if missing else "")
            + (f"; NOT at equal memory at mbs {m}: {above}" if above else ""))


def headline(result: dict) -> str:
    """The target lines in one string (kept for callers of the earlier API)."""
    return "; ".join(line[2:] for line in targets(result))


def markdown(result: dict, kernel_rows: Optional[list[dict]] = None, kernel_header: str = "") -> str:
    sh = result["shape"]
    cap = result.get("capacity")
    lines = [f"{describe(sh)} on one device: {result['machine']}. Megatron's recompute is here in "
             f"two kinds: \"{SELECTIVE}\" and \"{FULL}\" are our emulations (Megatron's plans on our "
             "sites, run by our recompute machinery, with SDPA for the core attention as every scheme of "
             f"ours and stock); \"{NATIVE_FULL}\" (recompute_granularity full, uniform, 1 layer per "
             f"checkpoint), \"{NATIVE_SELECTIVE}\" (selective, recompute_modules "
             f"{NATIVE[NATIVE_SELECTIVE]['recompute_modules']}) and \"{NATIVE_OFFLOAD}\" (fine-grained "
             f"activation offloading of {list(NATIVE_OFFLOAD_MODULES)}) are megatron-core's own options on "
             "pure megatron-core models (local spec, no Transformer Engine, no llm_act binding, so its own "
             f"unfused core attention). \"{AUTO_AT_NATIVE_FULL}\" is planned as \"{AUTO_AT_FULL}\" with "
             f"the budget = {NATIVE_FULL}'s measured memory. Memory of a step: "
             + ("`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (weights and "
                "gradients included)" if result.get("memory_kind") == "cuda peak" else
                "the SavedTensorLedger's bytes held at the end of forward (CPU has no peak counter)")
             + (f"; capacity {_size(cap)}" if cap else "") + ".", "",
             table(result), "", "Targets (ratios within this run):", "", *targets(result, kernel_rows)]
    if kernel_rows:
        lines += ["", "Codec bandwidth against copy bandwidth:", "", kernels.table(kernel_header, kernel_rows)]
    return "\n".join(lines)


def plot(result: dict, path: str) -> str:
    """Tokens/s and memory against micro-batch size, one line per scheme."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SCHEMES:
        pts = sorted((r["mbs"], r) for r in result["rows"] if r["scheme"] == name and r["fits"]
                     and "tokens_per_s" in r)
        if not pts:
            continue
        a.plot([m for m, _ in pts], [r["tokens_per_s"] for _, r in pts], marker="o", label=name)
        b.plot([m for m, _ in pts], [r["mem_bytes"] / _unit(result)[1] for _, r in pts], marker="o", label=name)
    for ax, label in ((a, "tokens/s"), (b, f"{_unit(result)[0]} ({result.get('memory_kind', '')})")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size")
        ax.set_ylabel(label)
    a.legend(fontsize=7)
    fig.suptitle(f"{describe(result['shape'])}; {result['machine']}", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def save(result: dict, output_dir: str, text: str, kernel_rows: Optional[list[dict]] = None) -> dict:
    """gpu.md (the section), gpu.json (every row) and gpu_throughput.png under `output_dir`."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {"md": os.path.join(output_dir, "gpu.md"), "json": os.path.join(output_dir, "gpu.json"),
             "png": os.path.join(output_dir, "gpu_throughput.png")}
    with open(paths["md"], "w") as f:
        f.write(text + "\n")
    data = {k: v for k, v in result.items() if k != "shape"}
    data["shape"] = shape_record(result["shape"])
    data["kernels"] = kernel_rows
    data["static"] = {str(k): v for k, v in result.get("static", {}).items()}
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1, default=str)
    plot(result, paths["png"])
    return paths
