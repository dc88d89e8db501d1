"""One memory model, checked against an independent measurement (issue 27, item 3).

The planner prices a plan's activation memory as its stored bytes plus the larger of the end
of forward (`analytic.loss_bytes`: the logits, the loss's bookkeeping, the output layer's
backward) and the heaviest block backward (its rebuilt and decoded tensors plus
`BlockProfile.grad_bytes`, the gradients in flight: `analytic.grad_bytes`, set by
`block_profile(..., gradients=True)`). Here that prediction (`evaluate_plan` on the analytic
profile, `DeviceModel.cpu()`) is compared with the peak of live tensor storage over one
training step -- forward, loss and backward -- of a small megatron-core GPT on CPU, measured by
`llm_act.measurement.peak_memory.LiveStorageTracker` above the step's entry state (weights,
their gradients kept allocated and zeroed in place, the batch; after one warm-up step), with
the codec kernels opaque (`inside_custom_ops=False`: on a GPU each is one kernel, and the CPU
references' fp32 temporaries are not what a GPU holds).

Model: 2 layers, hidden 256, 8 heads, sequence 128, micro-batch 2, vocabulary 1024, bf16,
RoPE, biases, untied embeddings, one thread, dropout 0 (with dropout the CPU "auto" attention
is the chunked backend, whose transients are not modelled). At this size every term matters:
the loss event binds "keep" and the last "auto" plan, the core attention's backward binds
"selective", the MLP's backward binds "full" recompute; a model without either term, or the
old one, misses by more than 3% (`test_a_wrong_model_fails`).

Plans: stock ("keep", stock attention), Megatron's "selective" (stock attention, the softmax
recomputed), "full" recompute and "compress" (both on the memory-efficient attention), and
"auto": `solve_plan` on the analytic profile at a quarter, half and three quarters of the way
from full recompute's memory to stock's, applied as fixed JSON plans.

"compress" is within 3% but not by its own event: its measured peak is the forward encode of
the last block's fc2 input (the CPU reference codec draws fp32 noise, 4 bytes an element,
beside the raw input and the residual stream the layer's frames hold), which the model has
no term for; its backward term (the q/k/v/out decode group with the fc2 stage's gradients)
lies 1.8% above it.

Known limit (`xfail`, strict: a fix of the planner's transient turns them into passes to
un-mark): the planner counts a block's transient as all its recomputed sites plus its largest
decode group plus `grad_bytes`, at once. A plan that rebuilds or decodes sites of different
backward stages (V decoded for the attention, fc2's input recomputed for the MLP) is priced
with both; a decoded site's code, freed when it is decoded, stays counted; and `grad_bytes`
holds the block output that only a whole-block recompute rebuilds (a per-site plan is over
by s*b*h*e). All over-count -- the prediction stays above the measurement,
`test_the_model_never_under_predicts` -- here by 4.7% and 8.3% for the first two budgets.

Run with `-s` for the table.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import warnings

import pytest
import torch

pytest.importorskip("pulp")

from llm_act import ActConfig  # noqa: E402
from llm_act import _testing as T  # noqa: E402
from llm_act.measurement.peak_memory import LiveStorageTracker  # noqa: E402
from llm_act.plan import compress_layer, keep_layer, recompute_layer, selective_layer  # noqa: E402
from llm_act.planner import evaluate_plan, solve_plan  # noqa: E402
from llm_act.planner.analytic import (DeviceModel, ModelShape, block_profile, grad_bytes,  # noqa: E402
                                      loss_bytes, outer_bytes)

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

LAYERS, H, A, S, B, V = 2, 256, 8, 128, 2, 1024
F = 4 * H
E = 2  # bf16
TOKENS = S * B
DEVICE = DeviceModel.cpu()
TOLERANCE = 0.03
FIXED = {  # name: (profile attention, analytic choice, ActConfig)
    "keep": ("stock", keep_layer(), dict(plan="keep")),
    "selective": ("stock", selective_layer(), dict(plan="selective", attention="stock")),
    "full": ("auto", recompute_layer(), dict(plan="recompute")),
    "compress": ("auto", compress_layer(), dict(plan="compress")),
}
AUTO = (0.25, 0.5, 0.75)  # of the way from full recompute's memory to stock's


def _shape(attention: str) -> ModelShape:
    return ModelShape(num_layers=LAYERS, hidden_size=H, num_attention_heads=A, seq_length=S,
                      micro_batch_size=B, vocab_size=V, dtype="bf16", position_embedding="rope",
                      tie_embeddings=False, attention=attention)


def _block(attention: str):
    return block_profile(_shape(attention), DEVICE, count=LAYERS, gradients=True)


def _evaluate(attention: str, choice: dict, block=None, loss: bool = True):
    block = block or _block(attention)
    names = {s.name for s in block.sites}
    return evaluate_plan([block], [{k: v for k, v in choice.items() if k in names}],
                         loss_bytes=loss_bytes(_shape(attention), device=DEVICE) if loss else 0)


def _seed(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _measure(config: ActConfig, attention: str) -> int:
    """The tracker's peak of one training step above its entry state, after a warm-up step."""
    from llm_act.patches.megatron import apply

    _seed(0)
    cfg = T.small_config(hidden_size=H, num_attention_heads=A, num_layers=LAYERS, dtype=torch.bfloat16,
                         dropout=0.0, add_bias_linear=True)
    model = T.gpt_model(cfg, vocab_size=V, max_sequence_length=S)
    controller = apply(model, config)
    assert controller.attention_mode() == attention
    ids, pos, labels = T.gpt_batch(B, S, V, generator=torch.Generator().manual_seed(1))

    def step():
        out = model(ids, pos, None, labels=labels)
        out.float().mean().backward()

    _seed(5)
    step()  # megatron's buffers, the codecs' state and every parameter's .grad now exist
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()
    gc.collect()
    _seed(5)
    with LiveStorageTracker(model, inside_custom_ops=False) as tracker:
        step()
    return tracker.peak_bytes


