"""Plan "auto" on Hugging Face decoders under DeepSpeed (issue 45, item 2): the blocks are
measured from the real steps (the generic hooks book each saved tensor at its family's site,
so the capture pass and the ledger see every site), planned under the budget, re-planned at
growing intervals and logged; agreed on every rank under ZeRO 1, 2 and 3.

One gloo rank (ZeRO-0) in the default run for a Llama and a Qwen3; two gloo ranks, each with
its own data, at ZeRO-3 in the default run and ZeRO-1 and -2 `slow`. Also: `use_cache` in
training (absorbed, or refused in one line) and the decoders `hf_decoder` builds.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from llm_act.ledger import SavedTensorLedger  # noqa: E402
from llm_act.patches.deepspeed import hf_decoder, hf_families  # noqa: E402
from llm_act.planner.hf_config import HFConfigError  # noqa: E402
from llm_act.runtime.adapt import BudgetTooSmall  # noqa: E402
from tests.testing import spawn  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

LOOSE = 10**9
STEPS = 4
SEQ = 32


def _model(kind):
    return hf_decoder.build(kind, hidden_size=64, num_layers=2, max_positions=64, seed=7)


def _ds_config(section, stage=0, **zero):
    """`zero`: further `zero_optimization` settings."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, **zero}, "steps_per_print": 10**6,
            "activation_compression": section}


def _auto_engine(kind, section, stage=0, **zero):
    from llm_act.patches.deepspeed import initialize

    model = _model(kind)
    return initialize(model=model, model_parameters=model.parameters(),
                      config=_ds_config(section, stage, **zero))[0]


def _token_pair(seed, seq=SEQ):
    ids = torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _steps(engine, steps, rank=0):
    """`steps` training steps, the labels into the model (its own loss)."""
    for i in range(steps):
        tokens, labels = _token_pair(1000 * rank + i)
        engine.backward(engine(input_ids=tokens, labels=labels).loss)
        engine.step()


def _block_bytes(engine) -> int:
    """Bytes one training forward holds for backward in the blocks under the plan in force
    (the embedding's and the logits' are the same under every plan)."""
    tokens, labels = _token_pair(99)
    with SavedTensorLedger() as ledger:
        loss = engine(input_ids=tokens, labels=labels).loss
    engine.backward(loss)
    engine.optimizer.zero_grad()
    return sum(n for (layer, _), n in ledger.by_site().items() if layer is not None)


def _smallest(kind, stage=0) -> int:
    """1% above the smallest budget "auto" accepts, as the first tracking point's refusal
    names it (a later point's measured figures move a little)."""
    with pytest.raises(BudgetTooSmall) as caught:
        _steps(_auto_engine(kind, {"plan": "auto", "budget": 1}, stage), 1)
    assert "\n" not in str(caught.value)
    return int(caught.value.min_budget_bytes * 1.01)


# ---- one rank --------------------------------------------------------------------------------


@pytest.fixture
def one_rank(megatron_one_rank):
    from tests.test_budget_doors import _ds_env

    _ds_env()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_auto_measures_replans_and_meets_the_budget(one_rank, kind, caplog):
    smallest = _smallest(kind)
    stored, controllers = {}, {}
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        for budget in (smallest, LOOSE):
            engine = _auto_engine(kind, {"plan": "auto", "budget": budget})
            _steps(engine, STEPS)
            c = engine.act_controller
            assert c.adapter.tracked == [1, 2, 4] and c.adapter.solver_failures == 0
            assert c.adapter.round.skipped == []  # no tracking point failed
            assert c.history and c.history[0]["reason"] == "first plan"
            assert all(h["predicted_bytes"] <= budget for h in c.history)
            stored[budget], controllers[budget] = _block_bytes(engine), c
    # measured from the real step: every site the family books has its codecs' figures
    profile = controllers[LOOSE].adapter.measured.profile
    sites = {site for (_, site) in profile.sites}
    assert {"ln1.input", "attn.qkv_input", "attn.q", "attn.k", "attn.v", "attn.out", "ln2.input",
            "mlp.fc1_input", "mlp.act_input", "mlp.fc2_input"} <= sites
    if kind == "qwen3":
        assert {"attn.q_norm_input", "attn.k_norm_input"} <= sites
    assert all(st.keep_bytes > 0 and "int4" in st.options for st in profile.sites.values())
    # the loose budget keeps more than the tight one stores, and the tight plan compresses
    assert stored[LOOSE] > 2 * stored[smallest], stored
    tight = controllers[smallest].plan
    assert any(choice not in ("keep", None) for layer in tight.values() for choice in layer.values())
    text = caplog.text
    assert "plan in force at the start ('auto' starts from 'compress'" in text
    assert "iteration 1: plan changed" in text and "measures and re-plans megatron-core" not in text


