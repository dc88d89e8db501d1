"""The Controller's state rides in the model's checkpoints (`patches.megatron.controller_state`),
on a real megatron-core GPT on CPU:

- `model.state_dict()` after `apply` and two training steps holds the controller's
  `state_dict()` (plan "auto": the adaptive planner's tracking schedule, the codecs' random
  streams), and `load_state_dict` into a fresh model under `apply` restores it: the next
  step runs alike on both;
- a checkpoint made without it (a stock model's) loads, strict;
- one state per model, also when `apply` is called twice or the model is wrapped
  (torch DDP after `apply`, megatron's Float16Module before);
- megatron-core's `dist_checkpointing` (Megatron-LM's default `torch_dist` format), driven as
  Megatron-LM drives it (the content metadata saved with the checkpoint is handed back to
  `sharded_state_dict` on load): the round trip, a checkpoint without the state (loads under
  the default strictness), a stock model loading ours, another parallel layout (not
  requested), and on 2 gloo ranks each rank's own state.

`dist_checkpointing`'s writer calls `torch.cuda.synchronize()` / `current_device()`; the
fixture `dist_ckpt_on_cpu` points those three modules' `torch` at the CPU stand-in for the test.
"""
from __future__ import annotations

import importlib
import logging
import os
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply, controller_state
from tests import testing as T
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

STATE = f"{controller_state.NAME}._extra_state"
AUTO = ActConfig(plan="auto", sensitivity=False)
_DIST_CKPT_CUDA = tuple(f"megatron.core.dist_checkpointing.strategies.{m}"
                        for m in ("filesystem_async", "state_dict_saver", "async_utils"))


def _train(model, steps, seed=0):
    """`steps` iterations of a plain loop (forward, backward, optimizer.step(): the
    controller's boundary, as in Megatron-LM)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids, pos, labels = T.gpt_batch(R.BATCH, R.SEQ, R.VOCAB, generator=gen)
        model(ids, pos, None, labels=labels).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def assert_same_state(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_state(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _dist_ckpt_cpu():
    from llm_act.cpu.stand_ins import CpuTorch

    return [(importlib.import_module(name), CpuTorch()) for name in _DIST_CKPT_CUDA]


@pytest.fixture
def dist_ckpt_on_cpu(monkeypatch):
    for module, proxy in _dist_ckpt_cpu():
        monkeypatch.setattr(module, "torch", proxy)


def _save(model, path, strategy=None):
    """As Megatron-LM's save_checkpoint (torch_dist): the metadata passed to
    `sharded_state_dict` is saved as the checkpoint's content metadata."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    os.makedirs(path, exist_ok=True)
    metadata = {"singleton_local_shards": False}
    sharded = {"model": model.sharded_state_dict(metadata=metadata)}
    dist_checkpointing.save(sharded, str(path), strategy,
                            content_metadata=_clean_metadata_for_serialization(metadata))
    return metadata


def _load(model, path, metadata=None):
    """As Megatron-LM's load_checkpoint (torch_dist, default strictness): the checkpoint's
    content metadata builds the request, then a strict `load_state_dict`."""
    from megatron.core import dist_checkpointing

    if metadata is None:
        metadata = dist_checkpointing.load_content_metadata(str(path)) or {}
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=metadata)}, str(path))
    model.load_state_dict(loaded["model"], strict=True)
    return loaded["model"]


@pytest.mark.usefixtures("megatron_one_rank")
def test_state_dict_carries_the_controller_and_load_state_dict_restores_it():
    model = R.build()
    ctl = apply(model, AUTO)
    _train(model, 2)
    assert ctl.iteration == 2 and ctl.adapter.tracked == [1, 2]
    saved = model.state_dict()
    assert [k for k in saved if k.startswith(controller_state.NAME)] == [STATE]
    state = saved[STATE]
    assert_same_state(state, ctl.state_dict())
    assert state["adapt"]["tracked"] == [1, 2] and state["adapt"]["next_track"] == 4
    assert state["codecs"] and all("generators" in c for c in state["codecs"].values())
    assert STATE in model.state_dict_for_save_checkpoint()  # Megatron-LM's legacy format

    fresh = R.build(seed=1)
    ctl2 = apply(fresh, AUTO)
    assert ctl2.iteration == 0
    fresh.load_state_dict(saved)  # strict
    assert_same_state(ctl2.state_dict(), state)
    assert ctl2.plan == ctl.plan and ctl2.adapter.tracked == [1, 2]
    for m in (model, fresh):  # the same next step: same plan, same codec streams, same weights
        R.seed_all(5)
        _train(m, 1, seed=9)
    assert_same_state(ctl2.state_dict(), ctl.state_dict())
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.usefixtures("megatron_one_rank")
def test_a_checkpoint_without_the_state_loads(caplog):
    old = R.build().state_dict()  # stock: no controller state
    assert STATE not in old
    model = R.build(seed=1)
    ctl = apply(model, ActConfig(plan="compress"))
    _train(model, 1)
    with caplog.at_level(logging.INFO, logger=controller_state.__name__):
        model.load_state_dict(old)  # strict
    assert ctl.iteration == 1  # the controller keeps its own
    assert any("holds no act controller state" in r.getMessage() for r in caplog.records)
    now = model.state_dict()
    for name, value in old.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(now[name], value), name


