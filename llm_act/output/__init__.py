"""The output layer and its loss without the [tokens, vocab] logits: `chunked_linear_cross_entropy`
(and the byte counts `stored_bytes` / `stock_logits_bytes` the planner compares; `choice`: the
rule that picks stock or chunked). Needs only torch."""
from __future__ import annotations

from llm_act.output.chunked_loss import (
    DEFAULT_CHUNK_TOKENS,
    ChunkedLinearCrossEntropy,
    chunked_linear_cross_entropy,
    stock_logits_bytes,
    stored_bytes,
)

__all__ = ["ChunkedLinearCrossEntropy", "DEFAULT_CHUNK_TOKENS", "chunked_linear_cross_entropy",
           "stock_logits_bytes", "stored_bytes"]
