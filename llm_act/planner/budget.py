"""Budget search over the analytic profile: what `llm-act plan` solves, apart from its
flags and tables. Every pipeline stage of a model shape is planned under one device budget
(static memory and the activations outside the blocks come off first), and a stage that
cannot fit gets the smallest budget that would. The noise budget defaults to that of the
"compress" plan (each site at its default codec, Adacc sec. 3.2), so the planner never
picks a codec noisier overall than those defaults; the runtime and the bench reuse
`min_budget` and `reference_variance` to state a refusal or set a comparable noise budget.

The last stage's output layer and loss are counted under `output_loss`: "stock" (the fp32
logits), "chunked" (the chunked linear + cross-entropy, never the logits), or "auto": the
choice `llm_act.output.choice.choose` makes at run time -- chunked when only it fits,
or when its plan plus its extra logits GEMM (estimated at the device model's matmul rate,
2 x tokens x vocab/tp x hidden flops) adds less time than the stock plan. Under sequence
parallelism "auto" stays stock (the chunked loss does not support it yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from llm_act.output.choice import OutputSizes, choose, estimate_gemm_ms
from llm_act.planner.analytic import stage_blocks, stage_layers
from llm_act.planner.milp import InfeasibleBudget, InfeasibleVariance, evaluate_plan, solve_plan
from llm_act.planner.model_shape import DeviceModel, ModelShape
from llm_act.planner.static_memory import input_bytes, loss_bytes, outer_bytes, static_bytes
from llm_act.sites import DEFAULT_CODECS, QKV_SITES

#: the act_input codec of the reference plan where few-bit does not apply (gated units)
_GLU_ACT_CODEC = "outlier_int4"


@dataclass
class StageResult:
    """One pipeline stage: its plan, or (`plan` None) the smallest budget that fits it."""

    stage: int
    layers: tuple[int, int]
    inflight: int
    static_bytes: int
    outer_bytes: int
    variance_budget: Optional[float]
    plan: object = None
    min_budget_bytes: Optional[int] = None
    blocks: list = field(default_factory=list)
    output_loss: Optional[str] = None
    """the output loss counted in `outer_bytes` ("stock" or "chunked"; None: no output layer here)"""
    output_bytes: dict = field(default_factory=dict)
    """{"stock": bytes, "chunked": bytes} of the output loss (output layer input, loss state)
    under each choice, all micro-batches in flight; empty: no output layer here"""
    output_gemm_ms: float = 0.0
    """the extra logits GEMM of the chunked loss per micro-batch (0 under stock)"""


def reference_choice(block) -> dict[str, str]:
    """The "compress" plan for `block`: every site at its default codec (the few-bit one
    replaced where the block does not offer it, i.e. under a gated linear unit)."""
    out = {}
    for site in block.sites:
        name = DEFAULT_CODECS[site.name]
        if name not in {c.name for c in site.codecs}:
            name = _GLU_ACT_CODEC
        out[site.name] = name
    return out


def reference_variance(blocks) -> float:
    """The noise of the "compress" plan over `blocks`: the default noise budget."""
    return evaluate_plan(blocks, [reference_choice(b) for b in blocks]).variance


def min_budget(blocks, static: int, variance_budget: Optional[float], resolution: int = 2**20,
               **peak: int) -> int:
    """The smallest device budget with a plan, static included: exact without a noise
    budget; with one, within `resolution` bytes above the edge (bisection on feasibility).
    `peak`: `solve_plan`'s `loss_bytes` and `input_bytes`, when the end of forward counts."""
    try:
        solve_plan(blocks, 0, static_bytes=static, **peak)
        lo = static
    except InfeasibleBudget as err:
        lo = err.min_budget_bytes
    if variance_budget is None:
        return lo
    keep = evaluate_plan(blocks, [{} for _ in blocks], **peak)
    hi = static + keep.activation_bytes  # keeping everything adds no noise: always within the budget

    def fits(budget: int) -> bool:
        try:
            solve_plan(blocks, budget, static_bytes=static, variance_budget=variance_budget, **peak)
            return True
        except (InfeasibleBudget, InfeasibleVariance):
            return False

    if fits(lo):
        return lo
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


OUTPUT_LOSS_CHOICES = ("stock", "chunked", "auto")


def _output_sizes(shape: ModelShape) -> OutputSizes:
    return OutputSizes(tokens=shape.seq_length * shape.micro_batch_size, hidden=shape.hidden_size,
                       vocab_local=shape.padded_vocab_size // shape.tp, elem_bytes=shape.elem_bytes,
                       sequence_shards=shape.tp if shape.sequence_parallel else 1)


