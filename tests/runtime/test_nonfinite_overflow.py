"""Non-finite values past a codec's side list reach the user (issue 44): they decode to NaN,
not to their exact value, and are counted on the device; the adapter reads the count at report
and tracking points only (one transfer), warns when it grew, and the run's summary states it.
A real megatron-core GPT on one CPU rank, Inf planted in what linear_fc2 stores."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.codecs.base import nonfinite_capacity
from llm_act.patches.megatron import apply
from tests import gpt_runs as R
from tests.runtime.test_controller_adapt import _train

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
pytestmark = pytest.mark.usefixtures("megatron_one_rank")

PLANTED = 64
#: the numel of every tensor the hook planted Inf in
SEEN: list[int] = []


def _fc2(model):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return next(m for m in model.modules() if isinstance(m, TransformerLayer)).mlp.linear_fc2


def _plant(module, args):
    """+Inf in the first PLANTED elements of linear_fc2's input (what mlp.fc2_input stores)."""
    x = args[0].clone()
    x.view(-1)[:PLANTED] = float("inf")
    SEEN.append(x.numel())
    return (x, *args[1:])


def _run(plant: bool, caplog, plan="compress"):
    model = R.build(dropout=0.0, num_layers=2, seed=0)
    controller = apply(model, ActConfig(plan=plan, fidelity_every=0))
    handle = _fc2(model).register_forward_pre_hook(_plant) if plant else None
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay finite
    gen = torch.Generator().manual_seed(7)
    with caplog.at_level(logging.WARNING):
        _train(model, controller, opt, gen, 1)  # no report point: nothing read
        before = [r.getMessage() for r in caplog.records if "side lists" in r.getMessage()]
        controller.request_fidelity()
        _train(model, controller, opt, gen, 1)  # a report point: read once
    if handle is not None:
        handle.remove()
    warned = [r.getMessage() for r in caplog.records if "side lists" in r.getMessage()]
    return controller, before, warned


def test_an_overflow_is_warned_at_the_next_report_point_and_summarised(caplog):
    SEEN.clear()
    controller, before, warned = _run(True, caplog)
    assert controller.plan[0]["mlp.fc2_input"] == "outlier_int4"
    assert before == []  # iteration 1 had no report point: not read, no sync
    # at least what fc2's codec could not keep over the two training forwards (the Inf runs on
    # through the residual stream to every later site; the report's passes use codecs of
    # their own, which count nowhere)
    expected = controller.nonfinite_overflow()
    assert expected >= 2 * (PLANTED - nonfinite_capacity(SEEN[0])) > 0
    assert len(warned) == 1 and f"{expected} non-finite values (NaN, +-Inf) did not fit" in warned[0]
    assert "since iteration 0 and decoded to NaN" in warned[0]
    assert f"{expected} non-finite values past the codecs' side lists" in controller.adapter.overflow_text()


def test_a_clean_run_reads_zero_and_says_so(caplog):
    controller, before, warned = _run(False, caplog)
    assert before == [] and warned == [] and controller.nonfinite_overflow() == 0
    assert controller.adapter.overflow_text() == "every non-finite value decoded exactly"
