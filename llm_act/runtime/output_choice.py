"""Stock or chunked output loss: the planner's choice under plan "auto" (issue 27, item 2).

At a large vocabulary megatron's output layer and loss hold the fp32 [tokens, vocab/tp]
logits for backward (`llm_act.output.stock_logits_bytes`); the chunked linear +
cross-entropy (`llm_act.output.chunked_linear_cross_entropy`) holds one fp32 log-sum-exp per
token instead, and pays for it with one more logits GEMM in backward. With
`ActConfig.output_loss` "auto" and plan "auto" the adapter (`llm_act.runtime.adapt`) makes
that choice at every tracking point, on its source rank, together with the plan
(`llm_act.output.choice.choose`, the rule `llm-act plan` uses too):

- the stored bytes of each choice, per micro-batch, times the micro-batches in flight on the
  last pipeline stage, come on top of the static memory the MILP is given (the measured
  `profile.other_bytes` holds the choice in force; the other one is derived from it by the
  difference of the two byte counts, `OutputSizes.saving`);
- the best plan with the stock loss (`trial(static_stock, "stock")`) and, unless that one already adds
  no more time than the extra GEMM, the best plan with the chunked loss;
- chunked wins when only it fits, or when its plan's added time plus the extra GEMM is
  lower than the stock plan's added time. Where neither fits, chunked (the smaller static
  memory) goes on to the adapter's usual "tightest plan" / refusal path.

The extra GEMM's time is **measured** once per run at the run's shapes: one chunk's logits
GEMM ([chunk_tokens, h] @ [h, vocab_local], the real output weight, its dtype and device;
the median of 3 after a warm-up, CUDA events on a GPU, wall clock on CPU, like the profile's
other times), times the number of chunks. Where the weight is not whole on this rank (a
ZeRO-3 partition) it is **estimated** instead: 2 x tokens x vocab_local x hidden flops at the
`DeviceModel`'s matmul rate (`estimate_gemm_ms`, also what `llm-act plan` uses).

The decision travels in the `solving.Decision` the adapter broadcasts from its source rank
(`Decision.output_loss`), so every TP/DP rank of the stage switches alike; only the last
stage holds an output layer, the others decide nothing (None). Transients are not counted:
the chunked op's (one chunk's logits, an fp32 weight-gradient accumulator under bf16) are
smaller than stock's backward transient (the [tokens, vocab/tp] logits gradient).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from llm_act.output.choice import CHUNKED, STOCK, OutputChoice, OutputSizes, choose, estimate_gemm_ms
from llm_act.measurement.probing import time_ms
from llm_act.planner.model_shape import DeviceModel
from llm_act.planner import InfeasibleBudget, InfeasibleVariance, milp, solve_plan

__all__ = ["CHUNKED", "STOCK", "OutputChoice", "OutputSizes", "OutputSwitch", "choose", "decide",
           "estimate_gemm_ms", "measure_gemm_ms", "stock_static", "switch_of", "trial_solver"]


class OutputSwitch(Protocol):
    """What the Controller holds as `controller.output` (`llm_act.patches.megatron.output.OutputLossSwitch`)."""

    chunk_tokens: int
    gemm_ms: Optional[float]

    @property
    def mode(self) -> str: ...

    def set(self, mode: str) -> None: ...

    def sizes(self) -> Optional[OutputSizes]: ...

    def weight(self) -> torch.Tensor: ...


def measure_gemm_ms(weight: torch.Tensor, sizes: OutputSizes, repeats: int = 3) -> float:
    """The extra logits GEMM, measured: one chunk's [rows, h] @ [h, vocab_local] with
    `weight` (its dtype and device), median of `repeats` after a warm-up, scaled to every
    chunk of the micro-batch. A weight that is not whole here ([vocab_local, hidden]; a
    ZeRO-3 partition) falls back to `estimate_gemm_ms` on the device's model."""
    if tuple(weight.shape) != (sizes.vocab_local, sizes.hidden) or not weight.is_floating_point():
        return estimate_gemm_ms(sizes, DeviceModel() if weight.is_cuda else DeviceModel.cpu())
    rows = max(1, min(sizes.chunk_tokens, sizes.tokens))
    chunks = -(-sizes.tokens // rows)
    with torch.no_grad():
        x = torch.zeros(rows, sizes.hidden, dtype=weight.dtype, device=weight.device)
        w = weight.detach()
        one = time_ms(lambda: x @ w.t(), weight.device, repeats=repeats)
    return one * chunks


def trial_solver(blocks: list, budget: int, noise: Optional[float]) -> Callable[[int, str], Any]:
    """`trial(static, output_loss)`: the plan the adapter would choose under `budget` with `static` bytes
    besides the blocks (as `Adapter._solve` solves: at the measured profiles' time resolution,
    and the least noisy plan that fits when the noise budget cannot be met), or None when no
    plan fits. Warns about nothing."""
    # the adapter's resolution of measured times, where the planner has one
    kw = {"time_resolution": milp.TIME_RESOLUTION} if hasattr(milp, "TIME_RESOLUTION") else {}

    def trial(static: int, output_loss: str) -> Any:  # the loss counts in `static` alone here
        try:
            try:
                return solve_plan(blocks, budget, static_bytes=static, variance_budget=noise, **kw)
            except InfeasibleVariance:
                return solve_plan(blocks, budget, static_bytes=static, objective="variance", **kw)
        except InfeasibleBudget:
            return None

    return trial


def switch_of(controller: Any) -> Optional[OutputSwitch]:
    """The controller's output switch when the planner chooses the output loss (output_loss
    "auto" under plan "auto", a GPTModel whose output layer can take the chunked loss, and
    a forward seen), else None."""
    switch = getattr(controller, "output", None)
    if switch is None or controller.config.output_loss_mode() != "auto" or switch.sizes() is None:
        return None
    return switch


def stock_static(controller: Any, static_now: int, inflight: int) -> int:
    """`static_now` with the stock loss in place of the one in force (the default budget on
    CPU is the "compress" plan with the model's own output layer and loss)."""
    switch = switch_of(controller)
    if switch is None or switch.mode == STOCK:
        return static_now
    return static_now + inflight * switch.sizes().saving


def decide(controller: Any, blocks: list, static_now: int, budget: int, noise: Optional[float],
           inflight: int) -> Optional[OutputChoice]:
    """The source rank's choice at a tracking point, or None where it does not choose."""
    switch = switch_of(controller)
    if switch is None:
        return None
    sizes = switch.sizes()
    if switch.gemm_ms is None:
        switch.gemm_ms = measure_gemm_ms(switch.weight(), sizes)
    return choose(trial_solver(blocks, budget, noise), static_now, switch.mode, sizes, inflight, switch.gemm_ms)
