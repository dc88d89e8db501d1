"""A Hugging Face causal LM's output layer and loss under `output_loss` "chunked" / "auto"
(issue 45, item 2: planned as on megatron-core where the labels go into the model;
`llm_act.patches.deepspeed.hf_output`).

Held to: transformers' own loss (shifted labels, ignored tokens, `num_items_in_batch`) and its
gradients within float32 rounding for each family shape, without the logits' bytes held; every
call without labels, in evaluation left stock; the chunked loss under
ZeRO-3 (the output weight gathered for it); refusals in one line; "auto" handing the planner
the output layer's sizes, and the loss event priced for the mode in force.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from llm_act.config import ActConfig  # noqa: E402
from llm_act.ledger import SavedTensorLedger  # noqa: E402
from llm_act.patches.deepspeed import generic, hf_output  # noqa: E402
from tests.patches.deepspeed.test_hf_auto import _model  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

SEQ, VOCAB = 32, 256


def _prompted_batch():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :5] = hf_output.IGNORE_INDEX  # a prompt left out of the loss
    return ids, labels


def _labelled_step(model, **kw):
    tokens, labels = _prompted_batch()
    model.zero_grad(set_to_none=True)
    with SavedTensorLedger() as ledger:
        out = model(input_ids=tokens, labels=labels, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}, sum(ledger.by_site().values())


def _within(a, b, tol):
    return float((a - b).abs().max()) <= tol * float(b.abs().max())


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_chunked_is_transformers_loss_without_the_logits(kind):
    stock = _model(kind)
    generic.apply(stock, ActConfig(plan="keep"))
    model = _model(kind)
    handle = generic.apply(model, ActConfig(plan="keep", output_loss="chunked", output_chunk_tokens=16))
    assert handle.controller.output.mode == "chunked"
    for kw in ({}, {"num_items_in_batch": torch.tensor(50)}):
        ref, ref_grads, ref_held = _labelled_step(stock, **kw)
        out, grads, held = _labelled_step(model, **kw)
        assert out.logits is None
        assert torch.allclose(out.loss, ref.loss, rtol=1e-6, atol=0), (float(out.loss), float(ref.loss))
        assert all(_within(grads[n], ref_grads[n], 1e-5) for n in ref_grads)
        tokens = 2 * SEQ
        # stock's fp32 log-probabilities of every token are not held (the rest: a few bytes a token,
        # the loss's targets and masks against one fp32 log-sum-exp per token)
        assert abs((ref_held - held) - tokens * VOCAB * 4) < 8 * tokens, (ref_held, held)
    # the loss event priced as one chunk's logits and their gradient
    assert handle.controller.loss_event_bytes == 2 * 4 * 16 * VOCAB


def test_other_calls_stay_stock():
    model = _model("llama")
    generic.apply(model, ActConfig(plan="keep", output_loss="chunked"))
    tokens, labels = _prompted_batch()
    assert model(input_ids=tokens).logits.shape == (2, SEQ, VOCAB)  # no labels
    model.eval()
    with torch.no_grad():
        out = model(input_ids=tokens, labels=labels)
    assert out.logits.shape == (2, SEQ, VOCAB) and torch.isfinite(out.loss)
    assert "forward" not in vars(model.get_output_embeddings())  # the layer is put back after each call


def test_refusals_are_one_line_and_auto_stays_stock_there():
    net = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)]))
    with pytest.raises(ValueError, match="output_loss 'chunked': Sequential is not a Hugging Face causal LM") as caught:
        generic.apply(net, ActConfig(plan="keep", output_loss="chunked"))
    assert "\n" not in str(caught.value)
    model = _model("llama")
    model.loss_type = "ForMaskedLM"  # what transformers reads (from config.loss_type at build)
    with pytest.raises(ValueError, match="loss is not transformers' ForCausalLMLoss") as caught:
        generic.apply(model, ActConfig(plan="keep", output_loss="chunked"))
    assert "\n" not in str(caught.value)
    model = _model("llama")
    model.loss_type = "ForMaskedLM"  # what transformers reads (from config.loss_type at build)
    assert generic.apply(model, ActConfig(plan="auto", output_loss="auto")).controller.output is None


def test_zero3_gathers_the_output_weight_for_the_chunked_loss(megatron_one_rank):
    from tests.patches.deepspeed.test_hf_auto import _auto_engine, _token_pair
    from tests.test_budget_doors import _ds_env

    _ds_env()
    losses = {}
    for mode in ("stock", "chunked"):
        engine = _auto_engine("llama", {"plan": "keep", "output_loss": mode}, stage=3)
        losses[mode] = []
        for step in range(2):
            tokens, labels = _token_pair(step)
            loss = engine(input_ids=tokens, labels=labels).loss
            engine.backward(loss)
            engine.step()
            losses[mode].append(float(loss))
    assert losses["chunked"] == pytest.approx(losses["stock"], rel=1e-5), losses


def test_auto_hands_the_planner_the_output_layer(megatron_one_rank):
    from tests.patches.deepspeed.test_hf_auto import LOOSE, _auto_engine, _steps
    from tests.test_budget_doors import _ds_env

    _ds_env()
    engine = _auto_engine("llama", {"plan": "auto", "output_loss": "auto", "budget": LOOSE})
    _steps(engine, 2)
    c = engine.act_controller
    sizes = c.output.sizes()
    assert (sizes.tokens, sizes.hidden, sizes.vocab_local) == (2 * 32, 64, VOCAB)
    decision = c.adapter.output_decision
    assert decision is not None and decision["choice"] in ("stock", "chunked")
    assert c.output.mode == decision["choice"]
