"""Clear errors for the megatron-core features the compressed layers do not handle yet.

Transformer Engine specs, some MoE settings (`check_moe`), context parallel, multi-latent
attention, CUDA graphs, megatron-core 0.17-0.19's options the layers would ignore (GTP weight
sharding, MLP chunks, the MoE paged stash, qk_l2_norm, MuP, fp8_output_proj:
`check_new_options`), HybridModel, and Megatron's own `recompute_granularity` together with our plan
would either bypass the compressed modules (TE, MoE, MLA), break their invariants (CUDA
graphs freeze the codecs' random streams and Python-side choices; CP splits the sequence
our sites assume whole) or double the recomputation (Megatron's checkpointing around layers
that already choose keep / compress / recompute per site). `apply` and `layer_spec` call
these checks first, so a run fails at set-up with the feature named and what to do,
instead of training wrongly.

torch.compile of patched layers (`compile_refusal`, `guard_compile`): a layer under a
fixed plan compiles, with its codec ops (`torch.ops.llm_act.*`) inside the graph, and
computes what the eager layer computes (tests/patches/megatron/test_compile.py). Refused,
with the reason in one line when the compiled layer first runs: plan "auto" (it measures
the codecs and re-plans at tracking iterations), and the settings not tested under
compile yet (tensor or sequence parallelism, MoE layers). A model must be converted
before it is compiled (`check_modules`).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from llm_act.patches.megatron import compat

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
    check_new_options(tconfig)
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


#: why each option of newer megatron-core releases (`compat.NEW_OPTIONS`) is refused when
#: set: what our layers would silently not do
_NEW_OPTION_WHY = {
    "gtp_weight_remat_size": "GTP weight sharding: the compressed linears take whole weights; "
                             "set it to 1 (drop --tensor-parallel-num-weight-shards)",
    "expert_gtp_weight_remat_size": "GTP sharding of expert weights: the compressed experts take "
                                    "whole weights; set it to 1 (drop "
                                    "--expert-tensor-parallel-num-weight-shards)",
    "mlp_chunks_for_training": "the layer's MLP called per sequence chunk: the MLP sites assume "
                               "one call per micro-batch; set it to 1",
    "moe_paged_stash": "the MoE paged stash keeps the experts' activations itself, past the "
                       "moe.* sites; turn it off",
    "qk_l2_norm": "L2Norm on q and k: the attn.q_norm_input / attn.k_norm_input sites are not "
                  "stored by it; use qk_layernorm, or turn it off",
    "use_mup": "MuP scales the logits (mup_output_mult) and the attention, which llm_act's "
               "chunked output loss and attention do not apply; turn MuP off",
    "fp8_output_proj": "an FP8 LM-head projection, which llm_act's chunked output loss replaces "
                       "by a bf16/fp32 one; turn it off",
}


def check_new_options(tconfig: Any) -> None:
    """Refuse, in one line naming the option and its value, each option of megatron-core
    0.17-0.19 that the compressed layers would ignore (an older config lacks it: off).
    `tconfig`: a TransformerConfig, or anything with its field names (the loop's arguments)."""
    for name, off in compat.NEW_OPTIONS.items():
        value = compat.option(tconfig, name)
        if value is not None and value != off:
            raise NotImplementedError(
                f"{name}={value!r} is not supported by llm_act yet: {_NEW_OPTION_WHY[name]}")


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
        if names & {"HybridModel", "MambaModel"}:
            raise NotImplementedError(
                f"{type(module).__name__} is not supported by llm_act yet: it converts the "
                "TransformerLayers of a GPTModel (megatron-core's GPTModel with the local spec)")
        if "MultiLatentAttention" in names:
            raise NotImplementedError(
                f"multi-latent attention ({type(module).__name__}) is not supported by llm_act yet"
            )
        if "OptimizedModule" in names or getattr(module, "_compiled_call_impl", None) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} is already torch.compile'd: apply llm_act to the "
                "eager model first, then compile it (apply converts the layers in place)")


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


def compile_refusal(tconfig: Any, act_config: Any = None) -> Optional[str]:
    """Why torch.compile of a layer with megatron config `tconfig`, patched under
    `act_config`, is refused (one line: what and what to do), or None where it compiles.

    Compiled (with the same values as eager): fixed plans ("keep", "compress",
    "recompute", JSON plans, per-site codec overrides), dropout and its regenerated masks,
    one tensor-parallel rank. Stochastic codecs whose torch reference draws its rounding
    noise from a `torch.Generator` (not traceable) leave that site's autograd function to
    eager (a graph break, same values); see docs/architecture.md.
    """
    if act_config is not None and getattr(act_config, "enabled", True) \
            and getattr(act_config, "plan", None) == "auto":
        return ("plan 'auto' measures the codecs and re-plans at tracking iterations, which "
                "would time and recompile the compiled layer: compile under a fixed plan "
                "('keep', 'compress', 'recompute' or a JSON plan), or do not compile the layers")
    tp = getattr(tconfig, "tensor_model_parallel_size", 1) or 1
    if tp > 1 or getattr(tconfig, "sequence_parallel", False):
        return (f"tensor/sequence parallelism (tensor_model_parallel_size={tp}, sequence_parallel="
                f"{bool(getattr(tconfig, 'sequence_parallel', False))}) is not tested under "
                "torch.compile yet: compile with one tensor-parallel rank, or do not compile the layers")
    experts = getattr(tconfig, "num_moe_experts", None)
    if experts is not None:
        return (f"MoE layers (num_moe_experts={experts}) are not tested under torch.compile yet: "
                "do not compile the layers")
    return None


def guard_compile(module: torch.nn.Module, reason: Optional[str]) -> Optional[Any]:
    """Make `torch.compile` of `module` (or of a model holding it) fail with `reason`
    (`compile_refusal`) when the compiled code first runs it; nothing where `reason` is
    None. Idempotent; returns the hook handle (None if already guarded or not refused)."""
    if reason is None or getattr(module, "_llm_act_compile_guard", None) is not None:
        return None
    message = f"torch.compile of layers patched by llm_act: {reason}"
    name = type(module).__name__

    @torch.compiler.disable(reason=message)
    def refuse() -> None:
        # Runs eagerly even inside a compiled frame (dynamo graph-breaks here), so the raise
        # is real; under fullgraph=True dynamo itself refuses with `message`.
        raise NotImplementedError(f"{name}: {message}")

    def hook(_module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            refuse()

    handle = module.register_forward_pre_hook(hook)
    module._llm_act_compile_guard = handle
    return handle
