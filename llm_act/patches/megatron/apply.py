"""`apply(model, config) -> Controller`: compress a megatron-core model in place.

Works on anything holding megatron-core `TransformerLayer`s -- a `GPTModel`, a
`TransformerBlock`, a list of pipeline chunks, or those wrapped in `Float16Module` / DDP --
by walking `modules()`. Each layer's storing modules are converted in place
(`swap.convert_layer`: class swaps, parameters and state_dict keys untouched) and handed to
a `Controller` under the layer's global 0-based index (`layer_number - 1`, which megatron
already offsets by the pipeline stage). Nothing here draws random numbers, and with plan
"keep" every converted module runs its stock code path, so results and RNG consumption
are those of the stock model. The decoder's final norm, whose input is the one planned site
after the blocks (`llm_act.sites.MODEL_SITES`), is converted too (`swap.convert_outer`) and
driven as a site of the last layer. `embedding.*` and `loss.logits` need nothing here: the
ledger attributes what the embedding and the output layer / loss save by module.

The output layer and its loss (`ActConfig.output_loss`): "chunked" routes a GPTModel's
labelled loss through `llm_act.output.chunked_linear_cross_entropy` (vocab-parallel over
megatron's tensor-parallel group; `patches.megatron.output.use_chunked_loss`); "auto" under
plan "auto" lets the adaptive planner switch it between iterations
(`llm_act.runtime.output_choice`; it starts chunked, as "auto" starts from "compress");
"stock", and "auto" under a fixed plan, leave megatron's output layer untouched. The
Controller holds the switch (`controller.output`).

The returned Controller watches the first training forward (`Controller.watch`): with a
user budget and no probe (Megatron-LM's `pretrain()`, a plain loop) a budget no plan fits
(plan "auto": `adapt.BudgetTooSmall`) or that the fixed plan exceeds (`adapt.PlanOverBudget`)
is refused at the end of the first forward, or at the first step boundary when the loop
drives the controller (`controller.step()`, `attach_optimizer`).

The Controller's state rides in the model's checkpoints: `apply` adds the parameter-free
child `llm_act_state` (`controller_state.ControllerState`, under the wrappers of the first
module given) whose extra state is `controller.state_dict()`, per rank in
`sharded_state_dict()` (Megatron-LM's `--save` / `--load`, both checkpoint formats).

Megatron-core is imported only when `apply` is called (this module imports with torch only).
"""
from __future__ import annotations

from typing import Any, Iterable, Union

import torch

from llm_act._imports import require
from llm_act.config import ActConfig
from llm_act.cpu import required as cpu_required
from llm_act.patches.megatron import controller_state, output, unsupported
from llm_act.patches.megatron.swap import convert_layer, convert_outer
from llm_act.runtime import agreement
from llm_act.runtime.controller import Controller


def as_config(config: Union[ActConfig, dict, None]) -> ActConfig:
    """An `ActConfig` from an ActConfig, a dict (`ActConfig.from_dict`) or None (defaults)."""
    if config is None:
        return ActConfig()
    if isinstance(config, ActConfig):
        return config
    if isinstance(config, dict):
        return ActConfig.from_dict(config)
    raise TypeError(f"config: expected an llm_act.ActConfig, a dict or None, got {type(config).__name__}")


def _roots(model: Any) -> list[torch.nn.Module]:
    items = list(model) if isinstance(model, (list, tuple)) else [model]
    for i, item in enumerate(items):
        if not isinstance(item, torch.nn.Module):
            raise TypeError(
                f"model: expected a torch.nn.Module or a list of them (pipeline chunks), "
                f"got {type(item).__name__}" + (f" at index {i}" if len(items) > 1 else "")
            )
    return items


def _all_modules(roots: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    seen: set[int] = set()
    out = []
    for root in roots:
        for m in root.modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def transformer_layers(model: Any) -> list[torch.nn.Module]:
    """The megatron-core TransformerLayers held by `model` (a module or a list of modules)."""
    require("megatron.core", "llm_act.patches.megatron.apply")
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in _all_modules(_roots(model)) if isinstance(m, TransformerLayer)]