def _loss_grads(model, tokens, labels):
    model.zero_grad(set_to_none=True)
    with SavedTensorLedger() as ledger:
        loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, ledger.by_site()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_auto_switches_blocks_to_whole_recompute_and_back(kind):
    """Under plan "auto" a block recomputes whole exactly when the plan in force says so:
    with the block input kept, loss and gradients are stock's bit for bit and the block holds
    only its input; with it encoded, only the encoding; back on codecs, every site again."""
    from llm_act.config import ActConfig
    from llm_act.patches.deepspeed import generic
    from llm_act.plan import VALUE_ACT_CODEC, compress_layer, keep_layer, recompute_layer

    tokens, labels = _token_pair(5)
    stock, stock_grads, _ = _loss_grads(_model(kind), tokens, labels)
    model = _model(kind)
    handle = generic.apply(model, ActConfig(plan="auto"))
    c = handle.controller
    assert all(c.binder(i).recompute_scope() == "sites" for i in c.layers)  # whole, or the norms' outputs
    c.set_plan("keep")
    loss, grads, kept = _loss_grads(model, tokens, labels)
    assert torch.equal(loss, stock) and all(torch.equal(grads[n], stock_grads[n]) for n in grads)
    block_input = {i: n for (i, site), n in kept.items() if site == "ln1.input"}
    for checkpoint in ("keep", "int8"):
        c.set_plan({i: recompute_layer(checkpoint) for i in c.layers})
        loss, grads, held = _loss_grads(model, tokens, labels)
        blocks = {key: n for key, n in held.items() if key[0] is not None}
        assert set(blocks) == {(i, "ln1.input") for i in c.layers}, blocks  # nothing else is held
        if checkpoint == "keep":
            assert torch.equal(loss, stock)
            assert all(torch.equal(grads[n], stock_grads[n]) for n in grads)
            assert all(blocks[(i, "ln1.input")] <= block_input[i] for i in c.layers)
        else:
            assert all(4 * blocks[(i, "ln1.input")] < block_input[i] * 1.5 for i in c.layers)
            assert abs(float(loss - stock)) < 1e-6  # forward runs uncompressed
    c.set_plan({0: recompute_layer("keep"), 1: {**compress_layer(), "mlp.act_input": VALUE_ACT_CODEC}})
    _, _, held = _loss_grads(model, tokens, labels)
    assert {site for (i, site) in held if i == 0} == {"ln1.input"}
    assert len({site for (i, site) in held if i == 1}) > 5
    with pytest.raises(ValueError, match="and every other site only with the whole block"):
        c.set_plan({0: {**keep_layer(), "mlp.fc2_input": "recompute"}, 1: keep_layer()})


def test_a_deep_model_at_the_smallest_budget_recomputes_whole_blocks(one_rank, monkeypatch):
    """12 blocks: below what any codec plan fits, "auto" recomputes blocks whole (their
    input encoded), and what a forward holds in the blocks is their inputs alone."""
    deep = lambda kind: hf_decoder.build(kind, hidden_size=64, num_layers=12, max_positions=64, seed=7)  # noqa: E731
    monkeypatch.setattr(sys.modules[__name__], "_model", deep)
    budget = _smallest("llama")
    engine = _auto_engine("llama", {"plan": "auto", "budget": budget})
    _steps(engine, STEPS)
    c = engine.act_controller
    whole = [i for i in c.layers if c.binder(i).recompute]
    assert whole and all(c.plan[i]["mlp.fc2_input"] == "recompute" for i in whole)
    assert all(h["predicted_bytes"] <= budget for h in c.history)
    tokens, labels = _token_pair(7)
    with SavedTensorLedger() as ledger:
        loss = engine(input_ids=tokens, labels=labels).loss
    engine.backward(loss)
    held = {site for (i, site) in ledger.by_site() if i in whole}
    assert held == {"ln1.input"}, held


def test_a_block_missing_a_declared_submodule_is_refused_in_one_line():
    from llm_act.config import ActConfig
    from llm_act.patches.deepspeed import generic

    model = _model("qwen3")
    del model.model.layers[1].self_attn.k_norm
    with pytest.raises(ValueError, match=r"block 1 \(Qwen3DecoderLayer\) has no self_attn.k_norm, which the "
                                         "qwen3 site table declares") as caught:
        generic.apply(model, ActConfig(plan="auto"))
    assert "\n" not in str(caught.value)


