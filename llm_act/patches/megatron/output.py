"""`use_chunked_loss(model, chunk_tokens)`: a megatron-core GPTModel whose loss never holds
the [tokens, vocab] logits (`llm_act.output.chunked_linear_cross_entropy`).

Two instance attributes on that one model, nothing global and no megatron source changed:
`model._postprocess`, which with labels calls the output layer with them and returns its
loss (stock `_postprocess` otherwise: labels None, inference, multi-token prediction, the
config logger), and `model.output_layer.forward`, which with labels runs the chunked op on
its weight (or the tied embedding weight handed to it) instead of the logits GEMM. The
output layer is still called as a module, so its hooks run (megatron DDP's parameter
all-gather pre-hook among them). The loss is stock's: [b, s] fp32, per token.

Deferred embedding wgrad and an output bias are refused: stock's output layer communicates
differently there. Under sequence parallelism the op gathers the sequence itself, as stock's
linear does. `use_stock_loss(model)` removes both attributes
again (the model is stock's once more).

`OutputLossSwitch` is what `apply()` hands the Controller when `ActConfig.output_loss` asks
for the chunked loss or lets the planner choose (`llm_act.runtime.output_choice`): it turns
the op on and off between iterations and reports the output layer's sizes. `check_output`
says, before `apply()` changes anything, whether the model can take it and why not.
"""
from __future__ import annotations

import inspect
import types
from typing import Any, Optional

import torch

from llm_act._imports import require
from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_linear_cross_entropy
from llm_act.output.choice import CHUNKED, STOCK, OutputSizes

_MARK = "_llm_act_chunked_loss_tokens"


