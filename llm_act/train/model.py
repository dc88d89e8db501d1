"""The megatron-core GPTModel of this rank's pipeline stage, built from the flags.

Without `--act-compress` the model is stock: megatron-core's local (non-Transformer-
Engine) layer spec. With it, `apply(model, config)` converts the stock layers and returns
the Controller -- the same call a Megatron-LM user makes on the model their provider
returns. Sequence parallelism on CPU needs llm_act's norms (megatron's `WrappedTorchNorm`
refuses SP without apex), so an SP model is built from `block_spec` (whose layers run
stock code until `apply` binds a plan; without `--act-compress` it is never bound).
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from llm_act.config import ActConfig
from llm_act.patches.megatron import apply, block_spec, compat, controller_state
from llm_act.train.small_gpt import local_layer_spec


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: a multiple of make-vocab-size-divisible-by x TP."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def transformer_config(args: argparse.Namespace):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = params_dtype(args)
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=not on_gpu,
        # megatron's fused bias-dropout-add is a torch.compile function: minutes of
        # Inductor compilation on CPU (and "auto" refuses torch.compile of patched layers).
        bias_dropout_fusion=False,
    )
    for name, off in compat.NEW_OPTIONS.items():  # newer megatron-core's options, where set
        if getattr(args, name, off) != off:
            kw[name] = getattr(args, name)
    if args.swiglu:
        import torch.nn.functional as F

        kw.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    return TransformerConfig(**kw)


def _layer_spec(args: argparse.Namespace, tconfig, act_config):
    if not args.sequence_parallel:
        return local_layer_spec(normalization=args.normalization)

    # plan "keep": the converted classes run stock code; apply() binds the real plan later
    return block_spec(act_config or ActConfig(plan="keep"), tconfig, normalization=args.normalization)


def _cpu_gpt_model_class():
    """GPTModel whose first/last-stage embedding sync works on CPU.

    With pipeline parallelism and tied embeddings, megatron-core's
    `setup_embeddings_and_output_layer` moves the last stage's copy of the word embedding
    to CUDA (`weight.data.cuda()`) before all-reducing it over the embedding group. This
    subclass skips that step during construction and then does the same all-reduce on CPU.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    class CpuGPTModel(GPTModel):
        _llm_act_building = False

        def __init__(self, *args: Any, **kwargs: Any):
            CpuGPTModel._llm_act_building = True
            try:
                super().__init__(*args, **kwargs)
            finally:
                CpuGPTModel._llm_act_building = False
            if self.share_embeddings_and_output_weights and self._is_in_embd_group():
                weight = self.shared_embedding_or_output_weight()
                torch.distributed.all_reduce(weight.data, group=self.embd_group)

        def _is_in_embd_group(self):
            return False if CpuGPTModel._llm_act_building else super()._is_in_embd_group()

    return CpuGPTModel


def build(args: argparse.Namespace, act_config: Optional[Any] = None):
    """([GPTModel] for this pipeline stage (in a Float16Module under --bf16),
    TransformerConfig, Controller or None)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    tconfig = transformer_config(args)
    cls = GPTModel if torch.cuda.is_available() else _cpu_gpt_model_class()
    model = cls(
        config=tconfig,
        transformer_layer_spec=_layer_spec(args, tconfig, act_config),
        vocab_size=padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                     args.tensor_model_parallel_size),
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16:  # as Megatron-LM: every parameter (learned position embeddings too) in bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(tconfig, model)
    chunks = [model]
    controller = None
    if act_config is not None:
        controller = apply(chunks, act_config)
        controller_state.remove(chunks)  # checkpoint.py saves the controller's state itself
    return chunks, tconfig, controller
