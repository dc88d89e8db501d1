"""Megatron-core GPT layers recomputed through DeepSpeed's activation checkpointing.

With `"activation_checkpointing"` in the DeepSpeed config and plan "recompute", every
TransformerLayer's forward runs under `deepspeed.checkpointing` (its `CheckpointFunction`
is counted: one call per layer per step) and the losses equal the stock run's, dropout on
(megatron's RNG tracker is replayed in the recomputation; the attention is kept "stock" so
both runs draw the same masks), under ZeRO-2 and ZeRO-3 on 2 gloo ranks with their own data.
Per-site recompute stays on llm_act's regions, or is refused when DeepSpeed partitions or
offloads checkpoints; plan switches are routed the same way.
"""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

from tests.testing import spawn  # noqa: E402

SEED = 1234
STEPS = 3
LAYERS = 2
VOCAB, SEQ, BATCH = 64, 16, 2
MIXED = {"mlp.fc2_input": "recompute"}  # one site recomputed alone: llm_act's regions


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    from tests import testing

    deepspeed.init_distributed(dist_backend="gloo")
    testing.init_parallel(rank=rank, world_size=world, seed=SEED)


def _reseed(seed=SEED):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)  # megatron's tracker (attention dropout)
    torch.manual_seed(seed)


def _gpt(dropout):
    from tests import testing

    _reseed()
    config = testing.small_config(hidden_size=32, num_attention_heads=4, num_layers=LAYERS,
                                  dropout=dropout)
    # untied output layer: under ZeRO-3 a shared weight is gathered only by its owner
    return testing.gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                             share_embeddings_and_output_weights=False)


def _ds(stage, section=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           # torch_adam: torch's AdamW, no FusedAdam op to build on CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6, **extra}
    if section is not None:
        cfg["activation_compression"] = section
    return cfg


def _batches(rank):
    from tests import testing

    g = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    return [testing.gpt_batch(BATCH, SEQ, VOCAB, generator=g) for _ in range(STEPS)]


def _run(ds, batches, dropout):
    """(losses, saved bytes of the first forward, engine)."""
    from llm_act.ledger import SavedTensorLedger
    from llm_act.patches.deepspeed import initialize

    model = _gpt(dropout)
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=ds)
    _reseed(SEED + 1)  # both runs start dropout from the same states
    losses, saved = [], None
    for tokens, position_ids, labels in batches:
        with SavedTensorLedger() as ledger:
            loss = engine(tokens, position_ids, None, labels=labels).float().mean()
        saved = ledger.total_bytes if saved is None else saved
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, saved, engine


