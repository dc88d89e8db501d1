"""`use_chunked_loss(model, chunk_tokens)`: a megatron-core GPTModel whose loss never holds
the [tokens, vocab] logits (`llm_act.output.chunked_linear_cross_entropy`).

Two instance attributes on that one model, nothing global and no megatron source changed:
`model._postprocess`, which with labels calls the output layer with them and returns its
loss (stock `_postprocess` otherwise: labels None, inference, multi-token prediction, the
config logger), and `model.output_layer.forward`, which with labels runs the chunked op on
its weight (or the tied embedding weight handed to it) instead of the logits GEMM. The
output layer is still called as a module, so its hooks run (megatron DDP's parameter
all-gather pre-hook among them). The loss is stock's: [b, s] fp32, per token.

Sequence parallelism, deferred embedding wgrad and an output bias are refused: stock's
output layer communicates differently there.
"""
from __future__ import annotations

import inspect
import types
from typing import Any, Optional

import torch

from llm_act._imports import require
from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS, chunked_linear_cross_entropy

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
    if layer.sequence_parallel:
        raise NotImplementedError("use_chunked_loss: sequence parallelism is not supported yet "
                                  "(stock's output layer gathers the sequence inside its GEMM)")
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
                                        tp_group=group)
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
