"""`initialize`: `deepspeed.initialize` with the `"activation_compression"` config section.

Same signature and return value as `deepspeed.initialize` (0.19); every argument is passed
on unchanged. Before DeepSpeed wraps the model it:

1. resolves the config as DeepSpeed will (`config`, `config_params` or
   `args.deepspeed_config`) and reads our section with `ActConfig.from_dict` (unknown keys
   and bad values raise ValueError naming the key);
2. brings up DeepSpeed's process group (as `deepspeed.initialize` would first thing);
3. patches the model: megatron-core models (anything holding `TransformerLayer`s) through
   `llm_act.patches.megatron.apply`, their whole-block recompute through
   `deepspeed.checkpointing` when `"activation_checkpointing"` is configured
   (`megatron_recompute`); other models through the generic hook path plus per-block
   recompute on their repeated blocks (`generic.apply`);
4. checks that every rank (the DP/ZeRO ranks, and any model-parallel peers: the world)
   holds the same section and the same resolved plan (`agreement.agree_setup`): ranks with
   different plans would hang in ZeRO-3's gathers inside recomputation, so every rank
   raises `agreement.Disagreement` naming the differing keys and each rank's value;
5. calls `deepspeed.initialize`, then attaches the controller to the engine
   (`engine.act_controller`, advanced by `engine.step()`, saved in checkpoints; see
   `engine.py`), which measures the first forward and refuses a user budget that cannot
   hold the plan ("auto": no plan fits it) at the first `engine.step()`.

Without our section the model is untouched and `engine.act_controller` is a disabled
controller that only counts optimizer steps.
"""
from __future__ import annotations

from typing import Any, Optional

from llm_act._imports import require
from llm_act.config import ActConfig
from llm_act.patches.deepspeed import build_locks, ds_config
from llm_act.runtime import agreement
from llm_act.runtime.controller import Controller


def _is_megatron(model: Any) -> bool:
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return False
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return any(isinstance(m, TransformerLayer) for m in model.modules())


def _patch(model: Any, config: Optional[ActConfig], checkpointing: ds_config.Checkpointing,
           mpu: Any):
    """(controller, generic handle or None): apply our patches to `model` in place."""
    if config is None or not config.enabled:
        return Controller(config if config is not None else ActConfig(enabled=False)), None
    if _is_megatron(model):
        from llm_act.patches.deepspeed import megatron_recompute
        from llm_act.patches.megatron import controller_state

        controller = megatron_recompute.apply(model, config, checkpointing, mpu)
        controller_state.remove(model)  # the engine saves the controller's state (engine.py)
        return controller, None
    from llm_act.patches.deepspeed import generic

    handle = generic.apply(model, config, checkpointing, mpu=mpu)
    return handle.controller, handle


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """`deepspeed.initialize` plus llm_act (see the module docstring).

    Returns `(engine, optimizer, training_dataloader, lr_scheduler)` exactly as DeepSpeed
    does; the engine carries `act_controller` (and `act_generic`, the generic-path handle,
    for models that are not megatron-core).
    """
    deepspeed = require("deepspeed", "llm_act.patches.deepspeed.initialize")
    import torch

    if model is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    build_locks.clear_stale_locks()  # DeepSpeed builds its ops inside deepspeed.initialize
    ds = ds_config.load(ds_config.source(args, config, config_params))
    act = ds_config.act_config(ds)
    checkpointing = ds_config.checkpointing(ds)

    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               distributed_port=distributed_port,
                               dist_init_required=dist_init_required)
    controller, handle = _patch(model, act, checkpointing, mpu)
    agreement.agree_setup(controller)
    result = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler,
        distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=config, mesh_param=mesh_param, config_params=config_params,
    )
    engine = result[0]
    from llm_act.patches.deepspeed import engine as engine_lib

    engine_lib.attach(engine, controller,
                      extra_state=handle.extra_state if handle is not None else None,
                      load_extra=handle.load_extra if handle is not None else None)
    engine.act_generic = handle
    return result