def test_use_cache_is_off_in_training_and_refused_when_asked(one_rank, caplog):
    engine = _auto_engine("llama", {"plan": "compress"})
    model = engine.module
    tokens, labels = _token_pair(0)
    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        for _ in range(2):
            engine.backward(hf_decoder.lm_loss(engine, tokens, labels))  # the loss from the logits
    said = [r.getMessage() for r in caplog.records if "without labels" in r.getMessage()]
    assert len(said) == 1 and "LlamaForCausalLM" in said[0] and "\n" not in said[0]
    out = engine(input_ids=tokens, labels=labels)
    assert out.past_key_values is None  # the config's use_cache=True did not hold k and v
    engine.backward(out.loss)
    with pytest.raises(ValueError, match="use_cache=True in a training forward") as caught:
        engine(input_ids=tokens, labels=labels, use_cache=True)
    assert "\n" not in str(caught.value)
    model.eval()
    with torch.no_grad():
        assert engine(input_ids=tokens, use_cache=True).past_key_values is not None  # evaluation keeps it


# ---- the decoders hf_decoder builds -----------------------------------------------------------


@pytest.mark.parametrize("kind", hf_decoder.KINDS)
def test_build_makes_each_family_with_a_table(kind):
    model = _model(kind)
    hf = hf_families.hf_model(model)
    assert hf.config.model_type == kind and model.training
    from llm_act.patches.deepspeed import generic

    assert hf_families.family_of(hf, generic.repeated_blocks(model)[0]) is hf_families.FAMILIES[kind]


def test_from_config_file_builds_what_the_file_says_and_refuses_what_cannot_be_planned(tmp_path):
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 300,
           "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
           "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = hf_decoder.from_config_file(path, vocab_size=256)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_hidden_layers == 3
    assert model.config.vocab_size == 256 and next(model.parameters()).dtype == torch.float32
    path.write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(HFConfigError, match="attn_logit_softcapping is set") as caught:
        hf_decoder.from_config_file(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(HFConfigError, match="model_type 'bert'"):
        path.write_text(json.dumps({**cfg, "model_type": "bert"}))
        hf_decoder.from_config_file(path)


# ---- two ranks -------------------------------------------------------------------------------


def _join(rank, world, port):
    """This process as rank `rank` of a gloo group of `world`, one torch thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)


def _zero_worker(rank, world, port, kind, stage):
    import torch.distributed as dist

    _join(rank, world, port)
    smallest = _smallest(kind, stage)
    engine = _auto_engine(kind, {"plan": "auto", "budget": smallest}, stage)
    _steps(engine, STEPS, rank)  # each rank its own data: their measurements differ
    c = engine.act_controller
    assert c.adapter.tracked == [1, 2, 4] and c.adapter.round.skipped == []
    assert all(h["predicted_bytes"] <= smallest for h in c.history)
    seen = [None] * world
    dist.all_gather_object(seen, (smallest, c.plan, [h["changes"] for h in c.history]))
    assert seen[0] == seen[1], "the ranks run different plans"
    tight = _block_bytes(engine)
    loose = _auto_engine(kind, {"plan": "auto", "budget": LOOSE}, stage)
    _steps(loose, 2, rank)
    assert _block_bytes(loose) > 2 * tight


@pytest.mark.dist
@pytest.mark.parametrize("stage", [3, pytest.param(1, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["qwen3", pytest.param("llama", marks=pytest.mark.slow)])
def test_auto_agrees_under_zero_on_two_ranks(kind, stage):
    spawn(_zero_worker, 2, kind, stage, timeout=400)


def _ragged_worker(rank, world, port):
    """Each rank its own sequence length at the last tracking point (dynamic padding): rank 1's
    shapes move there, rank 0's do not."""
    import torch.distributed as dist

    _join(rank, world, port)
    # no persistence threshold: every weight is gathered in forward
    engine = _auto_engine("qwen3", {"plan": "auto", "budget": LOOSE}, 3, stage3_param_persistence_threshold=0)
    forwards = []  # every forward of the model: the training steps' and the measuring passes'
    engine.module.register_forward_pre_hook(lambda module, args: forwards.append(1))
    for i in range(STEPS):
        tokens, labels = _token_pair(1000 * rank + i, SEQ - 8 if (rank == 1 and i == STEPS - 1) else SEQ)
        engine.backward(engine(input_ids=tokens, labels=labels).loss)
        engine.step()
    c = engine.act_controller
    assert c.adapter.tracked == [1, 2, 4] and c.adapter.round.skipped == []
    seen = [None] * world
    dist.all_gather_object(seen, (len(forwards), c.plan, [h["changes"] for h in c.history]))
    assert seen[0][0] == seen[1][0], f"forwards per rank: {seen[0][0]} and {seen[1][0]}"
    assert seen[0] == seen[1], "the ranks run different plans"


@pytest.mark.dist
def test_auto_measures_alike_when_one_rank_changes_shape_under_zero3():
    """A tracking point where only one rank's batch has a new sequence length: that rank cannot
    reuse its last profile, and its measuring forward gathers ZeRO-3's parameters; every rank
    then measures alike (the choice is agreed), so none waits for a collective the other
    never makes."""
    spawn(_ragged_worker, 2, timeout=400)
