"""The Controller's state inside the model's checkpoints: `ControllerState`, the child module
`apply()` adds to a megatron-core model.

Why a module: Megatron-LM's `--save` / `--load` (and any loop that checkpoints
`model.state_dict()`) save and restore the model and the optimizer, never an object of ours,
and `apply` must not edit Megatron-LM. A child module with no parameters whose PyTorch
"extra state" is the Controller's `state_dict()` rides along with the weights instead:

- `model.state_dict()` (Megatron-LM's legacy `--ckpt-format torch`, plain PyTorch loops)
  holds `llm_act_state._extra_state`, and `model.load_state_dict(...)` hands it to
  `Controller.load_state_dict` (whose rules apply: the flags given now win);
- `model.sharded_state_dict(metadata=...)` (megatron-core's `dist_checkpointing`,
  Megatron-LM's default `--ckpt-format torch_dist`) holds it as a `ShardedObject` with one
  shard per rank and model chunk (key `llm_act_controller`, global shape (world size,
  chunks per rank), offset (global rank, chunk)), so every rank saves and restores its own
  controller state: the codecs' random streams differ per data- and tensor-parallel rank,
  and each pipeline stage has its own layers and planner state. megatron-core's default
  treatment of `_extra_state` (one object replicated over TP and DP) would keep one rank's
  state per pipeline stage, under the same key for every stage.

A checkpoint made without it loads: `load_state_dict` (strict too) takes a missing
`llm_act_state._extra_state` as "nothing saved" (logged), and `dist_checkpointing` is not
asked for the object unless the checkpoint holds it, which `sharded_state_dict` learns from
the checkpoint's content metadata (Megatron-LM passes the metadata it saved with the
checkpoint back to `sharded_state_dict` when it loads; the entry `llm_act_controller`,
the parallel layout, is written into that metadata when the state is saved). Without the
entry, the object is included only once the controller has state to save (its iteration
is past 0: a save after training), since a load request for a key the checkpoint lacks
fails under Megatron-LM's default `--dist-ckpt-strictness`. Saved under another parallel
layout (world size, TP / PP / DP / EP sizes, chunks per rank), it is not requested: the
controller starts from the current flags, and says so. Hence, outside Megatron-LM, drive
`dist_checkpointing` as it does: save with `content_metadata=` the (cleaned) metadata given to
`sharded_state_dict`, and load with `sharded_state_dict(metadata=load_content_metadata(dir))`;
and a model whose controller has already stepped cannot load a `torch_dist` checkpoint made
without the state (it asks for the object).

The model keeps loading where llm_act is absent: `dist_checkpointing` does not read objects
the model does not ask for, and Megatron-LM loads a legacy checkpoint's extra key by
falling back to a non-strict `load_state_dict`.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch

log = logging.getLogger(__name__)

#: the child's name on the model: its state_dict key is f"{NAME}._extra_state"
NAME = "llm_act_state"
#: the dist_checkpointing ShardedObject's key, and the content-metadata entry that says a
#: checkpoint holds it (its value: the parallel layout it was saved under)
KEY = "llm_act_controller"


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model under Megatron's / torch's wrappers (DDP, Float16Module, FSDP: `.module`)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def find(model: Any) -> list["ControllerState"]:
    """The `ControllerState` children of `model` (a module or a list of pipeline chunks)."""
    items = list(model) if isinstance(model, (list, tuple)) else [model]
    return [m for item in items for m in item.modules() if isinstance(m, ControllerState)]


def remove(model: Any) -> None:
    """Take the controller's state out of `model`'s checkpoints again (for loops that save
    `Controller.state_dict()` themselves, beside the model)."""
    items = list(model) if isinstance(model, (list, tuple)) else [model]
    for item in items:
        for module in item.modules():
            if isinstance(module._modules.get(NAME), ControllerState):
                del module._modules[NAME]


def _layout(chunks: int) -> dict[str, int]:
    """The parallel layout a saved state belongs to: every rank computes the same."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout = {"world_size": world, "chunks_per_rank": chunks}
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        layout.update(tensor=ps.get_tensor_model_parallel_world_size(),
                      pipeline=ps.get_pipeline_model_parallel_world_size(),
                      data=ps.get_data_parallel_world_size(with_context_parallel=True),
                      expert=ps.get_expert_model_parallel_world_size())
    return layout


