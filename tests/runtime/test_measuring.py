"""What a tracking point of plan "auto" measures (`llm_act.runtime.measuring`), on a real
megatron-core GPT (CPU): one round of measuring passes per point (the exact pass alone at the
first, then the exact pass and one probed type, or a plain round for a coherence), chosen by
what the plan in force depends on; stand-ins for what is not measured yet; the recorded step
replayed on the first rows of its batch; a later point's profile from the training step
itself, with no pass of its own; a probed type's c following the gradients' scale between
its measurements; and an outlier shift at a site the plan keeps resetting nothing."""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act.runtime import measuring
from llm_act.runtime.measuring import (
    PLAIN,
    SIGNED,
    STANDIN_KAPPA,
    Measurements,
    round_rows,
    scaled_medians,
)
from tests import testing as T
from tests import gpt_runs as R
from tests.runtime.test_controller_adapt import _setup, _train

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*activation compression adds gradient noise.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

TAPPED = ["attn.qkv_input", "mlp.fc1_input"]


def test_a_probed_c_is_scaled_by_the_tapped_sites_between_its_measurements():
    """Measured once when the tapped sites summed to 10; they now sum to 1 (every gradient
    shrank): the probed c is a tenth of what was measured, its share unchanged."""
    recent = [{"attn.qkv_input": 6.0, "mlp.fc1_input": 4.0, "ln1.input": 2.0}]
    recent += [{"attn.qkv_input": 0.6, "mlp.fc1_input": 0.4} for _ in range(3)]
    c = scaled_medians(recent, TAPPED)
    assert c["attn.qkv_input"] == pytest.approx(0.6) and c["mlp.fc1_input"] == pytest.approx(0.4)
    assert c["ln1.input"] == pytest.approx(0.2)  # unscaled it would be 2.0
    assert measuring.window_medians(recent)["ln1.input"] == pytest.approx(2.0)
    # without tapped sites nothing is scaled
    assert scaled_medians(recent, []) == measuring.window_medians(recent)


def test_round_rows_fit_the_passes_into_the_row_budget():
    assert round_rows(8, 2, 1.0) == 4 and round_rows(8, 3, 1.0) == 2 and round_rows(8, 1, 0.25) == 2
    assert round_rows(16, 2, 1.0) == 8 and round_rows(6, 2, 1.0) == 2
    # at least two rows (the halves); the whole batch where it has two or fewer
    assert round_rows(8, 9, 1.0) == 2 and round_rows(2, 2, 1.0) is None and round_rows(None, 2, 1.0) is None
    assert round_rows(8, 1, 1.0) is None  # one pass fits the whole batch
    assert round_rows(8, 1.25, 1.0) == 6


def _count_passes(monkeypatch) -> list:
    """Patch the adapter's sensitivity measurement to count the forwards each one runs."""
    counts: list = []
    real = measuring.measure_sensitivity

    def counted(controller, forward, *args, **kwargs):
        n = [0]

        def fwd():
            n[0] += 1
            return forward()

        out = real(controller, fwd, *args, **kwargs)
        counts.append((controller.iteration, n[0], kwargs.get("signed"), dict(kwargs.get("biased") or {})))
        return out

    monkeypatch.setattr(measuring, "measure_sensitivity", counted)
    return counts


def test_every_point_runs_one_round_the_first_the_exact_pass_alone(monkeypatch):
    counts = _count_passes(monkeypatch)
    model, controller, opt, gen = _setup(budget=10**9)
    _train(model, controller, opt, gen, 8)  # tracking at 1, 2, 4, 8
    a = controller.adapter
    assert [it for it, *_ in counts] == [1, 2, 4, 8]
    assert counts[0][1:3] == (1, True)  # the exact pass (signed: it gives the sampling noise)
    for _, passes, signed, biased in counts[1:]:
        # a signed round: the exact pass and one probed type; a plain one: the exact pass and
        # a probed site's c and coherence
        assert (passes, biased) == (2, {}) if signed else passes == 1 + 2 * len([s for s in biased if s not in
                                                                                 a.measured.split_sites()[0]])
    assert a.measured.sampling_noise is not None and a.measured.sampling_noise > 0
    tapped, probed = a.measured.split_sites()
    assert set(tapped) <= set(a.measured.sensitivity)
    # every sensitive type is charged something: measured, or the largest measured c
    c = a.measured.planner_c()
    assert set(c) == set(tapped + probed)
    for site in set(probed) - set(a.measured.sensitivity):
        assert c[site] == max(a.measured.sensitivity.values())
    # the measurements own their state: a fresh `Measurements` loaded from it holds the same
    # and charges the same, and the adapter's checkpoint carries it under the keys it had
    fresh = Measurements(controller, a.replay, a.round, a.warn_once)
    fresh.load_state_dict(a.measured.state_dict())
    assert fresh.state_dict() == a.measured.state_dict() and fresh.planner_c() == c
    assert {k: controller.state_dict()["adapt"][k] for k in fresh.state_dict()} == fresh.state_dict()


