"""Memory per layer: every scheme on the same megatron-core GPT block, bytes from the ledger.

One bf16 TransformerLayer (local spec, RoPE, bias on) is built with fixed weights for each
scheme; its forward runs once inside a `SavedTensorLedger` (after a warm-up
forward/backward, so megatron's global buffers exist) and the bytes left for backward are
reported per s*b*h, with the ratio to stock. For stock and our "compress" plan the memory
the process holds after forward (profiler: allocations minus frees, output excluded) is
given beside the ledger, as the independent cross-check.

The schemes (`SCHEMES`) are the papers' methods written as fixed plans on our sites, and
megatron's own recompute modes; `planner_plans` adds our MILP at three budgets. A scheme is
applied with `bind_layer`: `swap.convert_layer` plus `LayerRecompute.bind` (the same codec
and recompute machinery the Controller drives), so the bench does not depend on which
plans the Controller's front end accepts yet.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from llm_act import cpu
from llm_act.codecs.registry import KEEP, RECOMPUTE, make_codec
from llm_act.ledger import SavedTensorLedger
from llm_act.measurement.measured_profile import RECOMPUTABLE
from llm_act.patches.megatron.recompute import bind_with
from llm_act.plan import recompute_layer, selective_layer
from llm_act.planner import BlockProfile, InfeasibleBudget, InfeasibleVariance, SiteProfile, solve_plan
from llm_act.planner.analytic import block_profile
from llm_act.planner.budget import min_budget, reference_variance
from llm_act.planner.model_shape import ModelShape
from llm_act.runtime.seeds import codec_seed
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_SOFTMAX,
    DEFAULT_CODECS,
    MASK_SITES,
    MLP_ACT_INPUT,
    MOE_SITES,
    QK_NORM_SITES,
    SITES,
)
from llm_act.train import parallel, rng, small_gpt

#: bits per element GACT's adaptive allocation averages (the paper's headline setting)
GACT_BITS = 4
#: the GACT scheme chooses among these per site (its per-tensor bit widths)
GACT_CODECS = ("int1", "int2", "int4", "int8")
#: sites llm_act can recompute alone (q/k/v only with the whole block; attn.out with the
#: core-attention region, which the memory-efficient attention replaces): the measured
#: profile's set, in site order
SITE_RECOMPUTABLE = tuple(s for s in SITES if s in RECOMPUTABLE)
#: the planner's budgets, as fractions of the stock block's analytic bytes
PLANNER_BUDGETS = {"loose": 0.35, "middle": 0.2, "tight": 0.12}
#: plans are solved for a stack of this many identical blocks (the MILP's transient peak,
#: one block's decoded tensors, is then a small share of the budget, as in a real model)
STACK = 24


def block_shape(s: int = 256, b: int = 2, h: int = 512, a: int = 8, dropout: float = 0.0,
                dtype: str = "bf16") -> ModelShape:
    """The block measured, as a `ModelShape`: one layer of sequence `s`, micro-batch `b`,
    hidden `h`, `a` heads, `dropout`, `dtype` ("bf16", "fp16" or "fp32"), RoPE, bias on; the
    rest as ModelShape's defaults (LayerNorm, GELU, ffn 4h, attention "auto": `analytic_shape`
    sets the mode a scheme runs)."""
    return ModelShape(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=s,
                      micro_batch_size=b, dtype=dtype, dropout=dropout, position_embedding="rope")


def sbh(shape: ModelShape) -> int:
    """s*b*h of the block: what the bench's bytes are given per."""
    return shape.seq_length * shape.micro_batch_size * shape.hidden_size


def describe(shape: ModelShape) -> str:
    """"s=256 b=2 h=512 a=8 bfloat16 dropout 0.0": the block's dimensions in one line."""
    return (f"s={shape.seq_length} b={shape.micro_batch_size} h={shape.hidden_size} "
            f"a={shape.num_attention_heads} {str(shape.torch_dtype).replace('torch.', '')} "
            f"dropout {shape.dropout}")


@dataclass
class Scheme:
    """A fixed plan for one block: {site: choice}, the core-attention mode, a label."""

    name: str
    source: str
    choice: dict[str, str]
    attention: str = "stock"  # "stock" keeps megatron's unfused attention; "auto": ours
    convert_attention: bool = False
    note: str = ""
    predicted: dict = field(default_factory=dict)
    layers: tuple = ()
    """per-layer choices, when a plan splits identical layers (some recomputed whole)"""