def _gpt(model: Any) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (`.module` chains)."""
    seen = model
    while not hasattr(seen, "output_layer") and isinstance(getattr(seen, "module", None),
                                                          torch.nn.Module):
        seen = seen.module
    if not (hasattr(seen, "_postprocess") and hasattr(seen, "post_process")):
        raise TypeError(f"model: expected a megatron-core GPTModel (or one wrapped), got {type(model).__name__}")
    return seen


def _check_output_layer(layer, config) -> None:
    if config.defer_embedding_wgrad_compute:
        raise NotImplementedError("use_chunked_loss: defer_embedding_wgrad_compute is not supported")
    if layer.bias is not None or layer.disable_grad_reduce or layer.explicit_expert_comm:
        raise NotImplementedError("use_chunked_loss: an output layer with a bias, disable_grad_reduce "
                                  "or explicit expert communication is not supported")


def _output_forward(layer, input_, weight=None, runtime_gather_output=None, labels=None):
    """ColumnParallelLinear.forward, or with `labels` (loss, None) from the chunked op."""
    if labels is None:
        return type(layer).forward(layer, input_, weight, runtime_gather_output)
    if weight is None:
        weight = layer.weight
    if weight is None or tuple(weight.shape) != (layer.output_size_per_partition, layer.input_size):
        raise RuntimeError(f"output layer: expected a weight of shape "
                           f"{(layer.output_size_per_partition, layer.input_size)}, got "
                           f"{None if weight is None else tuple(weight.shape)}")
    group = layer.tp_group if layer.tp_group.size() > 1 else None
    loss = chunked_linear_cross_entropy(input_, weight, labels, chunk_tokens=getattr(layer, _MARK),
                                        tp_group=group, sequence_parallel=bool(layer.sequence_parallel))
    return loss, None


def _chunked_applies(model, a: dict) -> bool:
    """Whether the call `a` (stock `_postprocess`'s arguments) ends in the labelled loss that
    the op computes; everything else stays stock."""
    from megatron.core.config_logger import has_config_logger_enabled

    if a.get("labels") is None or not model.post_process:
        return False
    if a.get("mtp_in_postprocess") or model.config.mtp_num_layers is not None:
        return False
    if a.get("inference_context") is not None and not model.training:
        return False
    if has_config_logger_enabled(model.config):
        return False
    gather = a.get("runtime_gather_output")
    gather = model.output_layer.gather_output if gather is None else gather
    return not (gather and model.output_layer.tp_group.size() > 1)  # stock loss of gathered logits


def _postprocess(model, *args, **kwargs):
    a = kwargs  # megatron passes them by name
    if args:
        a = inspect.signature(type(model)._postprocess).bind(model, *args, **kwargs).arguments
    if not _chunked_applies(model, a):
        return type(model)._postprocess(model, *args, **kwargs)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    loss, _ = model.output_layer(a["hidden_states"], weight=weight, labels=a["labels"])
    return loss


def use_chunked_loss(model: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Any:
    """Route `model`'s labelled loss through `chunked_linear_cross_entropy`, `chunk_tokens`
    tokens at a time; returns `model`. Calling it again changes `chunk_tokens`. A pipeline
    stage without the output layer is returned unchanged."""
    require("megatron.core", "llm_act.patches.megatron.output")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: expected an int >= 1, got {chunk_tokens!r}")
    gpt = _gpt(model)
    if not gpt.post_process:
        return model
    if not hasattr(gpt, _MARK) and ("_postprocess" in vars(gpt) or "forward" in vars(gpt.output_layer)):
        raise RuntimeError("use_chunked_loss: model._postprocess or model.output_layer.forward is "
                           "already replaced on this instance by someone else")
    _check_output_layer(gpt.output_layer, gpt.config)
    setattr(gpt.output_layer, _MARK, chunk_tokens)
    setattr(gpt, _MARK, chunk_tokens)
    gpt.output_layer.forward = types.MethodType(_output_forward, gpt.output_layer)
    gpt._postprocess = types.MethodType(_postprocess, gpt)
    return model


def chunked_loss_tokens(model: Any) -> Optional[int]:
    """The chunk size `use_chunked_loss` gave `model`, or None when it is stock."""
    return getattr(_gpt(model), _MARK, None)


def use_stock_loss(model: Any) -> Any:
    """Undo `use_chunked_loss`: `model`'s loss is megatron's own again (the logits GEMM and
    `vocab_parallel_cross_entropy`); returns `model`. A model that is stock stays untouched."""
    gpt = _gpt(model)
    if not hasattr(gpt, _MARK):
        return model
    for owner in (gpt, gpt.output_layer):
        for name in ("_postprocess", "forward", _MARK):
            if name in vars(owner):
                delattr(owner, name)
    return model


def chunked_refusal(model: Any) -> Optional[str]:
    """Why `model` (a GPTModel, or one wrapped) cannot take the chunked loss, or None when it
    can (also when it holds no output layer: a pipeline stage before the last). Changes
    nothing."""
    try:
        gpt = _gpt(model)
    except TypeError:
        return "the model is not a megatron-core GPTModel (the chunked loss replaces a GPTModel's output layer and loss)"
    if not gpt.post_process:
        return None
    if not hasattr(gpt, _MARK) and ("_postprocess" in vars(gpt) or "forward" in vars(gpt.output_layer)):
        return "model._postprocess or model.output_layer.forward is already replaced on this instance by someone else"
    try:
        _check_output_layer(gpt.output_layer, gpt.config)
    except NotImplementedError as err:
        return str(err).replace("use_chunked_loss: ", "")
    if gpt.config.mtp_num_layers is not None:
        return "multi-token prediction (mtp_num_layers) is not supported (its extra losses use the logits)"
    if gpt.output_layer.gather_output and gpt.output_layer.tp_group.size() > 1:
        return "an output layer that gathers its logits over tensor parallelism (gather_output) is not supported"
    return None


def check_output(gpts: list, mode: str) -> Optional[torch.nn.Module]:
    """The GPTModel whose loss `mode` (`ActConfig.output_loss_mode()`: "stock", "chunked" or
    "auto") concerns among `gpts` (the megatron-core GPTModels `apply()` found), or None.

    A fixed "chunked" that cannot be served raises ValueError in one line, naming the reason
    and the fix; "auto" there quietly stays stock (None). A pipeline stage without the output
    layer has nothing to do (None)."""
    if mode == STOCK:
        return None
    fix = ("fix: set output_loss to 'stock', or 'auto' to let the planner use it where it can "
           "(--act-compress-output-loss, the 'output_loss' key of the DeepSpeed 'activation_compression' "
           "section, ActConfig.output_loss)")
    if not gpts:
        if mode == CHUNKED:
            raise ValueError("output_loss 'chunked': the model holds no megatron-core GPTModel, so there is no "
                             "output layer to replace; pass apply() the GPTModel (or its wrapper); " + fix)
        return None
    last = [g for g in gpts if g.post_process]
    if not last:
        return None
    if len(last) > 1:
        if mode == CHUNKED:
            raise ValueError(f"output_loss 'chunked': the model holds {len(last)} GPTModels with an output layer; "
                             "apply() serves one; " + fix)
        return None
    reason = chunked_refusal(last[0])
    if reason is not None:
        if mode == CHUNKED:
            raise ValueError(f"output_loss 'chunked': {reason}; {fix}")
        return None
    return last[0]


class OutputLossSwitch:
    """One GPTModel's output layer and loss, "stock" or "chunked" (`set`); the Controller
    switches it between iterations (`llm_act.runtime.output_choice.OutputSwitch`).

    With `record=True` (the planner chooses: output_loss "auto" under plan "auto") a forward
    pre-hook on the output layer notes the [s, b, h] shape and dtype of what it is given (no
    device work), from which `sizes()` derives the bytes of each choice."""

    def __init__(self, gpt: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, record: bool = False):
        self.gpt = _gpt(gpt)
        self.chunk_tokens = int(chunk_tokens)
        self.input_shape: Optional[tuple[int, ...]] = None
        self.input_dtype: Optional[torch.dtype] = None
        self.gemm_ms: Optional[float] = None
        """the measured time of the extra logits GEMM (`output_choice.measure_gemm_ms`), once per run"""
        self._handle = None
        if record:
            self._handle = self.gpt.output_layer.register_forward_pre_hook(self._note, with_kwargs=True)

    def _note(self, module: Any, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input_")
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            self.input_shape, self.input_dtype = tuple(int(n) for n in x.shape), x.dtype

    @property
    def mode(self) -> str:
        return CHUNKED if chunked_loss_tokens(self.gpt) is not None else STOCK

    def set(self, mode: str) -> None:
        if mode == CHUNKED:
            if self.mode != CHUNKED:
                use_chunked_loss(self.gpt, self.chunk_tokens)
        elif mode == STOCK:
            use_stock_loss(self.gpt)
        else:
            raise ValueError(f"output loss: expected {STOCK!r} or {CHUNKED!r}, got {mode!r}")

    def weight(self) -> torch.Tensor:
        """The output weight [vocab_local, h] (the embedding's when they are tied)."""
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def sizes(self) -> Optional[OutputSizes]:
        """The output layer's sizes at the last forward seen (None before one)."""
        if self.input_shape is None:
            return None
        s, b, h = self.input_shape
        layer = self.gpt.output_layer
        shards = layer.tp_group.size() if layer.sequence_parallel else 1  # s is a shard of the sequence
        elem = torch.empty((), dtype=self.input_dtype).element_size()
        return OutputSizes(tokens=s * shards * b, hidden=h, vocab_local=int(layer.output_size_per_partition),
                           elem_bytes=elem, chunk_tokens=self.chunk_tokens, sequence_shards=shards)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
