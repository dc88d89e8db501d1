"""A short paired run of plan "auto" stays near stock's validation loss, and a run whose codecs
are deliberately broken (every codec decodes to zeros) does not: the bound means something.

The gap is the worst one over the run's validation points (paired with stock, point by
point): at the end of the cosine schedule this tiny model converges close to stock even with
broken codecs (+0.2% at step 40 against +2.6% at step 4). The broken run uses the fixed
"compress" plan at the same budget, so that every site goes through a broken codec: "auto"
measures its codecs and re-plans around broken ones (its broken run kept within 0.42% with
a gradient fidelity of 0.06), which makes it no negative control.

Our loop (`llm_act.train.Trainer`), a tiny GPT on the embedded corpus, CPU; "auto" under a
tight budget (a quarter of stock's bytes in the layers), with its default noise budget,
measuring from its own training steps. The long, multi-seed version of this is
`llm-act bench convergence` (docs/benchmarks.md).
"""
from __future__ import annotations

import warnings

import pytest

from llm_act.bench import convergence as C
from tests.patches.broken_codec import broken

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

TINY = C.gpt("tiny", 2, 64, 4, 64, 4)
STEPS = 40
#: |valid(auto) / valid(stock) - 1| at every validation point, same seed (weights, batches)
BOUND = 0.005
#: a gradient-fidelity report half way and at the end
REPORTS = ("--act-compress-fidelity-every", str(STEPS // 2))


@pytest.fixture(scope="module")
def runs():
    from llm_act.train import parallel
    from llm_act.train.data import embedded_corpus

    data = embedded_corpus()
    parallel.init(C.train_args(STEPS, 1234, False, model=TINY))
    try:
        stock = C.train_one(TINY, "stock", 1234, STEPS, data)
        budget = C.budget_for(stock, 0.25)
        auto = C.train_one(TINY, "auto 0.25", 1234, STEPS, data, budget, extra=REPORTS)
        with broken():
            bad = C.train_one(TINY, "compress", 1234, STEPS, data, budget, extra=REPORTS)
    finally:
        parallel.destroy_parallel()
    return stock, auto, bad


def _gap(run, stock) -> float:
    """The worst |valid / stock's valid - 1| over the validation points (same steps)."""
    assert run["steps"] == stock["steps"]
    return max(abs(a / b - 1) for a, b in zip(run["valid"], stock["valid"]))


def test_auto_stays_within_the_bound_at_a_quarter_of_the_memory(runs):
    stock, auto, _ = runs
    assert C.finite_decreasing(stock) and C.finite_decreasing(auto)
    # its budget: a quarter of stock's layer bytes, plus the backward transient it reserves
    assert auto["block_bytes"] <= 0.25 * stock["block_bytes"] + stock["transient_bytes"], auto["plan"]
    assert _gap(auto, stock) <= BOUND, (_gap(auto, stock), auto["plan"])
    assert 0 < auto["fidelity"] < 0.3, auto["plan"]


def test_a_broken_codec_exceeds_the_bound(runs):
    stock, auto, bad = runs
    assert _gap(bad, stock) > BOUND, _gap(bad, stock)
    # and the fidelity report says so: the compressed gradient is far from the exact one
    assert bad["fidelity"] > 0.3, bad["fidelity"]  # auto's: about 0.0015