def _old_prediction(attention: str, choice: dict) -> int:
    """The model before issue 27: no gradients in flight, no loss event, the outer activations
    added to the stored bytes and the transient as a constant."""
    block = dataclasses.replace(_block(attention), grad_bytes=0)
    return _evaluate(attention, choice, block, loss=False).activation_bytes + sum(
        outer_bytes(_shape(attention), 0).values())


@pytest.fixture(scope="module")
def results(megatron_one_rank, tmp_path_factory):
    """{plan: (predicted Plan, measured peak, the old model's prediction)}; prints the table."""
    out = {}
    for name, (attention, choice, config) in FIXED.items():
        measured = _measure(ActConfig(**config), "stock" if attention == "stock" else "auto")
        out[name] = (_evaluate(attention, choice), measured, _old_prediction(attention, choice))
    block, shape = _block("auto"), _shape("auto")
    loss = loss_bytes(shape, device=DEVICE)
    low, high = (_evaluate("auto", c).activation_bytes for c in (recompute_layer(), keep_layer()))
    folder = tmp_path_factory.mktemp("plans")
    for fraction in AUTO:
        plan = solve_plan([block], int(low + fraction * (high - low)), loss_bytes=loss)
        path = folder / f"auto_{fraction}.json"
        path.write_text(json.dumps(plan.to_dict()))
        measured = _measure(ActConfig(plan=str(path)), "auto")
        out[f"auto {fraction}"] = (plan, measured, _old_prediction("auto", plan.layer_choices(0)[0]))
    print(f"\nGPT L={LAYERS} h={H} a={A} s={S} b={B} V={V} bf16, CPU; loss_bytes {loss}, grad_bytes "
          f"stock attention {_block('stock').grad_bytes}, memory-efficient {block.grad_bytes}")
    print(f"{'plan':<10} {'predicted':>10} {'measured':>10} {'gap':>7}   {'old model':>10} {'gap':>7}   choice")
    for name, (plan, measured, old) in out.items():
        choice = {k: v for k, v in plan.layer_choices(0)[0].items() if v != "keep"} if name.startswith("auto") else ""
        print(f"{name:<10} {plan.activation_bytes:>10} {measured:>10} {_gap(plan.activation_bytes, measured):>+7.2%}"
              f"   {old:>10} {_gap(old, measured):>+7.2%}   {choice}")
    return out


