"""Clear errors for the megatron-core features the compressed layers do not handle yet.

Transformer Engine specs, some MoE settings (`check_moe`), context parallel, multi-latent
attention, CUDA graphs, torch.compile of patched layers, and Megatron's own `recompute_granularity` together with
our plan would either bypass the compressed modules (TE, MoE, MLA), break their invariants
(CUDA graphs freeze the codecs' random streams and Python-side choices; torch.compile traces
through the per-iteration codec tables; CP splits the sequence our sites assume whole) or
double the recomputation (Megatron's checkpointing around layers that already choose keep /
compress / recompute per site). `apply` and `layer_spec` call these checks first, so a
run fails at set-up with the feature named and what to do, instead of training wrongly.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine")


def _mro_names(obj: Any) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def _is_te(module: torch.nn.Module) -> bool:
    return any(
        (cls.__module__ or "").startswith(_TE_MODULES) for cls in type(module).__mro__
    )


def check_transformer_config(tconfig: Any, act_config: Any = None) -> None:
    """Reject megatron `TransformerConfig` settings we do not support (None: nothing to check)."""
    if tconfig is None:
        return
    if getattr(tconfig, "num_moe_experts", None) is not None:
        check_moe(tconfig)
    if getattr(tconfig, "multi_latent_attention", False):
        raise NotImplementedError(
            "multi-latent attention (MLA, multi_latent_attention=True) is not supported by "
            "llm_act yet: use standard self-attention, or disable activation compression"
        )
    cp = getattr(tconfig, "context_parallel_size", 1) or 1
    if cp > 1:
        raise NotImplementedError(
            f"context parallel (context_parallel_size={cp}) is not supported by llm_act yet: "
            "use tensor/sequence parallel instead, or disable activation compression"
        )
    graphs = (
        getattr(tconfig, "enable_cuda_graph", False)
        or getattr(tconfig, "external_cuda_graph", False)
        or getattr(tconfig, "cuda_graph_impl", "none") not in (None, "none")
    )
    if graphs:
        raise NotImplementedError(
            "CUDA graphs (enable_cuda_graph / external_cuda_graph / cuda_graph_impl="
            f"{getattr(tconfig, 'cuda_graph_impl', None)!r}) are not supported with llm_act: a "
            "captured graph would freeze the codecs and their random streams; turn CUDA "
            "graphs off, or disable activation compression"
        )
    if getattr(tconfig, "fp8", None):
        raise NotImplementedError(
            f"fp8 training (fp8={tconfig.fp8!r}) runs through Transformer Engine, which llm_act "
            "does not support yet: train in bf16/fp16/fp32 with the local spec"
        )
    granularity = getattr(tconfig, "recompute_granularity", None)
    if granularity is not None and (act_config is None or act_config.enabled):
        raise ValueError(
            f"recompute_granularity={granularity!r}: Megatron's own activation recomputation "
            "cannot be combined with llm_act's plan, which replaces it (it decides keep / "
            "compress / recompute per site). Set recompute_granularity=None (drop "
            "--recompute-granularity) and use plan 'recompute' or a budget instead"
        )


def check_modules(modules: Iterable[torch.nn.Module]) -> None:
    """Reject TE, MoE, MLA and torch.compile'd modules among `modules`."""
    for module in modules:
        names = _mro_names(module)
        if _is_te(module):
            raise NotImplementedError(
                f"Transformer Engine module {type(module).__name__} found: llm_act compresses "
                "megatron-core's local modules only (for now). Build the model with "
                "llm_act.patches.megatron.layer_spec(...) or get_gpt_layer_local_spec() "
                "(Megatron-LM: --transformer-impl local)"
            )
        if names & {"BaseMoELayer", "MoELayer"}:
            check_moe(module.config, module)
        if "MultiLatentAttention" in names:
            raise NotImplementedError(
                f"multi-latent attention ({type(module).__name__}) is not supported by llm_act yet"
            )
        if "OptimizedModule" in names or getattr(module, "_compiled_call_impl", None) is not None:
            raise NotImplementedError(_COMPILE_MESSAGE)