@pytest.mark.usefixtures("megatron_one_rank")
def test_one_state_per_model_under_wrappers_and_a_second_apply():
    from megatron.core.transformer.module import Float16Module

    model = R.build()
    ctl = apply(model, ActConfig(plan="compress"))
    with pytest.raises(ValueError, match="already converted"):
        apply(model, ActConfig(plan="compress"))
    assert len(controller_state.find(model)) == 1
    _train(model, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # wrapped after apply
    saved = ddp.state_dict()
    assert f"module.{STATE}" in saved and saved[f"module.{STATE}"]["iteration"] == 1
    fresh = R.build(seed=1)
    ctl2 = apply(fresh, ActConfig(plan="compress"))
    torch.nn.parallel.DistributedDataParallel(fresh).load_state_dict(saved)
    assert_same_state(ctl2.state_dict(), ctl.state_dict())

    inner = R.build(dtype=torch.bfloat16)
    wrapped = Float16Module(inner.config, inner)
    ctl3 = apply(wrapped, ActConfig(plan="compress"))  # wrapped before apply: under the wrapper
    assert [type(m).__name__ for m in wrapped.module.children()][-1] == "ControllerState"
    assert controller_state.find(wrapped)[0].controller is ctl3
    assert STATE in wrapped.state_dict() and STATE in wrapped.state_dict_for_save_checkpoint()
    controller_state.remove(wrapped)  # loops that save the controller themselves
    assert STATE not in wrapped.state_dict() and not controller_state.find(wrapped)


@pytest.mark.usefixtures("megatron_one_rank", "dist_ckpt_on_cpu")
def test_dist_checkpointing_round_trip_as_megatron_lm_drives_it(tmp_path, caplog):
    model = R.build()
    ctl = apply(model, AUTO)
    assert controller_state.KEY not in _metadata_of(model)  # a fresh controller: nothing to save
    _train(model, 2)
    state = ctl.state_dict()
    metadata = _save(model, tmp_path / "ours")
    layout = {"world_size": 1, "chunks_per_rank": 1, "tensor": 1, "pipeline": 1, "data": 1, "expert": 1}
    assert metadata[controller_state.KEY] == layout
    obj = model.sharded_state_dict()[STATE]  # this rank's own shard: (rank, chunk) of (world, chunks)
    assert (obj.key, obj.global_shape, obj.global_offset, obj.replica_id) == ("llm_act_controller", (1, 1), (0, 0), 0)
    obj = controller_state.ControllerState(ctl, chunk=1, chunks=2).sharded_state_dict("x.", metadata={})
    assert (obj["x._extra_state"].global_shape, obj["x._extra_state"].global_offset) == ((1, 2), (0, 1))

    fresh = R.build(seed=1)
    ctl2 = apply(fresh, AUTO)
    loaded = _load(fresh, tmp_path / "ours")
    assert STATE in loaded
    assert_same_state(ctl2.state_dict(), state)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name

    # a stock model loads our checkpoint (the object is not requested), strict
    stock = R.build(seed=2)
    assert STATE not in _load(stock, tmp_path / "ours")

    # a checkpoint made without the state: not requested, loads under the default strictness
    _save(R.build(seed=3), tmp_path / "old")
    late = R.build(seed=1)
    ctl3 = apply(late, AUTO)
    with caplog.at_level(logging.INFO, logger=controller_state.__name__):
        assert STATE not in _load(late, tmp_path / "old")
    assert ctl3.iteration == 0
    assert any("holds no act controller state" in r.getMessage() for r in caplog.records)

    # saved under another parallel layout: not requested, and said so
    other = _load_metadata(tmp_path / "ours")
    other[controller_state.KEY] = {**layout, "world_size": 2, "data": 2}
    caplog.clear()
    again = R.build(seed=1)
    ctl4 = apply(again, AUTO)
    with caplog.at_level(logging.INFO, logger=controller_state.__name__):
        assert STATE not in _load(again, tmp_path / "ours", other)
    assert ctl4.iteration == 0
    assert any("another parallel layout" in r.getMessage() for r in caplog.records)


def _metadata_of(model):
    metadata = {}
    model.sharded_state_dict(metadata=metadata)
    return metadata


def _load_metadata(path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_content_metadata(str(path))


def _two_ranks(rank, world, port, path):
    import multiprocessing

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    # dist_checkpointing's writer starts processes; spawn's workers are daemonic
    multiprocessing.current_process()._config["daemon"] = False
    for module, proxy in _dist_ckpt_cpu():
        module.torch = proxy
    T.init_parallel(tp=1, rank=rank, world_size=world, port=port)  # DP=2
    model = R.build()
    ctl = apply(model, ActConfig(plan="compress"))
    _train(model, 2, seed=rank)  # each replica its own data; its codecs draw their own streams
    state = ctl.state_dict()
    _save(model, path)
    # Megatron-LM's default --ckpt-fully-parallel-save: the DP ranks share the writing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper)

    group = ps.get_data_parallel_group(with_context_parallel=True)
    _save(model, path + "_fully_parallel",
          FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group))
    both = [None] * world
    dist.all_gather_object(both, state["codecs"])
    assert any(not torch.equal(both[0][k]["generators"][d], both[1][k]["generators"][d])
               for k in both[0] for d in both[0][k]["generators"]), "the ranks' streams are alike"

    for saved in (path, path + "_fully_parallel"):
        fresh = R.build(seed=1)
        ctl2 = apply(fresh, ActConfig(plan="compress"))
        _load(fresh, saved)
        assert_same_state(ctl2.state_dict(), state, f"rank {rank}")  # its own, not the other's


@pytest.mark.dist
def test_dist_checkpointing_keeps_each_ranks_own_state(tmp_path):
    T.spawn(_two_ranks, 2, str(tmp_path / "ckpt"), timeout=300)
