"""Per-site recompute on Hugging Face family blocks (issue 45, item 2): `attn.qkv_input` and
`mlp.fc1_input` rebuilt in backward by replaying the norm that made them
(`llm_act.patches.deepspeed.hf_replay`).

Held to: stock's loss and gradients bit for bit where the norm's input is kept (fp32 and bf16,
every family shape: RMSNorm, qk-norm, LayerNorm), nothing held at the two sites; the rebuild
reads the input site's stored value (encoded: the decoded one); a tensor at the site that is
not the norm's output kept raw; the plans a block cannot bind refused in one line; "auto"
offered exactly these two sites alone, with their measured norm times; ZeRO-3's partitioned
norm weights gathered for the replay.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from llm_act.config import ActConfig  # noqa: E402
from llm_act.ledger import SavedTensorLedger  # noqa: E402
from llm_act.patches.deepspeed import generic  # noqa: E402
from llm_act.plan import keep_layer  # noqa: E402
from tests.patches.deepspeed import test_hf_auto  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

REPLAYED = ("attn.qkv_input", "mlp.fc1_input")


def _built(kind, dtype=torch.float32):
    return test_hf_auto._model(kind).to(dtype)


def _grads_held(model):
    """(loss, {parameter: grad}, {(layer, site): bytes held}) of one forward and backward."""
    tokens, labels = test_hf_auto._token_pair(5)
    model.zero_grad(set_to_none=True)
    with SavedTensorLedger() as ledger:
        loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, ledger.by_site()


def _replaying(layer=None, **codecs):
    return {**(layer or keep_layer()), **dict.fromkeys(REPLAYED, "recompute"), **codecs}


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen3", torch.float32), ("gpt2", torch.float32)])
def test_replaying_a_kept_norm_input_is_stock_bit_for_bit_and_holds_nothing_there(kind, dtype):
    stock_loss, stock_grads, _ = _grads_held(_built(kind, dtype))
    model = _built(kind, dtype)
    c = generic.apply(model, ActConfig(plan="auto")).controller
    c.set_plan("keep")
    _, _, kept = _grads_held(model)  # stock's bytes, booked by site
    c.set_plan({i: _replaying() for i in c.layers})
    loss, grads, held = _grads_held(model)
    assert torch.equal(loss, stock_loss)
    assert all(torch.equal(grads[n], stock_grads[n]) for n in stock_grads)
    assert all(kept[(i, s)] > 0 for i in c.layers for s in REPLAYED)  # stock holds them
    assert not any(site in REPLAYED for (_, site) in held), held  # the replay nothing
    # everything else held as under plan "keep" (the norms' own inputs included)
    assert {k: n for k, n in kept.items() if k[1] not in REPLAYED} == held


def test_the_replay_reads_the_value_the_input_site_stores():
    """ln1.input and ln2.input in INT8: the norms replay on the decoded values, so the
    projections' weight gradients move from stock, by a small relative error, and the forward
    is stock's."""
    stock_loss, stock_grads, _ = _grads_held(_built("llama"))
    model = _built("llama")
    c = generic.apply(model, ActConfig(plan="auto")).controller
    c.set_plan({i: _replaying(**{"ln1.input": "int8", "ln2.input": "int8"}) for i in c.layers})
    loss, grads, held = _grads_held(model)
    assert torch.equal(loss, stock_loss)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        err = float((grads[name] - stock_grads[name]).norm() / stock_grads[name].norm())
        assert 0 < err < 0.05, (name, err)
    assert not any(site in REPLAYED for (_, site) in held)


def test_a_tensor_at_a_replayed_site_that_is_not_the_norms_output_is_kept_raw():
    """An adapter that feeds q_proj its own copy (as LoRA's dropout would): that copy is kept
    and booked at attn.qkv_input; k and v still replay; the gradients are exact."""
    def copying(model):
        for layer in model.model.layers:
            layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: (args[0] * 1.0,))
        return model

    stock_loss, stock_grads, _ = _grads_held(copying(_built("llama")))
    model = copying(_built("llama"))
    c = generic.apply(model, ActConfig(plan="auto")).controller
    c.set_plan({i: _replaying() for i in c.layers})
    loss, grads, held = _grads_held(model)
    assert torch.equal(loss, stock_loss) and all(torch.equal(grads[n], stock_grads[n]) for n in grads)
    copy_bytes = 2 * test_hf_auto.SEQ * 64 * 4  # q_proj's input copy, fp32
    assert all(held[(i, "attn.qkv_input")] == copy_bytes for i in c.layers), held
    assert not any((i, "mlp.fc1_input") in held for i in c.layers)