def _gap(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_plans_match_the_measured_peak(results, name):
    plan, measured, _ = results[name]
    assert abs(_gap(plan.activation_bytes, measured)) <= TOLERANCE, (plan.activation_bytes, measured)


_OVER = "the planner's transient sums sites of different backward stages and the whole-block output"


@pytest.mark.parametrize("fraction", [
    pytest.param(0.25, marks=pytest.mark.xfail(strict=True, reason=_OVER)),
    pytest.param(0.5, marks=pytest.mark.xfail(strict=True, reason=_OVER)),
    0.75,
])
def test_auto_plans_match_the_measured_peak(results, fraction):
    plan, measured, _ = results[f"auto {fraction}"]
    assert abs(_gap(plan.activation_bytes, measured)) <= TOLERANCE, (plan.activation_bytes, measured)


def test_the_model_never_under_predicts(results):
    """Exact where the bytes are exact (keep, selective, full); above the measurement elsewhere."""
    for name, (plan, measured, _) in results.items():
        assert plan.activation_bytes >= measured, name
    for name in ("keep", "selective", "full"):
        plan, measured, _ = results[name]
        assert plan.activation_bytes == measured, name


def test_a_wrong_model_fails(results):
    """The old model (outer activations as static, no gradients in flight, no loss event)
    misses keep and selective by more than 3%; dropping either new term misses too."""
    for name in ("keep", "selective"):
        _, measured, old = results[name]
        assert abs(_gap(old, measured)) > TOLERANCE, name
    for name, attention, choice in (("keep", "stock", keep_layer()), ("selective", "stock", selective_layer()),
                                    ("full", "auto", recompute_layer())):
        measured = results[name][1]
        no_grad = _evaluate(attention, choice, dataclasses.replace(_block(attention), grad_bytes=0))
        no_loss = _evaluate(attention, choice, loss=False)
        assert max(abs(_gap(no_grad.activation_bytes, measured)),
                   abs(_gap(no_loss.activation_bytes, measured))) > TOLERANCE, name


def test_the_terms_by_hand():
    """`loss_bytes` and `grad_bytes` at the test's shape, term by term (T tokens, h, f, e)."""
    n = TOKENS * H * E
    # fc2's input gradient, its weight gradient (`.grad += new` on CPU), the incoming gradient,
    # the block output a whole-block recompute rebuilds, the per-token losses, loss and seed
    assert grad_bytes(_shape("auto"), DEVICE) == TOKENS * F * E + F * H * E + 2 * n + 4 * TOKENS + 8
    assert grad_bytes(_shape("auto"), DeviceModel()) == TOKENS * F * E + 2 * n + 4 * TOKENS + 8
    # the stock attention's softmax backward: fp32 gradients of probabilities and scores,
    # linear_proj's weight gradient, the residual's and the context's gradients, the re-run
    # context, losses; net of the sites after the softmax and the 16-bit probabilities
    scores = B * A * S * S
    stock = {s.name: s.nbytes for s in _block("stock").sites}
    after = ("attn.out", "ln2.input", "mlp.fc1_input", "mlp.act_input", "mlp.fc2_input")
    assert grad_bytes(_shape("stock"), DEVICE) == (8 * scores + H * H * E + 3 * n + 4 * TOKENS + 8
                                                   - sum(stock[k] for k in after) - scores * E)
    # the loss: final norm input, output layer input (+ the norm's fp32 mean and rstd), the
    # fp32 softmax with the target mask and masked target; the 16-bit logits and 28 bytes a
    # token of the cross entropy's bookkeeping
    vocab = 1024
    assert loss_bytes(_shape("auto"), device=DEVICE) == (
        n + n + 8 * TOKENS + TOKENS * (4 * vocab + 9) + TOKENS * vocab * E + 28 * TOKENS)
