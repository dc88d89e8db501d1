"""GPU: throughput against micro-batch size for stock, Megatron's recompute modes and ours.

For a megatron-core GPT that fits the card (default ~350M parameters: 24 layers, hidden
1024, 16 heads, seq 1024, bf16) every scheme trains forward+backward at micro-batch sizes
1, 2, 4, ... until it runs out of memory; per size: tokens/s (CUDA events, median of a few
iterations, all schemes measured in one process) and peak allocated memory
(`torch.cuda.max_memory_allocated`). Every scheme uses the same attention kernel (ours,
SDPA mode), so the comparison isolates what is stored. "ours" solves the MILP per
micro-batch size on the analytic profile with the card's memory (minus the static memory
measured after building, minus a margin) as budget, so it compresses or recomputes only
what the budget forces. Also: codec bandwidth against the copy bandwidth
(`llm_act.bench.kernels`).

On CPU `run(device="cpu", ...)` with a tiny shape exercises the same code (binding, plan
choice, the table) without peak-memory figures; the numbers mean nothing there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from llm_act.bench import memory as M


@dataclass(frozen=True)
class GpuShape:
    layers: int = 24
    hidden: int = 1024
    heads: int = 16
    seq: int = 1024
    vocab: int = 50304

    def params(self) -> int:
        return 12 * self.layers * self.hidden ** 2 + self.vocab * self.hidden


SCHEMES = ("stock", "megatron selective", "megatron full", "ours")
MARGIN = 0.08  # share of the card kept free for the allocator and workspace


def _scheme(name: str, choice: Optional[dict] = None) -> M.Scheme:
    from llm_act.patches.megatron.recompute import full_plan, selective_plan

    base = {"stock": {}, "megatron selective": selective_plan(), "megatron full": full_plan()}
    return M.Scheme(name, "", dict(choice if choice is not None else base[name]),
                    attention="sdpa", convert_attention=True)


def ours_choice(shape: GpuShape, mbs: int, budget: int) -> Optional[dict]:
    """The MILP's per-block choice for this micro-batch size within `budget` activation
    bytes (None: nothing fits)."""
    from llm_act.plan_cli import _reference_variance
    from llm_act.planner import InfeasibleBudget, InfeasibleVariance, solve_plan
    from llm_act.planner.analytic import ModelShape, block_profile

    ms = ModelShape(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                    seq_length=shape.seq, micro_batch_size=mbs, vocab_size=shape.vocab,
                    position_embedding="rope", attention="sdpa")
    block = M.restricted_block(block_profile(ms, count=shape.layers))
    try:
        plan = solve_plan([block], budget, variance_budget=_reference_variance([block]))
    except (InfeasibleBudget, InfeasibleVariance):
        return None
    choice = dict(plan.choice[0])
    choice.setdefault("attn.dropout_mask", "regen")
    return choice


def _model(shape: GpuShape, device: torch.device, scheme: M.Scheme):
    from llm_act import testing

    cfg = testing.small_config(hidden_size=shape.hidden, num_attention_heads=shape.heads,
                               num_layers=shape.layers, dtype=torch.bfloat16, dropout=0.0,
                               use_cpu_initialization=device.type == "cpu")
    model = testing.gpt_model(cfg, vocab_size=shape.vocab, max_sequence_length=shape.seq).to(device)
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in [m for m in model.modules() if isinstance(m, TransformerLayer)]:
        M.bind_layer(layer, int(layer.layer_number) - 1, scheme)
    return model


def _step_ms(model, shape: GpuShape, mbs: int, device: torch.device, repeat: int) -> float:
    from llm_act.bench.timing import median_ms

    ids = torch.randint(0, shape.vocab, (mbs, shape.seq), device=device)
    pos = torch.arange(shape.seq, device=device).unsqueeze(0).expand(mbs, -1)

    def step():
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return median_ms(step, device, warmup=1, repeat=repeat)


def run(shape: GpuShape = GpuShape(), device: Optional[str] = None, sizes=(1, 2, 4, 8, 16, 32, 64),
        repeat: int = 3, log: Callable[[str], None] = lambda m: None) -> dict:
    """{"rows": [{scheme, mbs, tokens_per_s, peak_gib, fits}], "machine", "budget"}."""
    from llm_act import testing
    from llm_act.bench.timing import machine_line

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    testing.init_parallel(seed=1234)
    rows = []
    budget = None
    try:
        if cuda:
            total = torch.cuda.get_device_properties(dev).total_memory
            static = shape.params() * (2 + 4)  # bf16 weights + fp32 gradients
            budget = int(total * (1 - MARGIN)) - static
        for name in SCHEMES:
            for mbs in sizes:
                choice = None
                if name == "ours":
                    choice = ours_choice(shape, mbs, budget if budget is not None else 2**62)
                    if choice is None:
                        rows.append({"scheme": name, "mbs": mbs, "fits": False})
                        break
                model = None
                try:
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(dev)
                    model = _model(shape, dev, _scheme(name, choice))
                    ms = _step_ms(model, shape, mbs, dev, repeat)
                    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
                    rows.append({"scheme": name, "mbs": mbs, "fits": True, "ms": ms,
                                 "tokens_per_s": mbs * shape.seq / ms * 1e3, "peak_gib": peak,
                                 "plan": choice})
                    log(f"  {name} mbs {mbs}: {rows[-1]['tokens_per_s']:.0f} tokens/s")
                except torch.cuda.OutOfMemoryError:
                    rows.append({"scheme": name, "mbs": mbs, "fits": False})
                    break
                finally:
                    del model
                    if cuda:
                        torch.cuda.empty_cache()
    finally:
        testing.destroy_parallel()
    return {"rows": rows, "machine": machine_line(dev), "budget": budget, "shape": shape}


def largest(rows: list[dict], scheme: str) -> int:
    fit = [r["mbs"] for r in rows if r["scheme"] == scheme and r["fits"]]
    return max(fit) if fit else 0


def table(result: dict) -> str:
    rows = result["rows"]
    sizes = sorted({r["mbs"] for r in rows})
    by = {(r["scheme"], r["mbs"]): r for r in rows}
    lines = ["| scheme | " + " | ".join(f"mbs {m}: tokens/s (peak GiB)" for m in sizes)
             + " | largest mbs |", "|---|" + "---:|" * (len(sizes) + 1)]
    for name in SCHEMES:
        cells = []
        for m in sizes:
            r = by.get((name, m))
            if r is None:
                cells.append("")
            elif not r["fits"]:
                cells.append("OOM")
            else:
                peak = "" if r["peak_gib"] is None else f" ({r['peak_gib']:.1f})"
                cells.append(f"{r['tokens_per_s']:.0f}{peak}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {largest(rows, name)} |")
    return "\n".join(lines)


def headline(result: dict) -> str:
    """Ours against full recompute at the largest size full recompute fits, and the ratio of
    largest micro-batches."""
    rows = result["rows"]
    by = {(r["scheme"], r["mbs"]): r for r in rows if r["fits"]}
    m = largest(rows, "megatron full")
    parts = []
    if ("ours", m) in by and ("megatron full", m) in by:
        parts.append(f"ours / full recompute throughput at mbs {m}: "
                     f"{by[('ours', m)]['tokens_per_s'] / by[('megatron full', m)]['tokens_per_s']:.2f}x")
    s = [r for r in rows if r["fits"] and r["mbs"] == 1]
    st = {r["scheme"]: r["tokens_per_s"] for r in s}
    if "stock" in st and "ours" in st:
        parts.append(f"ours / stock at mbs 1: {st['ours'] / st['stock']:.3f}x")
    if m:
        parts.append(f"largest mbs ours / full: {largest(rows, 'ours') / m:.1f}x")
    return "; ".join(parts)

