"""A Hugging Face causal LM's output layer and loss, stock or chunked (`ActConfig.output_loss`),
as on megatron-core (`patches.megatron.output`): with labels in the call, the chunked linear
+ cross-entropy (`llm_act.output.chunked_linear_cross_entropy`) never holds the logits.

How, without transformers' code: for a training call with `labels`, a forward pre-hook on the
model takes the labels out of the call (so the model computes no loss), and the output layer
(`get_output_embeddings()`, the tied embedding weight included) computes the loss instead of
the logits, inside its own forward: ZeRO-3 gathers its weight there and again for its
backward, as for the stock GEMM. A forward hook then puts that loss in the output's `loss`,
with `logits` None (as fused-loss kernels do). The loss is transformers' `ForCausalLMLoss`:
labels shifted left, `ignore_index` (-100) tokens left out, the mean over the others, or the
sum over `num_items_in_batch`; `shift_labels` is taken as given.

Stock stays for every other call (no labels, evaluation, generation, `logits_to_keep`), and
for a model whose loss is not `ForCausalLMLoss` (a `loss_type` of its own): "chunked" is
refused there in one line, "auto" stays stock.

`HFOutputSwitch` is what `generic.apply` hands the Controller as `controller.output`
(`llm_act.runtime.output_choice.OutputSwitch`): under output_loss "auto" the planner switches
it between iterations and reads the output layer's sizes from the last training forward.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from llm_act.output.choice import CHUNKED, STOCK, OutputSizes
from llm_act.output.chunked_loss import chunked_linear_cross_entropy

IGNORE_INDEX = -100


def refusal(hf: Any) -> Optional[str]:
    """Why the chunked loss cannot stand for `hf`'s own loss, or None when it can."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return f"{type(hf).__name__} has no bias-free linear output layer (get_output_embeddings())"
    if getattr(hf, "loss_function", None) is not ForCausalLMLoss:
        return f"{type(hf).__name__}'s loss is not transformers' ForCausalLMLoss (its loss_type)"
    return None


class HFOutputSwitch:
    """One Hugging Face causal LM's output layer and loss, "stock" or "chunked" (`set`)."""

    def __init__(self, hf: Any, chunk_tokens: int):
        self.hf, self.head = hf, hf.get_output_embeddings()
        self.chunk_tokens = int(chunk_tokens)
        self.gemm_ms: Optional[float] = None
        """the measured time of the extra logits GEMM (`output_choice.measure_gemm_ms`), once per run"""
        self._mode = STOCK
        self._call: Optional[dict] = None  # the labels of the training call in flight
        self.input_shape: Optional[tuple[int, ...]] = None
        self.input_dtype: Optional[torch.dtype] = None
        hf.register_forward_pre_hook(self._take_labels, with_kwargs=True)
        hf.register_forward_hook(self._give_loss, always_call=True)
        self.head.register_forward_pre_hook(self._note)

    @property
    def mode(self) -> str:
        return self._mode

    def set(self, mode: str) -> None:
        if mode not in (STOCK, CHUNKED):
            raise ValueError(f"output loss: expected {STOCK!r} or {CHUNKED!r}, got {mode!r}")
        self._mode = mode

    def weight(self) -> torch.Tensor:
        """The output weight [vocab, h] (the embedding's when they are tied)."""
        return self.head.weight

    def sizes(self) -> Optional[OutputSizes]:
        """The output layer's sizes at the last training forward (None before one)."""
        if self.input_shape is None:
            return None
        b, s, h = self.input_shape
        return OutputSizes(tokens=b * s, hidden=h, vocab_local=int(self.head.out_features),
                           elem_bytes=torch.empty((), dtype=self.input_dtype).element_size(),
                           chunk_tokens=self.chunk_tokens)

    # ---- hooks -----------------------------------------------------------------------------
    def _note(self, module: Any, args: tuple) -> None:
        x = args[0] if args else None
        if module.training and torch.is_grad_enabled() and torch.is_tensor(x) and x.dim() == 3:
            self.input_shape, self.input_dtype = tuple(int(n) for n in x.shape), x.dtype

    def _take_labels(self, module: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        self._call = None
        labels = kwargs.get("labels")
        keep = kwargs.get("logits_to_keep")
        if (self._mode != CHUNKED or labels is None or not (module.training and torch.is_grad_enabled())
                or not (keep is None or (isinstance(keep, int) and keep == 0))):
            return None
        self._call = {"labels": labels, "num_items_in_batch": kwargs.get("num_items_in_batch"),
                      "ignore_index": kwargs.get("ignore_index", IGNORE_INDEX),
                      "shift_labels": kwargs.get("shift_labels")}
        self.head.forward = self._loss  # this call only: `_give_loss` puts the layer back
        return args, {k: v for k, v in kwargs.items() if k not in ("labels", "shift_labels")}

    def _loss(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer's forward for the call in flight: its loss (transformers'
        `ForCausalLMLoss` of the logits it would have made)."""
        call = self._call
        b, s, h = hidden.shape
        target = call["shift_labels"]
        if target is None:
            labels = call["labels"]
            target = torch.nn.functional.pad(labels, (0, 1), value=call["ignore_index"])[..., 1:]
        target = target.reshape(1, b * s).to(hidden.device)
        kept = target != call["ignore_index"]
        per_token = chunked_linear_cross_entropy(  # tokens as one sequence: [b*s, 1, h], no copy
            hidden.reshape(b * s, 1, h), self.head.weight, torch.where(kept, target, 0).long(),
            chunk_tokens=self.chunk_tokens)
        total = (per_token * kept).sum()
        count = call["num_items_in_batch"]
        if count is None:
            return total / kept.sum()
        return total / (count.to(total.device) if torch.is_tensor(count) else count)

    def _give_loss(self, module: Any, args: tuple, out: Any) -> Any:
        call, self._call = self._call, None
        if call is None:
            return None
        self.head.__dict__.pop("forward", None)
        if out is not None and hasattr(out, "logits"):
            out.loss, out.logits = out.logits, None
        return out


__all__ = ["HFOutputSwitch", "IGNORE_INDEX", "refusal"]