def test_the_round_goes_first_where_the_plan_depends_on_a_stand_in():
    """The order of `next_round`: an unmeasured probed type the plan stores lossily, the
    linears' coherences (all in one pass), a probed site's coherence (lossy ones first),
    the other unmeasured types, then the stalest; plain and signed rounds take turns; where
    a coherence is not measured a biased codec is charged the stand-in."""
    model, controller, opt, gen = _setup(budget=10**9, biased_codecs="charge")  # the rounds of coherence too
    a = controller.adapter
    tapped, probed = a.measured.split_sites()
    assert "ln2.input" in probed and "ln1.input" in probed
    keep_all = {layer: {s: "keep" for s in controller.sites(layer)} for layer in controller.layers}
    controller._plan = {layer: dict(ch, **{"ln2.input": "int4"}) for layer, ch in keep_all.items()}
    plain, signed = {"kind": PLAIN}, {"kind": SIGNED}
    a.measured.last_round = plain
    assert a.measured.next_round(tapped, probed) == (SIGNED, ["ln2.input"], {})
    assert a.measured.next_round(tapped, probed, catch_up=3)[1][0] == "ln2.input"  # the lossy type first
    a.measured.c_recent = [{s: 1.0 for s in tapped + ["ln2.input"]}]
    a.measured.last_round = signed
    kind, sites, biased = a.measured.next_round(tapped, probed)
    assert (kind, sites) == (PLAIN, []) and set(biased) == set(tapped)
    assert a.measured.planner_coherence() == {s: STANDIN_KAPPA for s in tapped + probed}  # nothing measured
    a.measured.coherence = {s: 1.2 for s in tapped}
    a.measured.coherence_codecs = dict(biased)
    a.measured.last_round = plain  # then a signed round: the other types never measured
    never = [s for s in probed if s != "ln2.input"]
    assert a.measured.next_round(tapped, probed) == (SIGNED, never[:1], {})
    a.measured.last_round = signed
    kind, sites, biased = a.measured.next_round(tapped, probed)
    assert (kind, sites) == (PLAIN, ["ln2.input"]) and set(biased) == {"ln2.input"}  # the lossy one first
    assert a.measured.planner_coherence() == {**{s: STANDIN_KAPPA for s in probed}, **{s: 1.2 for s in tapped}}
    a.measured.coherence.update({s: 1.5 for s in probed})
    a.measured.coherence_codecs.update(a.measured.charged_codecs(probed))
    assert a.measured.next_round(tapped, probed) == (SIGNED, never[:1], {})  # no coherence due
    a.measured.c_recent = [{s: 1.0 for s in tapped + probed if s != "ln1.input"}, {s: 1.0 for s in tapped + ["ln1.input"]}]
    # everything measured: the type measured longest ago
    assert a.measured.next_round(tapped, probed)[1] == [s for s in probed if s != "ln1.input"][:1]
    # coherence is due again when the plan moves the site to another charged codec: at a
    # norm's input (its backward is linear in the stored value) the plan's own int4 is charged
    a.measured.coherence_codecs["ln2.input"] = "some_other_codec"
    assert a.measured.coherence_due(a.measured.charged_codecs(["ln2.input"])) == {"ln2.input": "int4"}
    # every sensitive type is charged a c: the largest measured where none is
    a.measured.c_recent, a.measured.sensitivity = [], {"attn.qkv_input": 2.0, "mlp.fc1_input": 1.0}
    assert a.measured.planner_c()["ln1.input"] == 2.0 and a.measured.planner_c()["mlp.fc1_input"] == 1.0
    # a shift is looked for only in a full window: three measurements of the type
    a.measured.c_recent = [{"attn.qkv_input": 2.0, "ln1.input": 1.0}] + [{"attn.qkv_input": 2.0}] * 2
    a.measured.sensitivity = scaled_medians(a.measured.c_recent, ["attn.qkv_input"])
    assert set(a.measured.settled_c()) == {"attn.qkv_input"}
    a.measured.c_recent += [{"attn.qkv_input": 2.0, "ln1.input": 1.0}] * 2
    assert set(a.measured.settled_c()) == {"attn.qkv_input", "ln1.input"}


