"""`llm-act plan`: size a training job on paper. Plans every pipeline stage of a preset
model (--model) or of a Hugging Face config.json (--hf-config: gpt2, llama, mistral, qwen2 or
qwen3, read without transformers or a download; a key the planner cannot plan is refused) from
the analytic profile (no GPU) and prints, per stage, which sites are kept, compressed or
recomputed, the predicted memory and the added time.

The budget is the whole device: static memory (weights, gradients, optimizer state) and
the activations outside the blocks (embedding mask, output layer input, the loss) are
subtracted first. The final norm's input is planned with the last stage's blocks (kept or
compressed, printed once after the per-layer rows). The loss is counted under --output-loss: "stock" (megatron's,
which keeps the fp32 [tokens, vocab/tp] logits), "chunked" (the chunked linear +
cross-entropy: one fp32 log-sum-exp per token, one more logits GEMM in backward), or "auto"
(default, as at run time: chunked when only it fits, or when the plan with it plus its
extra GEMM adds less time). The
noise budget defaults to that of the "compress" plan (each site at its default codec,
Adacc sec. 3.2), so the planner never picks a codec noisier overall than those defaults;
"none" lets it pick on time alone (it then favours 1- and 2-bit codes).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional, Union

from llm_act.cli.parsing import POSITIVE_INT, fail
from llm_act.config import parse_bytes
from llm_act.config import ATTENTION_MODES
from llm_act.planner.analytic import layer_forward_ms
from llm_act.planner.budget import OUTPUT_LOSS_CHOICES, StageResult, plan_stages
from llm_act.planner.hf_config import FAMILIES, HFConfigError, load_hf_config, shape_from_hf_config
from llm_act.planner.model_shape import DeviceModel, ModelShape
from llm_act.planner.presets import MODELS, model_shape

_GIB = float(2**30)
_MIB = float(2**20)
DEVICES = {"h100": DeviceModel, "cpu": DeviceModel.cpu}


# ---- argument types (argparse names the flag in its error) -------------------------------
def _size(text: str) -> int:
    try:
        return parse_bytes(text, "size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).replace("size: ", "")) from None


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}")
    return value


def _capacity(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _variance(text: str) -> Union[str, float]:
    if text in ("compress", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(
            f"expected 'compress', 'none' or a number >= 0, got {text!r}")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    """The `plan` subcommand on the `llm-act` subparsers."""
    p = sub.add_parser("plan", help="plan a preset model or a Hugging Face config.json per pipeline "
                                    "stage (analytic, no GPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", choices=list(MODELS), help="a preset model")
    model.add_argument("--hf-config", metavar="PATH", default=None,
                       help=f"a model's Hugging Face config.json (model_type {', '.join(FAMILIES)}); "
                            f"read as JSON, nothing downloaded")
    p.add_argument("--seq-length", type=POSITIVE_INT, default=None,
                   help="tokens per sequence (default: the model's context length)")
    p.add_argument("--micro-batch-size", type=POSITIVE_INT, default=1)
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=POSITIVE_INT, default=1, help="pipeline-parallel size")
    p.add_argument("--dp", type=POSITIVE_INT, default=1,
                   help="data-parallel size: ranks = tp x pp x dp. ZeRO (--zero-stage) shards the "
                        "dense parameters' optimizer state, gradients and weights over it")
    p.add_argument("--ep", type=POSITIVE_INT, default=1,
                   help="expert-parallel size (MoE models): the experts are split over ep of the dp "
                        "data-parallel ranks, so --dp must be a multiple of it; each expert's "
                        "optimizer state shards over the remaining dp / ep ranks only")
    p.add_argument("--moe-capacity-factor", type=_capacity, default=None,
                   help="MoE expert capacity factor (default: dropless); each expert keeps at most "
                        "factor x tokens x top-k / experts rows")
    p.add_argument("--budget", type=_size, required=True,
                   help="device memory per GPU: bytes or a size such as 60GB (1e9) or 60GiB (2**30)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dropout", type=_probability, default=None,
                   help="hidden and attention dropout (default: the model's)")
    p.add_argument("--attention", choices=ATTENTION_MODES, default="auto",
                   help="'stock' is the unfused path that stores the softmax")
    p.add_argument("--variance-budget", type=_variance, default="compress",
                   help="noise budget: 'compress' (the default codecs' noise), 'none', or a number")
    p.add_argument("--output-loss", choices=OUTPUT_LOSS_CHOICES, default="auto",
                   help="the output layer's loss on the last stage: 'stock' (megatron's; keeps the fp32 "
                        "[tokens, vocab/tp] logits), 'chunked' (never the full logits; one more logits GEMM "
                        "in backward; not with --sequence-parallel), or 'auto' (default: chunked when only it "
                        "fits or when it adds less time, as plan 'auto' chooses at run time)")
    p.add_argument("--device", choices=list(DEVICES), default="h100",
                   help="device model for times and the RNG state size")
    p.add_argument("--json", metavar="OUT", default=None,
                   help="also write the report (its 'plan' member is a JSON plan) to OUT")
    p.set_defaults(plan_parser=p)  # shape errors are reported by this parser
    return p


# ---- printing --------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / _GIB:.3f} GiB"


def _gb_up(n: int) -> str:
    """n bytes in GB rounded up to the MB, so passing it back as --budget works."""
    return f"{math.ceil(n / 1e6) / 1e3:.3f}GB"


def _named(name: str, hf_config: Optional[str]) -> dict:
    """The model's name in the header and the JSON report: the preset, or the config's
    model_type followed by the config's path."""
    return {"model": name} if hf_config is None else {"model": name, "hf_config": hf_config}


