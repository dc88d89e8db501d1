"""The one guard on per-iteration training loss (issue 25): the README main job's
configuration (`llm-act train`'s defaults: GPT 2 x 128, seq 128, micro-batch 4, dropout
0.1 / 0.1, lr 2e-3), stock and compressed side by side in one process, as `llm-act train`
runs them.

Compression acts in backward only, so:
- the first iteration's forward is stock's, up to float rounding, for every plan (same weights, same
  data, same dropout masks). This is what the README job broke: our attention drew its
  dropout masks with a formula of its own (`rand >= p` per tile) instead of dropout's
  (`bernoulli_` over the whole probabilities), so every non-"keep" plan trained with another
  dropout realization. The iteration-17 batch of seed 1234 moves by 0.8 nats between
  attention-dropout draws of stock itself (3.18 to 3.95 over 7 draws), which was the jump;
- plan "recompute" is lossless and runs the same attention, masks and recompute machinery:
  within 1e-3 at every iteration (measured: 1e-4 over 40 iterations);
- plan "compress" (the README job) stays within `COMPRESS_BOUND` at every iteration. The
  issue asked for 0.05; healthy 4-bit stochastic rounding measures 0.128 / 0.034 / 0.065
  (seeds 1234 / 1235 / 1236, 40 iterations; int8 everywhere 0.005, recompute 1e-4: the gap
  scales with the codec's noise), the largest at iteration 17 of seed 1234, a batch where
  stock's own gradient norm jumps to 42 from about 1. 0.05 would fail a healthy codec; 0.25
  fails the defect (0.81) with a margin of 3x.

The default run covers seed 1234 to iteration 18 (past the original jump) and the first
iterations of the two other seeds; the slow version runs all 40 iterations of the three.
"""
from __future__ import annotations

import argparse

import pytest

from llm_act.cli.main import _parser
from llm_act.train import compare, parallel
from llm_act.train.args import check
from llm_act.train.loop import load_data

SEEDS = (1234, 1235, 1236)
#: the first forward is stock's up to float rounding (our layers' forward ops may round
#: differently: 5e-7 measured); another attention-dropout draw moves it by 7e-4
FIRST_FORWARD_TOL = 1e-5
RECOMPUTE_BOUND = 1e-3
COMPRESS_BOUND = 0.25


def _args(seed: int, plan: str) -> argparse.Namespace:
    args = _parser().parse_args(["train", "--seed", str(seed), "--act-compress-plan", plan,
                                 "--no-act-compress-adapt", "--lr-decay-iters", "40"])
    args.act_compress = True
    args.lr_warmup_iters = 4  # `llm-act train`'s default for a 40-iteration schedule
    return check(args.train_parser, args, world_size=1)


def losses(seed: int, iterations: int, plans=("compress", "recompute")) -> dict[str, list[float]]:
    """Per-iteration training losses of stock and of each plan, all in lockstep in one
    process (each with its own RNG state, as `llm-act train` runs its two)."""
    first = _args(seed, plans[0])
    parallel.init(first)
    try:
        data = load_data(first)
        runs = {"stock": compare._Run("stock", compare._stock_args(first), data)}
        for plan in plans:
            args = _args(seed, plan)
            args.vocab_size = first.vocab_size  # filled in from the data by load_data
            runs[plan] = compare._Run(plan, args, data)
        for _ in range(iterations):
            for r in runs.values():
                r.step(measure=False, timed=False)
        return {name: r.losses for name, r in runs.items()}
    finally:
        parallel.destroy_parallel()


def check_guard(curves: dict[str, list[float]]) -> None:
    stock = curves["stock"]
    for plan, got in curves.items():
        if plan == "stock":
            continue
        assert abs(got[0] - stock[0]) <= FIRST_FORWARD_TOL, \
            f"{plan}: the first forward is not stock's ({got[0]} vs {stock[0]})"
        gap, at = compare.largest_gap(stock, got)
        bound = RECOMPUTE_BOUND if plan == "recompute" else COMPRESS_BOUND
        assert gap <= bound, f"{plan}: loss {got[at - 1]:.4f} vs stock {stock[at - 1]:.4f} at iteration {at}"


def test_readme_job_has_no_loss_jump_through_its_first_spike():
    check_guard(losses(1234, 18))


@pytest.mark.parametrize("seed", SEEDS[1:])
def test_first_iterations_are_stocks_at_other_seeds(seed):
    check_guard(losses(seed, 3))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_readme_job_within_the_bound_at_every_iteration(seed):
    check_guard(losses(seed, 40))