def _train_replayed(model, controller, opt, gen, steps, batch, on_point=None):
    """`steps` iterations of a plain loop that gives no probe: the controller measures from
    the recorded training step (`StepReplay`)."""
    for _ in range(steps):
        ids, pos, labels = T.gpt_batch(batch, R.SEQ, R.VOCAB, generator=gen)
        with controller.step():
            model(ids, pos, None, labels=labels).float().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_a_replayed_point_measures_on_the_first_rows_with_no_profile_pass():
    """Without a probe: the rounds replay the step on the first rows of its batch of 8 (4
    for the two passes of a signed round, 2 for the first point's exact pass), and a later
    point's profile comes from the training step's own samples: every forward the point
    runs is a round's."""
    model, controller, opt, gen = _setup(budget=10**9, biased_codecs="charge")  # the rounds of coherence too
    rows_seen: list = []
    tracking = [False]

    def count(module, args, kwargs):
        if tracking[0]:
            rows_seen.append(int(args[0].shape[0]))

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    a = controller.adapter
    real = a.track

    def track(probe):
        tracking[0] = True
        try:
            real(probe)
        finally:
            tracking[0] = False

    a.track = track
    try:
        _train_replayed(model, controller, opt, gen, 1, batch=8)
        first = list(rows_seen)
        rows_seen.clear()
        _train_replayed(model, controller, opt, gen, 1, batch=8)
        later = list(rows_seen)
    finally:
        handle.remove()
    assert a.tracked == [1, 2]
    # the first point: the keep and the capture forwards of the full profile, then the exact pass
    assert first == [8, 8, 2], first
    # the second: the profile from the step (no forward); the plan keeps everything, so the
    # round measures the linears' coherences, one plain pass (and their codecs' work) on 6 rows
    assert later == [6], later
    assert a.measured.last_round["kind"] == PLAIN and set(a.measured.last_round["biased"]) == set(a.measured.split_sites()[0])
    assert a.measured.step_tap is None  # removed at the boundary
    # what the step paid for its tap is the point's: booked with it
    assert all(0.0 < p["step tap"] <= p["total"] for p in a.track_costs)
    # each point's round, in words, for the overhead bench's table
    assert [p["round"] for p in a.track_costs] == [
        "signed: the exact pass alone; 2 of 8 rows",
        "plain: the coherence of " + ", ".join(a.measured.last_round["biased"]) + "; 6 of 8 rows"]
    # the next is signed (a plain round is never followed by another), catching up on the
    # probed types: as many as fit at 2 rows each beside the exact pass
    _train_replayed(model, controller, opt, gen, 2, batch=8)
    assert a.measured.last_round["kind"] == SIGNED and a.measured.last_round["rows"] == (2, 8) and len(a.measured.last_round["sites"]) == 3
    assert set(a.measured.profile.sites) == {(layer, s) for layer in controller.layers for s in controller.sites(layer)
                                    if (layer, s) in a.measured.profile.sites}


def test_a_step_that_cannot_be_replayed_on_its_first_rows_is_measured_whole(monkeypatch, caplog):
    """A model whose arguments the cut misreads (here: a cut that drops the labels' rows
    only) fails the sub-batch replay: the point measures on the whole batch instead, says
    so once, and later points do not try again."""
    import logging

    from llm_act.measurement import replay as replay_module

    real = replay_module.first_rows

    def broken(tree, batch, rows):
        out = real(tree, batch, rows)
        if isinstance(out, dict) and "labels" in out:
            out = dict(out, labels=tree["labels"])  # the labels keep every row: shapes disagree
        return out

    monkeypatch.setattr(replay_module, "first_rows", broken)
    model, controller, opt, gen = _setup(budget=10**9)
    with caplog.at_level(logging.WARNING, logger="llm_act"):
        _train_replayed(model, controller, opt, gen, 4, batch=8)
    a = controller.adapter
    assert a.tracked == [1, 2, 4] and a.measured.rows_refused and a.measured.sampling_noise > 0
    assert a.measured.last_round["rows"] is None
    said = [r.getMessage() for r in caplog.records if "could not be replayed on its first rows" in r.getMessage()]
    assert len(said) == 1


def test_an_outlier_shift_at_a_kept_site_does_not_reset_the_schedule():
    """The same injected outlier channels as in test_controller_adapt's reset test, under a
    budget that keeps every site: nothing the plan stores depends on them."""
    model, controller, opt, gen = _setup(budget=10**9, adapt_interval_max=4, sensitivity=False)

    def inject(iteration, model):
        if iteration == 9:
            with torch.no_grad():
                model.embedding.word_embeddings.weight[:, :4] *= 50.0

    _train(model, controller, opt, gen, 14, on_step=inject)
    a = controller.adapter
    stored = {controller.plan[layer][site] for layer, site in a.measured.profile.sites}
    assert stored <= {"keep", "recompute", "regen"}, stored
    assert not [r for _, rs in a.resets for r in rs if "outlier rate" in r]
    assert a.measured.profile.outlier_rates()["ln1.input"] > 0  # the channels are there, measured