def check_moe(tconfig: Any, moe_layer: Optional[torch.nn.Module] = None) -> None:
    """Reject the MoE settings the compressed MoE layer (`moe.py`) does not handle: grouped
    GEMM experts, shared experts, expert tensor parallelism, expert biases, probabilities
    applied on the input, and token dispatchers other than allgather / alltoall."""
    why = None
    if getattr(tconfig, "moe_grouped_gemm", False) or (
            moe_layer is not None and "SequentialMLP" not in _mro_names(moe_layer.experts)):
        why = ("grouped-GEMM experts (moe_grouped_gemm=True / GroupedMLP / TEGroupedMLP) are not "
               "supported by llm_act yet: build the experts as SequentialMLP "
               "(get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False), Megatron-LM: "
               "drop --moe-grouped-gemm)")
    elif getattr(tconfig, "moe_shared_expert_intermediate_size", None):
        why = ("shared experts (moe_shared_expert_intermediate_size="
               f"{tconfig.moe_shared_expert_intermediate_size}) are not supported by llm_act yet: "
               "train without them, or disable activation compression")
    elif (getattr(tconfig, "expert_tensor_parallel_size", None) or 1) > 1:
        why = (f"expert tensor parallelism (expert_tensor_parallel_size="
               f"{tconfig.expert_tensor_parallel_size}) is not supported by llm_act yet: set "
               "expert_tensor_parallel_size=1 (--expert-tensor-parallel-size 1)")
    elif getattr(tconfig, "add_bias_linear", False):
        why = ("MoE experts with biases (add_bias_linear=True) are not supported by llm_act: "
               "set add_bias_linear=False (--disable-bias-linear), as every megatron MoE recipe does")
    elif getattr(tconfig, "moe_apply_probs_on_input", False):
        why = ("moe_apply_probs_on_input=True is not supported by llm_act yet: turn it off, or "
               "disable activation compression")
    elif getattr(tconfig, "moe_token_dispatcher_type", "allgather") not in ("allgather", "alltoall"):
        why = (f"moe_token_dispatcher_type={tconfig.moe_token_dispatcher_type!r} is not supported by "
               "llm_act yet: use 'allgather' or 'alltoall'")
    if why is not None:
        raise NotImplementedError(f"MoE: {why}")


def check_context_parallel() -> None:
    """Reject a context-parallel group of more than one rank (when megatron's state is up)."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - apply already required megatron
        return
    if not parallel_state.model_parallel_is_initialized():
        return
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        raise NotImplementedError(
            f"context parallel (context-parallel world size {cp}) is not supported by llm_act "
            "yet: use tensor/sequence parallel instead, or disable activation compression"
        )


_COMPILE_MESSAGE = (
    "torch.compile of layers patched by llm_act is not supported: the compressed layers "
    "choose codecs per iteration in Python. Compile other parts of the model, or disable "
    "activation compression"
)


@torch.compiler.disable(reason=_COMPILE_MESSAGE)
def _refuse_compile(name: str) -> None:
    # Runs eagerly even inside a compiled frame (dynamo graph-breaks here), so the raise is
    # real; under fullgraph=True dynamo itself refuses with the reason above.
    raise NotImplementedError(f"{name}: {_COMPILE_MESSAGE}")


def _compile_guard(module: torch.nn.Module, _args: Any) -> None:
    if torch.compiler.is_compiling():
        _refuse_compile(type(module).__name__)


def guard_compile(module: torch.nn.Module) -> Optional[Any]:
    """Make `torch.compile` of `module` (or of a model holding it) fail with a clear error.
    Idempotent; returns the hook handle (None if already guarded)."""
    if getattr(module, "_llm_act_compile_guard", None) is not None:
        return None
    handle = module.register_forward_pre_hook(_compile_guard)
    module._llm_act_compile_guard = handle
    return handle