class ControllerState(torch.nn.Module):
    """A parameter-free child of the model whose extra state is `controller.state_dict()`
    (see the module docstring for why). `chunk` / `chunks`: this model chunk's virtual
    pipeline stage and the chunks per rank, where `apply` was given one chunk of several."""

    def __init__(self, controller: Any, chunk: int = 0, chunks: int = 1):
        super().__init__()
        if not 0 <= chunk < chunks:
            raise ValueError(f"chunk: expected 0 <= chunk < chunks ({chunks}), got {chunk}")
        self.controller = controller
        self.chunk = int(chunk)
        self.chunks = int(chunks)
        self._said_layout = False

    def extra_repr(self) -> str:
        return f"layers={list(self.controller.layers)}, chunk={self.chunk} of {self.chunks}"

    def get_extra_state(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def set_extra_state(self, state: Any) -> None:
        if state is not None:
            self.controller.load_state_dict(state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """A checkpoint without the controller's state (saved without `apply`, by an older
        llm_act, or under another parallel layout) loads, strict or not."""
        if prefix + "_extra_state" not in state_dict:
            log.info("llm_act: the checkpoint holds no act controller state for layers %s "
                     "(saved without llm_act's apply(), by an older llm_act, or under another "
                     "parallel layout); the controller keeps its own (iteration %d, the plan of "
                     "the current flags)", list(self.controller.layers), self.controller.iteration)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, False, missing_keys,
                                      unexpected_keys, error_msgs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Iterable = (),
                           metadata: Optional[dict] = None) -> dict[str, Any]:
        """This rank's and chunk's controller state as a `ShardedObject`, when there is one
        to save or the checkpoint being loaded holds one (`metadata[KEY]`); else nothing."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        import torch.distributed as dist

        layout = _layout(self.chunks)
        saved = None if metadata is None else metadata.get(KEY)
        if saved is None and self.controller.iteration == 0:
            return {}  # nothing to save yet, or loading a checkpoint made without it
        if saved is not None and saved != layout:
            if not self._said_layout:
                self._said_layout = True
                log.info("llm_act: the checkpoint's act controller states were saved under "
                         "another parallel layout (%s; this run: %s), so they are not loaded "
                         "and the controller starts from the current flags", saved, layout)
            return {}
        if metadata is not None:
            metadata[KEY] = layout  # becomes the checkpoint's content metadata (Megatron-LM)
        on = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if on else 0
        return {f"{prefix}_extra_state": ShardedObject(
            KEY, self.get_extra_state(), (layout["world_size"], self.chunks), (rank, self.chunk),
            replica_id=0)}


def attach(roots: list[torch.nn.Module], controller: Any, layers: list[Any]) -> ControllerState:
    """Add the `ControllerState` of `controller` to the model `apply` was given: under the
    wrappers of its first module (`unwrap`); `layers` are its TransformerLayers."""
    host = unwrap(roots[0])
    if NAME in host._modules:
        raise ValueError(f"model: already holds an act controller's state ({NAME!r}); "
                         "apply() binds one Controller per model")
    chunk, chunks = 0, 1
    vp_stage = getattr(host, "vp_stage", None)
    vpp = layers and getattr(layers[0].config, "virtual_pipeline_model_parallel_size", None)
    if len(roots) == 1 and vp_stage is not None and vpp:
        chunk, chunks = int(vp_stage), int(vpp)  # Megatron-LM: one apply() per model chunk
    state = ControllerState(controller, chunk, chunks)
    host.add_module(NAME, state)
    return state