def header(shape: ModelShape, name: str, args_budget: int, zero_stage: int, dp: int,
           device: DeviceModel, variance: Union[str, float, None], output_loss: str = "stock",
           hf_config: Optional[str] = None) -> str:
    fields = {
        **_named(name, hf_config), "num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_attention_heads, "num_query_groups": shape.num_query_groups,
        "ffn_hidden_size": shape.ffn_hidden_size, "gated_linear_unit": shape.gated_linear_unit,
        "activation": shape.activation, "vocab_size": shape.vocab_size,
        "seq_length": shape.seq_length, "micro_batch_size": shape.micro_batch_size,
        "tp": shape.tp, "pp": shape.pp, "dp": dp, "sequence_parallel": shape.sequence_parallel,
        "zero_stage": zero_stage, "dtype": shape.dtype, "dropout": shape.dropout,
        "attention": "stock" if not shape.fused_attention else "memory-efficient",
        "budget_bytes": args_budget, "variance_budget": variance, "output_loss": output_loss,
        "profile": "analytic",
        "device": device.describe(),
    }
    if shape.is_moe:
        fields.update(num_experts=shape.num_experts, moe_topk=shape.moe_topk,
                      moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
                      moe_capacity_factor=shape.moe_capacity_factor, ep=shape.ep,
                      tokens_per_expert=shape.tokens_per_expert)
    return "# llm-act plan " + " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items())


def outside_blocks(res: StageResult) -> str:
    """What the "outside the blocks" line says after its total: what it holds, and on the last
    stage which output loss was chosen and the bytes of each choice."""
    if res.output_loss is None:
        return "embedding mask; part of the peak at the end of forward"
    each = ", ".join(f"{name} {_gib(n)}" for name, n in res.output_bytes.items())
    return (f"embedding mask, output layer input and loss; output loss: {res.output_loss} "
            f"(output layer input + loss state: {each}); part of the peak at the end of forward")