class _Counter:
    """Counts calls of DeepSpeed's CheckpointFunction.forward (patched while in use)."""

    def __enter__(self):
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

        self.cls, self.original, self.calls = ds_ckpt.CheckpointFunction, ds_ckpt.CheckpointFunction.forward, 0

        def counting(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        self.cls.forward = staticmethod(counting)
        return self

    def __exit__(self, *exc):
        self.cls.forward = staticmethod(self.original)


def _owners(engine):
    from llm_act.patches.deepspeed import megatron_recompute

    owners = megatron_recompute.owners(engine.module)
    assert len(owners) == LAYERS
    return owners


def _worker(rank, world, port):
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    _init(rank, world, port)
    batches = _batches(rank)
    recompute = {"plan": "recompute", "attention": "stock"}
    for stage in (2, 3):
        ref, ref_saved, _ = _run(_ds(stage), batches, dropout=0.1)
        with _Counter() as counter:
            losses, saved, engine = _run(_ds(stage, recompute, activation_checkpointing={}),
                                         batches, dropout=0.1)
        assert ds_ckpt.is_configured() and engine.zero_optimization_stage() == stage
        assert counter.calls == LAYERS * STEPS, (stage, counter.calls)  # every layer, every step
        assert all(o.through_deepspeed and o.mode == "full" for o in _owners(engine))
        assert all(choice["attn.out"] == "recompute" for choice in engine.act_controller.plan.values())
        assert losses == pytest.approx(ref, rel=1e-6, abs=1e-6), (stage, losses, ref)
        assert saved < 0.25 * ref_saved, (saved, ref_saved)  # block inputs only (and logits)

    # the default memory-efficient attention (SDPA, dropout off): same losses
    ref, _, _ = _run(_ds(2), batches, dropout=0.0)
    with _Counter() as counter:
        losses, _, _ = _run(_ds(2, {"plan": "recompute"}, activation_checkpointing={}), batches,
                            dropout=0.0)
    assert counter.calls == LAYERS * STEPS
    assert losses == pytest.approx(ref, rel=1e-5)

    # a mixed plan stays on llm_act's regions (partition_activations / cpu_checkpointing off)
    ref, _, _ = _run(_ds(2), batches, dropout=0.1)
    with _Counter() as counter:
        losses, _, engine = _run(_ds(2, {"plan": "keep", "codecs": MIXED, "attention": "stock"},
                                     activation_checkpointing={}), batches, dropout=0.1)
    assert counter.calls == 0
    assert all(o.mode == "sites" and not o.through_deepspeed for o in _owners(engine))
    assert losses == pytest.approx(ref, rel=1e-6, abs=1e-6)


@pytest.mark.dist
def test_megatron_layers_through_deepspeed_checkpointing_zero2_zero3():
    spawn(_worker, 2, timeout=300)


def _refusals(rank, world, port):
    from llm_act.config import ActConfig
    from llm_act.patches.deepspeed import ds_config, initialize, megatron_recompute

    _init(rank, world, port)

    def refused(section, checkpointing, match):
        model = _gpt(0.0)
        with pytest.raises(ValueError, match=match):
            initialize(model=model, model_parameters=model.parameters(),
                       config=_ds(2, section, activation_checkpointing=checkpointing))
        # refused before anything changed
        assert not any(hasattr(m, "_llm_act_controller") or hasattr(m, "act_recompute")
                       for m in model.modules())

    for option in ("partition_activations", "cpu_checkpointing"):
        for section in ({"plan": "keep", "codecs": MIXED},  # a site alone
                        {"plan": "recompute", "codecs": {"ln1.input": "int8"}}):  # CB1
            refused(section, {option: True}, rf"activation_checkpointing\.{option} = true.*"
                                             rf"set {option} to false")
        # the whole block goes through DeepSpeed, which refuses these on its CPU accelerator
        refused({"plan": "recompute"}, {option: True}, "CPU accelerator")

    # routing follows plan switches; the block from an encoded input stays on our regions
    ckpt = ds_config.checkpointing({"activation_checkpointing": {}})
    model = _gpt(0.0)
    ctl = megatron_recompute.apply(model, ActConfig(plan="recompute", codecs={"ln1.input": "int8"}), ckpt)
    owners = megatron_recompute.owners(model)
    assert all(o.mode == "full" and not o.through_deepspeed for o in owners)
    ctl.set_plan("recompute")  # nothing drives iterations yet: applied at once
    assert all(o.mode == "full" and o.through_deepspeed for o in owners)
    ctl.set_plan({0: MIXED, 1: ctl.plan[1]})
    assert owners[0].mode == "sites" and not owners[0].through_deepspeed
    assert owners[1].through_deepspeed
    ctl.set_plan("keep")
    assert not any(o.through_deepspeed for o in owners)
    assert not any("forward" in o.layer.__dict__ for o in owners)  # the stock forward again

    # with partition_activations set, a switch that cannot work is refused and the plan stays
    strict = ds_config.checkpointing({"activation_checkpointing": {"partition_activations": True}})
    model = _gpt(0.0)
    ctl = megatron_recompute.apply(model, ActConfig(plan="keep"), strict)
    for plan, match in (({0: MIXED}, "partition_activations = true"), ("recompute", "CPU accelerator")):
        with pytest.raises(ValueError, match=match):
            ctl.set_plan(plan)
        assert ctl.plan[0]["mlp.fc2_input"] == "keep"
        assert all(o.mode == "none" for o in megatron_recompute.owners(model))

def test_refusals_and_plan_switches():
    spawn(_refusals, 1, timeout=180)