def test_plans_a_block_cannot_bind_are_refused_in_one_line():
    model = _built("llama")
    c = generic.apply(model, ActConfig(plan="auto")).controller
    # a site only the whole block rebuilds, and a replayed norm's own input (which must store a value)
    for site in ("mlp.fc2_input", "ln2.input"):
        with pytest.raises(ValueError, match=rf"cannot recompute \['{site}'\] alone: it recomputes only "
                                             r"attn.qkv_input, mlp.fc1_input alone") as caught:
            c.set_plan({i: _replaying(**{site: "recompute"}) for i in c.layers})
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"cannot recompute \['mlp.fc2_input'\] alone \(it rebuilds only "
                                         "attn.qkv_input, mlp.fc1_input alone") as caught:
        generic.apply(_built("llama"), ActConfig(plan="compress", codecs={"mlp.fc2_input": "recompute"}))
    assert "\n" not in str(caught.value)


def test_a_named_plan_takes_the_replayed_sites_from_its_codecs():
    stock_loss, _, _ = _grads_held(_built("qwen3"))
    model = _built("qwen3")
    handle = generic.apply(model, ActConfig(plan="compress", codecs=dict.fromkeys(REPLAYED, "recompute")))
    assert all(handle.controller.binder(i).recompute_scope() == "fixed" for i in handle.controller.layers)
    loss, _, held = _grads_held(model)
    assert abs(float(loss - stock_loss)) < 1e-6
    assert not any(site in REPLAYED for (_, site) in held) and len(held) > 10


def test_auto_offers_the_two_sites_alone_with_their_norms_times(megatron_one_rank):
    from tests.patches.deepspeed.test_hf_auto import _auto_engine, _steps, one_rank  # noqa: F401
    from tests.test_budget_doors import _ds_env

    _ds_env()
    engine = _auto_engine("llama", {"plan": "auto", "budget": 10**9})
    _steps(engine, 1)
    c = engine.act_controller
    assert all(c.binder(i).recompute_scope() == "sites" for i in c.layers)
    profile = c.adapter.measured.profile
    for i in c.layers:
        offered = {site for (layer, site) in profile.sites if layer == i and profile.recomputable(i, site)}
        assert offered == set(REPLAYED), offered
    assert all(profile.sites[(0, s)].forward_ms > 0 for s in REPLAYED)
    assert profile.block_ms  # whole-block recompute still offered


def test_zero3_gathers_the_norm_weights_for_the_replay(megatron_one_rank):
    """ZeRO-3 partitions the norms' weights; the replay in backward calls the norm as a module,
    so DeepSpeed gathers them: two steps equal plan "keep"'s bit for bit."""
    from tests.patches.deepspeed.test_hf_auto import _auto_engine, _token_pair
    from tests.test_budget_doors import _ds_env

    _ds_env()
    losses = {}
    for name, codecs in (("keep", {}), ("replay", dict.fromkeys(REPLAYED, "recompute"))):
        engine = _auto_engine("llama", {"plan": "keep", "codecs": codecs}, stage=3)
        assert all(engine.act_controller.plan[i]["attn.qkv_input"] == codecs.get("attn.qkv_input", "keep")
                   for i in engine.act_controller.layers)
        losses[name] = []
        for step in range(2):
            tokens, labels = _token_pair(step)
            with SavedTensorLedger() as ledger:
                loss = engine(input_ids=tokens, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.detach())
            held = {site for (_, site) in ledger.by_site()}
            assert (set(REPLAYED) <= held) == (name == "keep"), held
    assert all(torch.equal(a, b) for a, b in zip(losses["keep"], losses["replay"])), losses
