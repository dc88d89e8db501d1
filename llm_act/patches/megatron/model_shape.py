"""A megatron-core `TransformerConfig` as the planner's analytic `ModelShape`.

The translation lives with the megatron integration, where the config's fields are known; the
runtime asks for it through the layer contract (`LayerBinder.model_shape`), so the first
step's budget check never reads a megatron config itself."""
from __future__ import annotations

from typing import Any

from llm_act.codecs.fewbit import ACTIVATIONS
from llm_act.planner.model_shape import ModelShape


def shape_of_config(tconfig: Any, *, count: int, seq_length: int, micro_batch: int, dtype: str,
                    position_embedding: str, attention: str) -> ModelShape:
    """The `ModelShape` of `count` layers built from `tconfig`, at the observed input:
    `seq_length` as this rank sees it (a sequence-parallel rank holds 1/TP of it), `micro_batch`,
    the activations' `dtype` name. Raises ValueError for what the analytic model lacks."""
    tp = int(getattr(tconfig, "tensor_model_parallel_size", 1) or 1)
    sp = bool(getattr(tconfig, "sequence_parallel", False))
    heads = int(tconfig.num_attention_heads)
    kv = getattr(tconfig, "kv_channels", None)
    if kv is not None and int(kv) * heads != int(tconfig.hidden_size):
        raise ValueError(f"kv_channels={kv} is not hidden_size / num_attention_heads")
    act = getattr(getattr(tconfig, "activation_func", None), "__name__", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} has no analytic model")
    return ModelShape(
        count, int(tconfig.hidden_size), heads, seq_length * tp if sp else seq_length, micro_batch,
        ffn_hidden_size=tconfig.ffn_hidden_size, num_query_groups=tconfig.num_query_groups,
        gated_linear_unit=bool(tconfig.gated_linear_unit), activation=act, dtype=dtype, tp=tp,
        sequence_parallel=sp, qk_layernorm=bool(getattr(tconfig, "qk_layernorm", False)),
        dropout=float(max(tconfig.hidden_dropout or 0.0, tconfig.attention_dropout or 0.0)),
        bias=bool(tconfig.add_bias_linear), normalization=str(tconfig.normalization),
        position_embedding=position_embedding, attention=attention)
