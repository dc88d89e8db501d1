"""The measured profile on a real megatron-core GPT (CPU): predicted bytes of several plans
against the ledger, what it measures, and that it leaves the run untouched.

Plans with "recompute" are not tested here: the controller and `llm_act.plan` do not bind
recomputation yet (llm_act/patches/megatron/recompute.py is still being wired), so the profile
offers "recompute" only when `plans` accepts it.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act import sites as schema
from llm_act.ledger import SavedTensorLedger
from llm_act.measurement.measure import _producer_ms, measure_profile
from llm_act.patches.megatron import apply
from llm_act.planner import evaluate_plan, solve_plan
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


# megatron-core on one gloo rank, one torch thread (tests/conftest.py); the GPT with dropout
# (tests/measurement/conftest.py). The profile describes the memory-efficient attention every
# non-keep plan runs; attention "chunked" (what "auto" picks on CPU with dropout) keeps it
# under plan "keep" too, where "auto" would switch to stock megatron-core attention and its
# s x s tensors.
pytestmark = [pytest.mark.usefixtures("megatron_one_rank"), pytest.mark.gpt(dropout=0.1, attention="chunked")]


@pytest.fixture(scope="module")
def profile(gpt):
    """`gpt`'s measured profile, taken with the RNG streams at the state the ledger runs below
    start from."""
    _, controller, forward = gpt
    R.seed_all(5)
    return measure_profile(controller, forward)


MIXED = {
    0: {"ln1.input": "int8", "attn.qkv_input": "keep", "attn.out": "dual2",
        "attn.hidden_dropout_mask": "bitmask", "ln2.input": "int2", "mlp.fc1_input": "fp8_e4m3",
        "mlp.act_input": "fewbit2", "mlp.fc2_input": "keep", "mlp.hidden_dropout_mask": "keep"},
    1: {"ln1.input": "outlier_int4", "attn.qkv_input": "int4_channel", "attn.out": "keep",
        "attn.hidden_dropout_mask": "regen", "ln2.input": "keep", "mlp.fc1_input": "int1",
        "mlp.act_input": "outlier_int4", "mlp.fc2_input": "fp8_e5m2", "mlp.hidden_dropout_mask": "bitmask"},
}


@pytest.mark.parametrize("name", ["keep", "compress", "mixed"])
def test_predicted_bytes_match_the_ledger(gpt, profile, name):
    model, controller, forward = gpt
    controller.set_plan(MIXED if name == "mixed" else name)
    try:
        R.seed_all(5)
        with SavedTensorLedger() as ledger:
            out = forward()
        measured = ledger.by_site()
        del out
        plan = controller.plan
        predicted_total = profile.predicted_bytes(plan)
        planned = set(profile.sites)
        measured_planned = sum(n for key, n in measured.items() if key in planned)
        predicted_planned = profile.predicted_bytes(plan, include_other=False)
        print(f"{name}: predicted {predicted_total} B, ledger {ledger.total_bytes} B; planned sites: "
              f"predicted {predicted_planned} B, ledger {measured_planned} B")
        assert abs(predicted_total - ledger.total_bytes) <= 0.05 * ledger.total_bytes
        assert abs(predicted_planned - measured_planned) <= 0.05 * measured_planned
        # the planner's model of the same plan stores the same bytes (its peak aside)
        blocks = profile.blocks(per_layer=True)
        ev = evaluate_plan(blocks, profile.choice_for(plan, per_layer=True))
        assert ev.activation_bytes - ev.peak_bytes == predicted_planned
    finally:
        controller.set_plan("compress")


def test_profile_contents(gpt, profile):
    _, controller, _ = gpt
    assert profile.layers == (0, 1)
    st = profile.sites[(0, "mlp.fc2_input")]
    assert st.shape == (R.SEQ, R.BATCH, 256) and st.keep_bytes == R.SEQ * R.BATCH * 256 * 4
    # every codec reached its nominal ratio range; int4 is about 8x smaller than fp32
    assert 6.0 < st.ratio("int4") < 8.0 and st.ratio("int8") > 3.0
    assert st.options["int2"].rel_error > st.options["int4"].rel_error > st.options["int8"].rel_error > 0
    # the norms keep their exact per-row statistics beside the encoding
    assert profile.sites[(0, "ln1.input")].side_bytes == 2 * R.SEQ * R.BATCH * 4
    assert profile.sites[(0, "mlp.fc1_input")].side_bytes == 0
    # times: measured on the first layer of the group, positive
    for site in ("attn.qkv_input", "attn.out", "ln2.input", "mlp.act_input", "mlp.fc2_input"):
        assert profile.sites[(0, site)].forward_ms > 0
    assert profile.sites[(0, "mlp.fc2_input")].options["outlier_int4"].encode_ms > 0
    # identical blocks share one BlockProfile (the final norm's input, after them, is its own:
    # timed itself); the planner solves it
    assert profile.sites[(1, "final_norm.input")].options["outlier_int4"].encode_ms > 0
    blocks = profile.blocks()
    assert len(blocks) == 2 and blocks[0].count == 2
    # megatron-core's measured path does not price the gradients in flight (`backward_priced`);
    # whole-block recompute keeps the block input, its norm's statistics rebuilt with it
    assert not profile.backward_priced and blocks[0].stage_bytes == () and blocks[0].grad_bytes == 0
    ln1 = profile.sites[(0, "ln1.input")]
    assert blocks[0].checkpoint_bytes == ln1.keep_bytes - ln1.side_bytes == R.SEQ * R.BATCH * ln1.shape[-1] * 4
    assert [s.name for s in blocks[1].sites] == ["final_norm.input"] and blocks[1].count == 1
    loose = solve_plan(blocks, 10**9, static_bytes=profile.other_bytes)
    assert all(c == "keep" for ch in loose.choice for c in ch.values()) and loose.overhead_ms == 0


#: the sites a megatron-core layer's binder knows the producer of (`LayerBinder.producer`)
PRODUCED = ("attn.qkv_input", "ln2.input", "mlp.fc1_input", "mlp.act_input", "mlp.fc2_input")


def _forward_tensors(gpt, layer: int) -> tuple[dict, torch.Tensor]:
    """({site: the tensor the forward made there}, the CPU RNG state `linear_proj` started
    with: the hidden dropout's draw) of `layer`, read by hooks on its modules: the input of
    each site's slot module, and `mlp.act_input` as the MLP sums fc1's output and bias."""
    _, controller, forward = gpt
    tl = controller.layer_modules[layer]
    seen, rng = {}, []

    def record(site, x) -> None:  # a hook returning nothing leaves the forward as it is
        seen.setdefault(site, x.detach())

    hooks = [tl.get_submodule(schema.SITE_OF[site].slot).register_forward_pre_hook(
        lambda m, args, site=site: record(site, args[0]))
        for site in set(PRODUCED + ("ln1.input", "attn.out")) - {"mlp.act_input"}]
    hooks.append(tl.self_attention.linear_proj.register_forward_pre_hook(
        lambda m, args: rng.append(torch.get_rng_state())))
    hooks.append(tl.mlp.linear_fc1.register_forward_hook(
        lambda m, args, out: record("mlp.act_input", out[0] + out[1])))
    R.seed_all(5)
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
    return seen, rng[0]


def test_the_binders_producers_rebuild_the_layers_own_tensors(gpt, profile):
    """A layer's binder gives the producer of each site it can recompute alone (the layer's
    own code, `LayerBinder.producer`): on the tensors the forward made the site from, it
    makes the tensor the forward made (`ln2.input` through the bias-dropout-add, with the
    forward's dropout draw), and measurement times it -- from the capture forward's module
    times, or re-run through the binder where no module time is at hand."""
    _, controller, _ = gpt
    binder = controller.binder(0)
    seen, rng = _forward_tensors(gpt, 0)
    with torch.no_grad():
        for site in PRODUCED:
            make = binder.producer(site)
            with torch.random.fork_rng():
                torch.set_rng_state(rng)
                out = make(*(seen[s] for s in schema.PRODUCER_INPUTS[site]))
            torch.testing.assert_close(out, seen[site], rtol=0, atol=0, msg=site)
        # the core attention's output needs the forward's own arguments: no producer
        assert binder.producer("attn.out") is None and binder.producer("ln1.input") is None
        captured = {(0, s): x for s, x in seen.items()}
        for site in PRODUCED + ("attn.out",):
            assert profile.sites[(0, site)].forward_ms > 0
        for site in PRODUCED:
            assert _producer_ms(controller, 0, site, captured, repeats=1) > 0


def test_outlier_channels_are_found_in_fixed_slots():
    """Outlier channels in the block input are found (the rate counts them all) and stored
    exactly in the codec's fixed slots (1 of 64 channels here): the bytes stay."""
    model = R.build(dropout=0.0, num_layers=1)
    controller = apply(model, ActConfig(plan="compress"))
    ids, pos, labels = R.batch(2)
    fwd = lambda: model(ids, pos, None, labels=labels)  # noqa: E731
    before = measure_profile(controller, fwd, codecs=["outlier_int4"])
    with torch.no_grad():
        model.embedding.word_embeddings.weight[:, :3] *= 40.0  # three outlier channels
    after = measure_profile(controller, fwd, codecs=["outlier_int4"], times_from=before)
    a, b = before.sites[(0, "ln1.input")], after.sites[(0, "ln1.input")]
    assert b.outlier_rate >= 3 / 64 > a.outlier_rate  # the data's rate, beyond the one slot
    assert b.options["outlier_int4"].nbytes == a.options["outlier_int4"].nbytes
    assert after.outlier_rates()["ln1.input"] == b.outlier_rate
    # times were carried over, not re-measured
    assert b.options["outlier_int4"].encode_ms == a.options["outlier_int4"].encode_ms


def test_measuring_leaves_the_run_untouched(gpt):
    model, controller, forward = gpt
    codec = controller.codec(0, "mlp.fc1_input")
    codec.encode(torch.randn(64, 64))  # the generator exists
    gen_state = codec.state_dict()["generators"]["cpu"].clone()
    model.zero_grad(set_to_none=True)
    rng = torch.get_rng_state()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    measure_profile(controller, forward)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, tracker[k]) for k, v in get_cuda_rng_tracker().get_states().items())
    assert torch.equal(codec.state_dict()["generators"]["cpu"], gen_state)
    assert all(p.grad is None for p in model.parameters())
    for layer in controller.layers:
        for site in controller.sites(layer):
            assert controller.module(layer, site).act_codecs[site] is controller.codec(layer, site)
