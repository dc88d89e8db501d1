"""Measuring never stops training (issue 41): a failure inside a tracking point or a
gradient-fidelity report, injected on one of two data-parallel gloo ranks, is skipped on both
ranks. Both train to the end with the plan in force unchanged; each logs one warning line and
counts the skip in its summary. Nothing hangs: every spawn has a timeout.

The failures are raised by the library's own functions, patched on one rank only:
- the sensitivity round on rank 1 (its peer waits in the next reduction);
- the solver on the source rank alone (its peer waits for the broadcast decision);
- the fidelity report's passes on rank 0.
"""
from __future__ import annotations

import logging
import warnings

import pytest

from tests import testing as T

pytestmark = pytest.mark.dist

STEPS = 6
#: the tracking point (the controller's iteration) that fails
FAIL_AT = 3
SKIPPED = "failed and is skipped on every rank"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _worker(rank, world, port, where):
    warnings.filterwarnings("ignore")
    import torch

    from llm_act import ActConfig
    from llm_act.measurement import fidelity
    from llm_act.patches.megatron import apply
    from llm_act.runtime import agreement, solving
    from tests import gpt_runs as R

    T.init_parallel(tp=1, rank=rank, world_size=world, port=port)
    torch.manual_seed(0)
    model = R.build(dropout=0.0)
    every = FAIL_AT if where == "report" else 250
    controller = apply(model, ActConfig(plan="auto", adapt_interval_max=1, fidelity_every=every))
    failing_rank = {"sensitivity": 1, "solve": 0, "report": 0}[where]

    def failing(original):
        def wrapped(*args, **kwargs):
            if rank == failing_rank and controller.iteration == FAIL_AT:
                raise RuntimeError(f"injected failure in {where}")
            return original(*args, **kwargs)
        return wrapped

    if where == "sensitivity":
        m = controller.adapter.measured
        m.track_sensitivity = failing(m.track_sensitivity)  # this instance's
    elif where == "solve":
        solving.solve = failing(solving.solve)
    else:
        fidelity.measure_sums = failing(fidelity.measure_sums)

    lines = _Lines()
    logging.getLogger("llm_act").addHandler(lines)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plans = {}
    for i in range(STEPS):
        ids, pos, labels = R.batch(seed=10 * i + rank)
        model(ids, pos, None, labels=labels).float().mean().backward()
        opt.step()  # the controller advances here, and tracks
        opt.zero_grad(set_to_none=True)
        plans[controller.iteration] = {k: dict(v) for k, v in (controller.pending_plan or controller.plan).items()}

    a = controller.adapter
    assert controller.iteration == STEPS
    skipped = [line for line in lines.lines if SKIPPED in line]
    assert len(skipped) == 1 and f"iteration {FAIL_AT}:" in skipped[0], lines.lines
    assert [s["iteration"] for s in a.round.skipped] == [FAIL_AT]
    if rank == failing_rank:
        assert f"injected failure in {where}" in skipped[0]
    else:
        assert "another rank's measurement failed" in skipped[0]
    assert "1 measurements skipped" in a.summary()
    if where != "report":
        # the skipped point changed nothing: the plan of the iteration before stays
        assert plans[FAIL_AT] == plans[FAIL_AT - 1]
        assert FAIL_AT not in a.tracked and FAIL_AT + 1 in a.tracked
    else:
        assert not any(r.iteration == FAIL_AT for r in a.measured.fidelity)
    # both ranks went on measuring together, and hold the same plan at the end
    assert a.tracked[-1] == STEPS
    got = agreement.gather(plans[STEPS])
    assert got[0] == got[1]
    T.destroy_parallel()


@pytest.mark.parametrize("where", ["sensitivity", "solve", "report"])
def test_a_failure_on_one_rank_is_skipped_on_both_and_training_goes_on(where):
    T.spawn(_worker, 2, where, timeout=150)