def _blocks(roots: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The megatron-core TransformerBlocks held by `roots` (the decoders, whose final norm
    stores the site after the blocks)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [m for m in _all_modules(roots) if isinstance(m, TransformerBlock)]


def apply(model: Any, config: Union[ActConfig, dict, None] = None) -> Controller:
    """Convert every TransformerLayer of `model` in place and return its `Controller`.

    `config.enabled` False: the model is left untouched and the Controller does nothing.
    MoE layers with SequentialMLP experts are converted too (`moe.convert_moe`: sites
    `moe.*`). Unsupported features (Transformer Engine, grouped-GEMM or shared MoE experts and
    the other MoE settings of `unsupported.check_moe`, MLA, context parallel, CUDA graphs,
    a model already torch.compile'd, Megatron's recompute_granularity) raise a clear error
    before anything is changed. `torch.compile` of the converted model (after `apply`)
    works under fixed plans; what it refuses (`unsupported.compile_refusal`: plan "auto",
    tensor/sequence parallelism, MoE) raises when the compiled code first runs a layer.
    Calling `apply` again on the same model raises: change plans through the
    Controller (`set_plan`) instead. The model's `state_dict()` / `sharded_state_dict()`
    then carry the Controller's state and `load_state_dict` restores it
    (`controller_state`; a checkpoint without it loads as before). A model built with
    `layer_spec(...)` already holds the compressed classes; `apply` then only binds them
    to a Controller.

    It never patches megatron-core or torch. On a host without CUDA, a model with a part
    that calls CUDA there (RoPE, sequence or pipeline parallelism, ...: `cpu_required`) is
    refused before anything is changed, with the part named and the opt-in that runs it on
    CPU (`llm_act.cpu.install()`).

    Collective under torch.distributed: every rank of the job calls it, and the ranks agree
    on their `ActConfig` and resolved plan (`agreement.agree_setup`; a pipeline stage's plan
    is compared with the ranks holding the same layers). Ranks handed different settings
    would hang in the first recomputed collective; instead every rank raises
    `agreement.Disagreement` naming the differing fields and each rank's value.
    """
    config = as_config(config)
    roots = _roots(model)
    if not config.enabled:
        controller = Controller(config)
        agreement.agree_setup(controller)
        return controller
    require("megatron.core", "llm_act.patches.megatron.apply")

    layers = transformer_layers(roots)
    if not layers:
        raise ValueError(
            f"model: no megatron-core TransformerLayer found in {type(model).__name__}; apply "
            "takes a GPTModel, a TransformerBlock, a list of pipeline chunks, or those wrapped "
            "in Float16Module / DistributedDataParallel"
        )
    for layer in layers:
        if getattr(layer, "_llm_act_controller", None) is not None:
            raise ValueError(
                f"model: layer {layer.layer_number} was already converted by apply(); switch "
                "plans with the Controller it returned (controller.set_plan(...))"
            )
    tconfigs = {id(layer.config): layer.config for layer in layers}
    for tconfig in tconfigs.values():
        unsupported.check_transformer_config(tconfig, config)
    unsupported.check_modules(_all_modules(roots))
    unsupported.check_context_parallel()
    cpu_required.check_model(_all_modules(roots), tconfigs.values(), "apply")
    from megatron.core.models.gpt.gpt_model import GPTModel

    output_mode = config.output_loss_mode()
    gpt = output.check_output([m for m in _all_modules(roots) if isinstance(m, GPTModel)], output_mode)
    num_layers = max(int(getattr(c, "num_layers", 0) or 0) for c in tconfigs.values())

    modules: dict[int, dict[str, Any]] = {}
    for layer in layers:
        index = int(layer.layer_number) - 1
        if index in modules:
            raise ValueError(
                f"model: two TransformerLayers have layer_number {index + 1}; apply needs "
                "megatron's global layer numbers to tell layers apart"
            )
        modules[index] = convert_layer(layer, index, attention=True)
    for block in _blocks(roots):
        last, outer = convert_outer(block)  # the final norm: a site of the last layer's plan
        if last in modules:
            modules[last].update(outer)
    num_layers = max(num_layers, max(modules) + 1)
    controller = Controller(config, modules, num_layers=num_layers)
    for layer in layers:
        unsupported.guard_compile(layer, unsupported.compile_refusal(layer.config, config))
        layer._llm_act_controller = controller
        controller.layer_modules[int(layer.layer_number) - 1] = layer  # what measurement reads
    if gpt is not None:  # output_loss "chunked", or "auto" under plan "auto" (the planner's choice)
        controller.output = output.OutputLossSwitch(gpt, config.output_chunk_tokens,
                                                    record=output_mode == "auto")
        controller.output.set("chunked")
    agreement.agree_setup(controller)
    controller.watch(roots, layers)  # the budget check of the first step (adapt.FirstForward)
    controller_state.attach(roots, controller, layers)  # the state rides in the model's checkpoints
    return controller