def stage_table(shape: ModelShape, res: StageResult, device: DeviceModel, budget: int) -> list[str]:
    """The per-block table of one planned stage and its totals."""
    plan = res.plan
    block = res.blocks[0]
    choice = plan.choice[0]
    first, last = res.layers
    lines = [f"stage {res.stage} of {shape.pp}: layers {first}-{last} ({block.count} layers), "
             f"{res.inflight} micro-batch{'es' if res.inflight > 1 else ''} in flight",
             f"  {'site':<25} {'choice':<13} {'stored MiB/layer':>17} {'of MiB':>9} {'+ms/layer':>10}"]
    stored_sum = keep_sum = ms_sum = 0.0
    for site in block.sites:
        name = choice[site.name]
        stored, ms = _priced(site, name)
        stored_sum, keep_sum, ms_sum = stored_sum + stored, keep_sum + site.nbytes, ms_sum + ms
        lines.append(f"  {site.name:<25} {name:<13} {stored / _MIB:>17.3f} {site.nbytes / _MIB:>9.3f} "
                     f"{ms:>10.4f}")
    lines.append(f"  {'per layer':<25} {'':<13} {stored_sum / _MIB:>17.3f} {keep_sum / _MIB:>9.3f} "
                 f"{ms_sum:>10.4f}")
    outer_keep = 0
    for i, outer in enumerate(res.blocks[1:], start=1):  # after the last layer, once (the final norm)
        for site in outer.sites:
            name = plan.choice[i][site.name]
            stored, ms = _priced(site, name)
            outer_keep += res.inflight * site.nbytes
            lines.append(f"  {site.name:<25} {name:<13} {stored / _MIB:>17.3f} {site.nbytes / _MIB:>9.3f} "
                         f"{ms:>10.4f}  (once, after layer {last})")
    total = plan.activation_bytes + res.static_bytes
    compute = 3 * layer_forward_ms(shape, device) * block.count
    added = plan.overhead_ms + res.output_gemm_ms
    gemm = (f"; incl. {res.output_gemm_ms:.3f} ms for the chunked loss's extra logits GEMM"
            if res.output_gemm_ms else "")
    keep_all = res.inflight * block.count * keep_sum + outer_keep
    whole = plan.full[0] if plan.full else {}
    if whole:
        lines.append(f"  {'whole-block recompute':<25} " + ", ".join(
            f"{n} of {block.count} layers from their input ({'kept' if c == 'keep' else c})"
            for c, n in sorted(whole.items())) + (" (the rows above: the other layers)"
                                                   if sum(whole.values()) < block.count else ""))
    lines += [
        f"  predicted activation memory  {_gib(plan.activation_bytes)} ({plan.activation_bytes} bytes: "
        f"stored, plus {_gib(plan.peak_bytes)} at the peak, the end of forward or a block's backward; "
        f"keeping everything stores {_gib(keep_all)})",
        f"  outside the blocks           {_gib(res.outer_bytes)} ({outside_blocks(res)})",
        f"  static memory                {_gib(res.static_bytes)} (weights, grads, fp32 master + Adam)",
        f"  total                        {_gib(total)} of the {_gib(budget)} budget",
        f"  overhead                     {added:.3f} ms per iteration and micro-batch "
        f"({100 * added / compute:.2f}% of the stage's estimated {compute:.1f} ms forward+backward{gemm})",
        f"  noise                        {plan.variance:.4g}"
        + (f" of budget {res.variance_budget:.4g}" if res.variance_budget is not None else " (no budget)"),
        f"  solve time                   {plan.solve_seconds:.3f} s ({plan.num_variables} variables)",
    ]
    return lines


def _priced(site, name: str) -> tuple[int, float]:
    """(stored bytes, added ms) of `site` (a `SiteProfile`) under choice `name`."""
    if name == "keep":
        return site.nbytes, 0.0
    if name == "recompute":
        return 0, site.forward_ms or 0.0
    opt = next(c for c in site.codecs if c.name == name)
    return opt.nbytes, opt.cost_ms


def _report(shape, name, budget, zero_stage, dp, device, variance, results, hf_config=None) -> dict:
    stages = []
    runs: list[dict] = []
    for res in results:
        entry = {"stage": res.stage, "layers": list(res.layers), "inflight": res.inflight,
                 "static_bytes": res.static_bytes, "outer_bytes": res.outer_bytes,
                 "variance_budget": res.variance_budget, "output_loss": res.output_loss,
                 "output_bytes": dict(res.output_bytes), "output_gemm_ms": res.output_gemm_ms}
        if res.plan is None:
            entry["min_budget_bytes"] = res.min_budget_bytes
        else:
            p = res.plan
            entry.update(choice=p.choice[0], whole_blocks=p.full[0] if p.full else {},
                         after_blocks={k: v for ch in p.choice[1:] for k, v in ch.items()},
                         activation_bytes=p.activation_bytes,
                         peak_bytes=p.peak_bytes, overhead_ms=p.overhead_ms + res.output_gemm_ms,
                         variance=p.variance,
                         solve_seconds=p.solve_seconds,
                         total_bytes=p.activation_bytes + res.static_bytes)
            for run in p.to_dict(first_layer=res.layers[0])["blocks"]:
                if runs and runs[-1]["choice"] == run["choice"]:
                    runs[-1]["layers"][1] = run["layers"][1]
                else:
                    runs.append(run)
        stages.append(entry)
    feasible = all(r.plan is not None for r in results)
    return {
        **_named(name, hf_config), "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "budget_bytes": budget, "zero_stage": zero_stage, "dp": dp, "device": device.describe(),
        "variance_budget": variance, "feasible": feasible, "stages": stages,
        "plan": {"version": 1, "blocks": runs} if feasible else None,
    }