def _every(name: str, masks: str = KEEP, skip=()) -> dict[str, str]:
    return {s: (masks if s in MASK_SITES else name) for s in SITES if s not in skip}


def compress_choice() -> dict[str, str]:
    """Our "compress" plan with the attention sites included (design brief defaults)."""
    return dict(DEFAULT_CODECS)


def fixed_schemes() -> list[Scheme]:
    """Stock, Megatron's recompute modes and each paper's scheme as a fixed plan (GACT's is
    solved per shape in `gact_scheme`)."""
    return [
        Scheme("stock", "megatron-core", {}, note="every tensor as megatron-core saves it"),
        Scheme("megatron selective", "Megatron-LM", selective_layer(),
               note="core attention recomputed from kept q, k, v"),
        Scheme("megatron full", "Megatron-LM", recompute_layer(),
               note="whole block recomputed from its kept input"),
        Scheme("ActNN int2", "ActNN", _every("int2", masks="bitmask"), convert_attention=True,
               note="per-group (128) INT2 stochastic at every value site, 1-bit masks"),
        Scheme("DIVISION dual2", "DIVISION", _every("dual2", skip=(ATTN_SOFTMAX,)),
               convert_attention=True, attention="auto",
               note="dual precision (pooled LFC + 2-bit HFC) at every value site"),
        Scheme("Few-bit GELU 3-bit", "Few-Bit Backward", {MLP_ACT_INPUT: "fewbit3"},
               note="3-bit GELU derivative at mlp.act_input, the rest stock"),
        Scheme("compress (Adacc)", "Adacc / ours", compress_choice(), convert_attention=True,
               attention="auto",
               note="outlier INT4 + layer-specific codecs, memory-efficient attention"),
    ]


def analytic_shape(shape: ModelShape, attention: str) -> ModelShape:
    """`shape` with the core-attention mode `attention` (as in ActConfig)."""
    return shape.with_(attention=attention)


def restricted_block(block, codecs: Optional[dict] = None, recompute: tuple = SITE_RECOMPUTABLE):
    """`block` with each site's options limited (`codecs`: site -> allowed names, None =
    all) and "recompute" offered only at `recompute` sites (what the bench can bind); with
    no `recompute` site the whole-block recompute goes too (a scheme that never recomputes)."""
    sites = []
    for st in block.sites:
        allowed = None if codecs is None else codecs.get(st.name)
        opts = tuple(o for o in st.codecs if allowed is None or o.name in allowed)
        fwd = st.forward_ms if st.name in recompute else None
        sites.append(SiteProfile(st.name, st.nbytes, fwd, st.inputs, opts, st.sensitivity))
    return BlockProfile(tuple(sites), count=block.count, inflight=block.inflight,
                        full_ms=block.full_ms if recompute else None)


