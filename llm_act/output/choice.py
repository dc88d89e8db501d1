"""Stock or chunked output loss: the byte counts of each choice and the rule that picks one.

`OutputSizes` gives what each choice stores for backward per micro-batch (the op's own
`stored_bytes` and `stock_logits_bytes`); `choose` picks, given a solver `trial(static,
output_loss)` that returns the best plan of the blocks (or None when none fits) with `static`
bytes besides them under that output loss (a solver that prices the loss's own events, as
`llm-act plan` does, reads which; the runtime's needs only the bytes):

- the stock loss's plan first; where it adds no more time than the chunked loss's extra
  logits GEMM, stock (the chunked plan cannot be cheaper);
- otherwise, or where it does not fit, the chunked loss's plan: chunked when only it fits, or
  when its added time plus the GEMM is lower; where neither fits, chunked (the smaller
  memory), for the caller's "tightest plan" or refusal path.

The runtime (`llm_act.runtime.output_choice`, plan "auto") and `llm-act plan`
(`llm_act.planner.budget`) both decide with it. Needs only torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS, stock_logits_bytes, stored_bytes

STOCK = "stock"
CHUNKED = "chunked"


@dataclass(frozen=True)
class OutputSizes:
    """The output layer of one micro-batch on this rank."""

    tokens: int
    """tokens the loss sees (s x b, the whole sequence)"""
    hidden: int
    vocab_local: int
    """this rank's vocab shard (vocab / tp)"""
    elem_bytes: int
    """bytes per element of the hidden states (the model dtype)"""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    sequence_shards: int = 1
    """ranks the sequence is split over before the output layer (tp under sequence
    parallelism): each saves its shard of the hidden states, the loss sees every token"""

    @property
    def stock_bytes(self) -> int:
        """What stock's output linear (its input) and `vocab_parallel_cross_entropy` (fp32
        softmax, target mask, masked target) save for backward."""
        return (self.tokens // self.sequence_shards * self.hidden * self.elem_bytes
                + stock_logits_bytes(self.tokens, self.vocab_local))

    @property
    def chunked_bytes(self) -> int:
        """What the chunked op saves: the hidden states and one fp32 log-sum-exp per token."""
        return stored_bytes(self.tokens, self.hidden, self.elem_bytes, self.sequence_shards)

    @property
    def saving(self) -> int:
        return self.stock_bytes - self.chunked_bytes

    @property
    def gemm_flops(self) -> int:
        """Flops of the one logits GEMM the chunked backward adds."""
        return 2 * self.tokens * self.vocab_local * self.hidden


@dataclass(frozen=True)
class OutputChoice:
    """One decision: `choice` and the static bytes the MILP is then given."""

    choice: str
    static_bytes: int
    stock_bytes: int
    """the stock loss's bytes, all micro-batches in flight"""
    chunked_bytes: int
    stock_ms: Optional[float]
    """added time of the best plan with the stock loss (None: none fits)"""
    chunked_ms: Optional[float]
    """... with the chunked loss, the extra GEMM included (None: none fits, or not tried)"""
    gemm_ms: float
    why: str = ""

    def describe(self) -> str:
        def ms(v: Optional[float]) -> str:
            return "no plan fits" if v is None else f"+{v:.3f} ms"

        chunked = (f"+{self.gemm_ms:.3f} ms at least (its extra logits GEMM), not solved" if self.chunked_ms is None
                   and self.stock_ms is not None and self.stock_ms <= self.gemm_ms
                   else f"{ms(self.chunked_ms)} incl. {self.gemm_ms:.3f} ms for its extra logits GEMM")
        return (f"output loss {self.choice}: {self.why} (stock: {self.stock_bytes / 2**20:.3f} MiB, "
                f"{ms(self.stock_ms)}; chunked: {self.chunked_bytes / 2**20:.3f} MiB, {chunked})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_gemm_ms(sizes: OutputSizes, device: Any) -> float:
    """The extra logits GEMM, estimated: 2 x tokens x vocab_local x hidden flops at the
    matmul rate of `device` (a `llm_act.planner.model_shape.DeviceModel`: its `gemm_ms`)."""
    return float(device.gemm_ms(sizes.gemm_flops))


def choose(trial: Callable[[int, str], Any], static_now: int, mode_now: str, sizes: OutputSizes,
           inflight: int, gemm_ms: float) -> OutputChoice:
    """Stock or chunked (see the module docstring). `static_now`: the static bytes measured
    under `mode_now`, the output loss in force; `trial(static, output_loss)` a solved plan or
    None."""
    stock_bytes, chunked_bytes = inflight * sizes.stock_bytes, inflight * sizes.chunked_bytes
    base = static_now - (stock_bytes if mode_now == STOCK else chunked_bytes)
    static_stock, static_chunked = base + stock_bytes, base + chunked_bytes

    def out(choice: str, why: str, stock_ms=None, chunked_ms=None) -> OutputChoice:
        return OutputChoice(choice, static_stock if choice == STOCK else static_chunked, stock_bytes,
                            chunked_bytes, stock_ms, chunked_ms, float(gemm_ms), why)

    stock = trial(static_stock, STOCK)
    if stock is None:
        chunked = trial(static_chunked, CHUNKED)
        return out(CHUNKED, "only it fits the budget" if chunked is not None else
                   "no plan fits the budget, and it needs the least memory",
                   None, None if chunked is None else chunked.overhead_ms + gemm_ms)
    if stock.overhead_ms <= gemm_ms or sizes.saving <= 0:
        return out(STOCK, "the stock plan adds no more time than the chunked loss's extra GEMM",
                   stock.overhead_ms)
    chunked = trial(static_chunked, CHUNKED)
    chunked_ms = None if chunked is None else chunked.overhead_ms + gemm_ms
    if chunked_ms is not None and chunked_ms < stock.overhead_ms:
        return out(CHUNKED, "its plan adds less time, its extra GEMM included", stock.overhead_ms, chunked_ms)
    return out(STOCK, "its plan adds less time than the chunked loss's plan and extra GEMM",
               stock.overhead_ms, chunked_ms)
