"""The gradient-fidelity report (`llm_act.measurement.fidelity`): one micro-batch of a training step run
again, exact and under the plan in force, from the same state.

It is zero for "keep", small for the "compress" plan, and large where a codec is broken; it
runs on the schedule (`fidelity_every`) and on request, is logged, checkpointed with the
controller, and leaves the training run untouched. Real megatron-core GPT, CPU.
"""
from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.measurement import fidelity
from llm_act.measurement.fidelity import FidelityReport, group_name, lossy_sites
from tests.patches.broken_codec import broken
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

FC2 = "decoder.layers.*.mlp.linear_fc2.weight"


def _trained(plan: str, steps: int = 2, request: bool = True, **config):
    """A 2-layer GPT under `plan` after `steps` plain-loop steps (forward, backward,
    optimizer.step(), nothing of ours called), with a report requested before the last."""
    from llm_act.patches.megatron import apply

    model = R.build(num_layers=2)
    controller = apply(model, ActConfig(plan=plan, **config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(steps):
        if request and i == steps - 1:
            controller.request_fidelity()
        R.seed_all(100 + i)
        ids, pos, labels = R.batch(seed=i)
        model(ids, pos, None, labels=labels).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, controller


def test_group_names_gather_the_layers():
    assert group_name("module.module.decoder.layers.11.mlp.linear_fc1.weight") == \
        "decoder.layers.*.mlp.linear_fc1.weight"
    assert group_name("embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"
    assert lossy_sites({0: {"ln1.input": "keep", "attn.dropout_mask": "regen", "mlp.act_input": "fewbit3"},
                        1: {"attn.q": "recompute", "attn.v": "int4"}}) == ["mlp.act_input", "attn.v"]


def test_keep_reports_exactly_zero():
    _, c = _trained("keep")
    (report,) = c.adapter.measured.fidelity
    assert report.iteration == 2 and report.total == 0.0
    assert report.groups and all(v == 0.0 for v in report.groups.values())
    assert report.sites == {}  # nothing lossy to measure alone


def test_compress_is_close_and_a_broken_codec_is_not():
    _, c = _trained("compress")
    (good,) = c.adapter.measured.fidelity
    assert 0 < good.total < 0.2, good.format()
    assert 0 < good.groups[FC2] < 0.3 and sum(good.shares.values()) == pytest.approx(1.0)
    assert len(good.sites) == fidelity.SITES_PER_REPORT and all(0 < v < 0.2 for v in good.sites.values())
    with broken("mlp.fc2_input"):  # decodes to zeros: fc2's weight gradient is lost
        _, c = _trained("compress")
    (bad,) = c.adapter.measured.fidelity
    assert bad.groups[FC2] > 0.99 and bad.total > 2 * good.total, bad.format()
    assert bad.shares[FC2] > good.shares[FC2]  # the lost gradient is where the error now sits
    # the gradient-noise ratio (compression's squared error over the sampling variance) sees
    # it too, in fc2's group and in total
    assert 0 < good.noise_ratio < math.inf and set(good.noise_ratios) == set(good.groups)
    assert bad.noise_ratios[FC2] > 10 * good.noise_ratios[FC2], (good.format(), bad.format())
    assert bad.noise_ratio > 2 * good.noise_ratio
    assert "gradient-noise ratio (compression / sampling variance)" in bad.format()


def test_sites_measured_alone_rotate_and_name_the_broken_one():
    with broken("mlp.fc2_input"):
        model, c = _trained("compress", steps=1)
        seen = dict(c.adapter.measured.fidelity[-1].sites)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        while len(seen) < len(lossy_sites(c.plan, c.sites)):
            c.request_fidelity()
            ids, pos, labels = R.batch(seed=len(seen))
            model(ids, pos, None, labels=labels).float().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert len(c.adapter.measured.fidelity[-1].sites) == fidelity.SITES_PER_REPORT
            seen.update(c.adapter.measured.fidelity[-1].sites)
    assert set(seen) == set(lossy_sites(c.plan, c.sites))  # sites the layers have, every one
    assert "final_norm.input" not in lossy_sites({0: c.plan[0]}, c.sites)  # not layer 0's
    worst = max(seen, key=seen.get)
    assert worst == "mlp.fc2_input" and seen[worst] > 0.2, seen
    assert all(v < 0.2 for s, v in seen.items() if s != worst), seen


def test_scheduled_logged_checkpointed_and_the_run_untouched(caplog):
    plain_model, plain = _trained("compress", steps=4, request=False, fidelity_every=0)
    with caplog.at_level(logging.INFO, logger="llm_act"):
        model, c = _trained("compress", steps=4, request=False, fidelity_every=2)
    assert [r.iteration for r in c.adapter.measured.fidelity] == [2, 4]
    # each report's wall time is booked (`llm-act bench overhead` prints it in steps)
    assert [p["iteration"] for p in c.adapter.report_costs] == [2.0, 4.0]
    assert all(p["total"] > 0 for p in c.adapter.report_costs)
    assert sum("gradient fidelity at iteration" in r.getMessage() for r in caplog.records) == 2
    assert "gradient fidelity at iteration 4: relative error" in c.adapter.summary()
    # the reports move nothing of the run: same weights after 4 steps
    for (n, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), f"{n} moved"
    from llm_act.patches.megatron import apply

    restored = apply(R.build(num_layers=2), ActConfig(plan="compress", fidelity_every=2))
    restored.load_state_dict(c.state_dict())
    assert [r.to_dict() for r in restored.adapter.measured.fidelity] == [r.to_dict() for r in c.adapter.measured.fidelity]
    assert restored.adapter.measured.fidelity_next == c.adapter.measured.fidelity_next


def test_report_arithmetic():
    r = FidelityReport.from_sums(7, {"norm:a": 4.0, "err:a": 1.0, "norm:b": 0.0, "err:b": 0.0,
                                     "norm:c": 0.0, "err:c": 1.0, "site:x": 4.0})
    assert r.groups == {"a": 0.5, "b": 0.0, "c": math.inf}
    assert r.total == pytest.approx(math.sqrt(2 / 4))  # every group's error over the whole norm
    assert r.sites == {"x": 1.0}
    assert r.shares == {"a": 0.5, "b": 0.0, "c": 0.5}  # where the squared error sits
    assert r.noise_ratio is None and r.noise_ratios == {}  # no sampling variance measured
    n = FidelityReport.from_sums(7, {"norm:a": 4.0, "err:a": 1.0, "samp:a": 2.0,
                                     "norm:b": 1.0, "err:b": 0.0, "samp:b": 0.0,
                                     "norm:c": 1.0, "err:c": 1.0, "samp:c": 0.0})
    assert n.noise_ratios == {"a": 0.5, "b": 0.0, "c": math.inf}
    assert n.noise_ratio == pytest.approx(2.0 / 2.0)  # summed errors over summed variances
    assert FidelityReport.from_dict(n.to_dict()) == n
    nan = FidelityReport.from_sums(1, {"norm:a": 1.0, "err:a": math.nan})
    assert math.isnan(nan.total) and math.isnan(nan.groups["a"]) and math.isnan(nan.shares["a"])
    assert FidelityReport.from_sums(1, {"norm:a": 1.0, "err:a": 0.0}).shares == {}  # no error, no shares
    assert FidelityReport.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("key,value", [("noise_fraction", 0), ("noise_fraction", -1.0),
                                       ("noise_fraction", True), ("noise_fraction", "x"),
                                       ("fidelity_every", -1), ("fidelity_every", 2.5),
                                       ("fidelity_every", True)])
def test_config_refuses_bad_values_by_name(key, value):
    with pytest.raises(ValueError, match=key):
        ActConfig(**{key: value})