def gact_scheme(shape: ModelShape) -> Scheme:
    """GACT: per-tensor bit widths minimising the summed noise (objective="variance") under
    a budget of `GACT_BITS` bits per element on average (masks at 1 bit), on the analytic
    profile of this block with megatron's stock attention (GACT compresses the softmax),
    solved for a stack of `STACK` blocks (plus the MILP's transient peak)."""
    block = block_profile(analytic_shape(shape, "stock"), count=STACK)
    allowed = {st.name: (("bitmask",) if st.name in MASK_SITES else GACT_CODECS) for st in block.sites}
    block = restricted_block(block, allowed, recompute=())
    per_block = 0
    for st in block.sites:
        numel = _numel(st, shape)
        per_block += -(-numel // 8) if st.name in MASK_SITES else numel * GACT_BITS // 8
    # STACK blocks at the average bit width, plus the transient of the block in backward
    budget = STACK * per_block + sum(st.nbytes for st in block.sites)
    plan = solve_plan([block], budget, objective="variance")
    choice = dict(plan.choice[0])
    return Scheme(f"GACT {GACT_BITS}-bit avg", "GACT", choice, convert_attention=True,
                  note="bits per tensor by objective='variance' at a 4-bit average budget",
                  predicted={"bytes": plan.activation_bytes, "budget": budget})


def _numel(site, shape: ModelShape) -> int:
    e = shape.elem_bytes
    return site.nbytes if site.name in MASK_SITES else site.nbytes // e


def planner_schemes(shape: ModelShape) -> list[Scheme]:
    """Our MILP (objective "time") on the analytic profile of the block with the
    memory-efficient attention, for a stack of `STACK` blocks, at the budgets of
    `PLANNER_BUDGETS` (fractions of the stock stack's analytic bytes) and the noise budget
    of the "compress" plan (as `llm-act plan` does); recompute offered where the bench can
    bind it. A budget below the smallest feasible one is raised to that (said in the note)."""
    stock_bytes = STACK * sum(st.nbytes for st in block_profile(analytic_shape(shape, "stock")).sites)
    block = restricted_block(block_profile(analytic_shape(shape, "auto"), count=STACK))
    noise = reference_variance([block])
    out = []
    for label, frac in PLANNER_BUDGETS.items():
        budget = int(frac * stock_bytes)
        note = f"MILP, budget {frac:.0%} of stock ({STACK} blocks), noise <= compress"
        try:
            plan = solve_plan([block], budget, variance_budget=noise)
        except (InfeasibleBudget, InfeasibleVariance):
            budget = min_budget([block], 0, noise)
            plan = solve_plan([block], budget, variance_budget=noise)
            note += f"; raised to the least feasible {budget / stock_bytes:.1%}"
        choice = dict(plan.choice[0])
        # the memory-efficient attention stores no softmax and draws its dropout mask
        # from the generator (the analytic profile has no such sites)
        choice.setdefault(ATTN_DROPOUT_MASK, "regen")
        out.append(Scheme(f"planner {label}", "ours", choice, convert_attention=True, attention="auto",
                          note=note, predicted={"bytes": plan.activation_bytes, "budget": budget,
                                                "overhead_ms": plan.overhead_ms, "stack": STACK}))
    return out


def all_schemes(shape: ModelShape) -> list[Scheme]:
    schemes = fixed_schemes()
    schemes.insert(4, gact_scheme(shape))
    return schemes + planner_schemes(shape)


# ---- building and binding ----------------------------------------------------------------


def codec_factory(layer_index: int, seed: int = 1234) -> Callable[[str, str], object]:
    """codec_of(site, name) for `recompute.bind_with`: one instance per (site, name), seeded
    as the Controller seeds them."""
    cache: dict = {}

    def codec_of(site: str, name: str):
        key = (site, name)
        if key not in cache:
            kw = {"activation": "gelu"} if site == MLP_ACT_INPUT else {}
            cache[key] = make_codec(name, seed=codec_seed(seed, layer_index, site), **kw)
        return cache[key]

    return codec_of


def bind_layer(layer: torch.nn.Module, index: int, scheme: Scheme, seed: int = 1234) -> None:
    """Convert `layer` in place and bind `scheme` (stock: the layer is left untouched)."""
    if scheme.name == "stock":
        return
    from llm_act.patches.megatron.swap import convert_layer

    convert_layer(layer, index, attention=scheme.convert_attention)
    if scheme.convert_attention:
        layer.self_attention.core_attention.set_attention_mode(scheme.attention)
    bind_with(layer.act_recompute, scheme.choice, codec_factory(index, seed))


def build_layer(shape: ModelShape, seed: int = 0):
    cfg = small_gpt.small_config(hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
                                 dtype=shape.torch_dtype, dropout=shape.dropout, num_layers=1, add_bias_linear=True)
    torch.manual_seed(seed)
    return small_gpt.transformer_layer(cfg, layer_number=1)


def held_after_forward(forward: Callable[[], torch.Tensor], runs: int = 3,
                       before: Optional[Callable[[], None]] = None) -> int:
    """Bytes a forward allocates and leaves allocated (the profiler's allocation events),
    its output excluded: the independent check of the ledger. The smallest of `runs` runs
    (an earlier run may fill one-off caches, thread pools or scratch buffers, which are not
    activations); `before` runs ahead of each, outside the profiler."""
    from torch.profiler import ProfilerActivity, profile

    held = []
    for _ in range(runs):
        if before is not None:
            before()
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = forward()
        held.append(_still_allocated(prof) - out.numel() * out.element_size())
        del out
    return min(held)


def _still_allocated(prof) -> int:
    """Bytes allocated inside the profiled region and not freed there. Frees of blocks
    allocated before it are left out: summing every event's memory would subtract them, and
    whether the profiler knows such a block's size depends on whether an earlier profiled
    region (another test's, say) allocated it -- the sum would depend on what ran before."""
    from torch._C._profiler import _ExtraFields_Allocation

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if isinstance(node.extra_fields, _ExtraFields_Allocation):
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    live: dict[int, int] = {}
    for _t, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    return sum(live.values())


def ledger_and_held(forward: Callable[[], torch.Tensor], runs: int = 3):
    """(SavedTensorLedger of one forward, `held_after_forward` of the same forward): every
    forward starts from one RNG state, so all draw the same dropout masks. Otherwise each
    draws new ones, and what a data-dependent codec stores (outlier_int4's outliers) moves
    by kilobytes with how far the RNG had advanced -- that is, with which tests ran before."""
    state = rng.get_state()
    with SavedTensorLedger() as led:
        out = forward()
    del out
    held = held_after_forward(forward, runs, before=lambda: rng.set_state(state))
    return led, held


def measure(shape: ModelShape, scheme: Scheme, process: bool = False) -> dict:
    """{"total", "by_site", "held"} of one forward of the block under `scheme`."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    layer = build_layer(shape)
    bind_layer(layer, 0, scheme)
    rope = RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0, use_cpu_initialization=True)
    emb = rope(shape.seq_length)
    x0 = torch.randn(shape.seq_length, shape.micro_batch_size, shape.hidden_size, dtype=shape.torch_dtype,
                     requires_grad=True, generator=torch.Generator().manual_seed(1))

    def forward():
        return layer(x0 * 1, attention_mask=None, rotary_pos_emb=emb)[0]

    forward().float().sum().backward()  # warm-up: global buffers exist, backward works
    if not torch.isfinite(x0.grad).all():
        raise RuntimeError(f"scheme {scheme.name!r}: non-finite input gradient")
    if process:
        led, held = ledger_and_held(forward)
    else:
        with SavedTensorLedger() as led:
            out = forward()
        del out
        held = None
    return {"total": led.total_bytes, "by_site": led.by_site(), "held": held}


def run(shapes: list[ModelShape], process_for=("stock", "compress (Adacc)"),
        log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """Every scheme on every shape; rows {scheme, source, note, shape, total, per_sbh, ratio,
    held_per_sbh, by_site, predicted}."""
    cpu.install()  # the bench owns its process: megatron-core on CPU needs the stand-ins
    parallel.init_parallel(seed=1234)
    rows = []
    try:
        for shape in shapes:
            stock_total = None
            for scheme in all_schemes(shape):
                r = measure(shape, scheme, process=scheme.name in process_for)
                if scheme.name == "stock":
                    stock_total = r["total"]
                rows.append({
                    "scheme": scheme.name, "source": scheme.source, "note": scheme.note,
                    "shape": shape, "total": r["total"], "per_sbh": r["total"] / sbh(shape),
                    "ratio": r["total"] / stock_total,
                    "held_per_sbh": None if r["held"] is None else r["held"] / sbh(shape),
                    "by_site": r["by_site"], "choice": scheme.choice, "predicted": scheme.predicted,
                })
                log(f"  {describe(shape)}: {scheme.name:<22} {r['total'] / sbh(shape):8.3f} B/sbh")
    finally:
        parallel.destroy_parallel()
    return rows


def table(rows: list[dict]) -> str:
    """One markdown table: schemes down, the dropout settings across."""
    drops = sorted({r["shape"].dropout for r in rows})
    names = list(dict.fromkeys(r["scheme"] for r in rows))
    by = {(r["scheme"], r["shape"].dropout): r for r in rows}
    head = "| scheme | from | " + " | ".join(
        f"dropout {d}: B/sbh | ratio | process B/sbh" for d in drops) + " |"
    lines = [head, "|---|---|" + "---:|---:|---:|" * len(drops)]
    for n in names:
        cells = []
        for d in drops:
            r = by.get((n, d))
            if r is None:
                cells += ["", "", ""]
                continue
            held = "" if r["held_per_sbh"] is None else f"{r['held_per_sbh']:.3f}"
            cells += [f"{r['per_sbh']:.3f}", f"{r['ratio']:.3f}", held]
        src = next(r["source"] for r in rows if r["scheme"] == n)
        lines.append(f"| {n} | {src} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plans_table(rows: list[dict]) -> str:
    """The choice each scheme makes per site (first shape with dropout, else the first)."""
    drop = max(r["shape"].dropout for r in rows)
    picked = [r for r in rows if r["shape"].dropout == drop]
    sites = [s for s in SITES if s not in MOE_SITES  # the bench's blocks are dense
             and (s not in QK_NORM_SITES or picked[0]["shape"].qk_layernorm)]
    lines = ["| scheme | " + " | ".join(sites) + " |", "|---|" + "---|" * len(sites)]
    for r in picked:
        c = r["choice"]
        lines.append(f"| {r['scheme']} | " + " | ".join(
            ("full" if r["scheme"] == "megatron full" and c.get(s) == RECOMPUTE else c.get(s, KEEP))
            for s in sites) + " |")
    return "\n".join(lines)