def output_loss_choice(shape: ModelShape, stage: int, blocks, budget: int, static: int,
                       variance_budget: Optional[float], device: DeviceModel, output_loss: str) -> str:
    """"stock" or "chunked" for `stage` under `output_loss` (see the module docstring)."""
    if output_loss not in OUTPUT_LOSS_CHOICES:
        raise ValueError(f"output_loss: expected one of {', '.join(OUTPUT_LOSS_CHOICES)}, got {output_loss!r}")
    if output_loss != "auto":
        return output_loss
    if stage != shape.pp - 1 or shape.sequence_parallel:
        return "stock"
    stock = static + sum(outer_bytes(shape, stage, "stock").values())

    def trial(_static_bytes: int, choice: str):  # the loss is priced as the end of forward
        try:
            return solve_plan(blocks, budget, static_bytes=static, variance_budget=variance_budget,
                              **peak_terms(shape, stage, device, choice))
        except (InfeasibleBudget, InfeasibleVariance):
            return None

    sizes = _output_sizes(shape)
    return choose(trial, stock, "stock", sizes, shape.pp - stage, estimate_gemm_ms(sizes, device)).choice


def peak_terms(shape: ModelShape, stage: int, device: DeviceModel, output_loss: str) -> dict[str, int]:
    """`solve_plan`'s `loss_bytes` and `input_bytes` for `stage` of `shape`: the end of
    forward, with the output loss `output_loss` on the last stage (one memory model: the
    peak is the larger of it and a block's backward)."""
    return {"loss_bytes": loss_bytes(shape, stage, device, output_loss=output_loss),
            "input_bytes": input_bytes(shape)}


def plan_stages(shape: ModelShape, budget: int, *, zero_stage: int = 0, dp: int = 1,
                device: Optional[DeviceModel] = None,
                variance_budget: Union[str, float, None] = "compress",
                output_loss: str = "stock") -> list[StageResult]:
    """Solve every pipeline stage of `shape` under a device `budget` (bytes). A stage that
    cannot fit has `plan` None and `min_budget_bytes` set. `output_loss`: "stock",
    "chunked" or "auto" (see the module docstring). The peak is priced as
    `tests/planner/test_peak_vs_measured.py` checks it: the blocks' gradients in flight per
    backward stage, the end of forward (`peak_terms`) as the floor under it."""
    device = device or DeviceModel()
    results = []
    for k in range(shape.pp):
        # "recompute" at q, k and v only with the whole block, as the layers run them
        blocks = [b.recomputing_only({s.name for s in b.sites} - set(QKV_SITES))
                  for b in stage_blocks(shape, k, device, gradients=True)]
        static = static_bytes(shape, zero_stage, dp, stage=k)
        if variance_budget == "compress":
            vb = reference_variance(blocks)
        elif variance_budget in (None, "none"):
            vb = None
        else:
            vb = float(variance_budget)
        choice = output_loss_choice(shape, k, blocks, budget, static, vb, device, output_loss)
        plan, least = None, None
        try:
            plan = solve_plan(blocks, budget, static_bytes=static, variance_budget=vb,
                              **peak_terms(shape, k, device, choice))
        except (InfeasibleBudget, InfeasibleVariance):
            # the smallest budget, over the output losses "auto" may choose: the stock loss's
            # larger end of forward can hide under a block's backward
            tried = ([choice] if output_loss != "auto" or k != shape.pp - 1 or shape.sequence_parallel
                     else ["chunked", "stock"])
            need = {c: min_budget(blocks, static, vb, **peak_terms(shape, k, device, c)) for c in tried}
            choice = min(tried, key=lambda c: need[c])
            least = need[choice]
        res = StageResult(k, stage_layers(shape, k), shape.pp - k, static,
                          sum(outer_bytes(shape, k, choice).values()), vb, plan=plan,
                          min_budget_bytes=least, blocks=blocks)
        if k == shape.pp - 1:
            res.output_loss = choice
            res.output_bytes = {name: sum(v for key, v in outer_bytes(shape, k, name).items()
                                          if key.startswith(("output_layer.", "loss.")))
                                for name in ("stock", "chunked")
                                if name == "stock" or not shape.sequence_parallel}
            if choice == "chunked":
                res.output_gemm_ms = estimate_gemm_ms(_output_sizes(shape), device)
        results.append(res)
    return results