def run(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Print the plan; 0 when every stage fits, 2 (with the smallest budget) when not."""
    changes = dict(micro_batch_size=args.micro_batch_size, tp=args.tp, pp=args.pp,
                   sequence_parallel=args.sequence_parallel, attention=args.attention,
                   ep=getattr(args, "ep", 1))
    if getattr(args, "moe_capacity_factor", None) is not None:
        changes["moe_capacity_factor"] = args.moe_capacity_factor
    if args.seq_length is not None:
        changes["seq_length"] = args.seq_length
    if args.dropout is not None:
        changes["dropout"] = args.dropout
    parser = getattr(args, "plan_parser", parser)
    output_loss = getattr(args, "output_loss", "auto")
    hf_config = getattr(args, "hf_config", None)
    name, source = args.model, f"model {args.model}" if hf_config is None else f"--hf-config {hf_config}"
    try:
        if hf_config is None:
            shape = model_shape(args.model, **changes)
        else:
            config = load_hf_config(hf_config)
            shape = shape_from_hf_config(config, **changes)
            name = config["model_type"]
    except HFConfigError as err:  # the config itself: one line naming the key
        fail(parser, f"argument --hf-config {hf_config}: {err}")
    except ValueError as err:  # e.g. a --tp that does not divide the heads: name the flag
        text = str(err)
        field = next((f for f in changes if text.startswith(f)), None)
        where = f"argument --{field.replace('_', '-')}: " if field else ""
        parser.error(f"{where}{text} ({source})")
    if args.dp % shape.ep:
        parser.error(f"argument --dp: {args.dp} is not a multiple of --ep {shape.ep}: megatron-core takes "
                     f"the expert-parallel ranks from the data-parallel ones (ranks = tp x pp x dp)")
    device = DEVICES[args.device]()
    variance = args.variance_budget
    print(header(shape, name, args.budget, args.zero_stage, args.dp, device, variance, output_loss,
                 hf_config))
    results = plan_stages(shape, args.budget, zero_stage=args.zero_stage, dp=args.dp,
                          device=device, variance_budget=variance, output_loss=output_loss)
    if args.budget > device.memory_bytes:
        print(f"warning: --budget {args.budget / 1e9:.3f} GB is more than the {device.memory_bytes / 1e9:g} GB "
              f"of the {device.name} device model (--device {args.device}); a plan made for it will not fit "
              f"that device", file=sys.stderr)
    failed = [r for r in results if r.plan is None]
    for res in results:
        print()
        if res.plan is not None:
            print("\n".join(stage_table(shape, res, device, args.budget)))
        else:
            print(f"stage {res.stage} of {shape.pp}: no plan fits --budget {args.budget} bytes "
                  f"({args.budget / 1e9:.3f} GB, {_gib(args.budget)}); the smallest that works is "
                  f"{res.min_budget_bytes} bytes ({res.min_budget_bytes / 1e9:.3f} GB, "
                  f"{_gib(res.min_budget_bytes)}): static {_gib(res.static_bytes)}, least activations "
                  f"{_gib(res.min_budget_bytes - res.static_bytes)} (of which outside the blocks "
                  f"{_gib(res.outer_bytes)}: {outside_blocks(res)})")
    print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_report(shape, name, args.budget, args.zero_stage, args.dp, device,
                              variance, results, hf_config), f, indent=2)
    if failed:
        need = max(r.min_budget_bytes for r in failed)  # the stages that fit need less
        print(f"infeasible: --budget {args.budget / 1e9:.3f} GB is too small; the smallest budget "
              f"that works for every stage is {need} bytes = {need / 1e9:.3f} GB = {_gib(need)} "
              f"(try --budget {_gb_up(need)})")
        if need > device.memory_bytes:
            print(f"that is more than the {device.memory_bytes / 1e9:g} GB device: raise --tp, "
                  f"--pp or --zero-stage (with --dp), or lower --micro-batch-size / --seq-length")
        return 2
    worst = max(results, key=lambda r: r.plan.overhead_ms + r.output_gemm_ms)
    peak = max(r.plan.activation_bytes + r.static_bytes for r in results)
    print(f"all stages: largest total {_gib(peak)} of {_gib(args.budget)}; slowest stage {worst.stage} "
          f"adds {worst.plan.overhead_ms + worst.output_gemm_ms:.3f} ms per micro-batch; solve "
          f"{sum(r.plan.solve_seconds for r in results):.3f} s")
    return 0
