"""`median_ms` times at least `repeat` calls, and more (up to `max_repeat`) until they add up
to `min_total_ms`: how the GPU bench keeps short steps from deciding a ratio on three samples."""
import time

import torch

from llm_act.bench.timing import median_ms


def _sleeper(ms: float, calls: list):
    def fn():
        calls.append(1)
        time.sleep(ms / 1e3)
    return fn


def test_repeat_alone_times_exactly_repeat_calls_after_the_warmup():
    calls: list = []
    ms = median_ms(_sleeper(2.0, calls), torch.device("cpu"), warmup=1, repeat=3)
    assert len(calls) == 4 and 2.0 <= ms < 50.0


def test_short_calls_are_repeated_until_the_total_is_reached():
    calls: list = []
    median_ms(_sleeper(2.0, calls), torch.device("cpu"), warmup=0, repeat=3, min_total_ms=30.0, max_repeat=40)
    assert 4 <= len(calls) <= 15  # ~30 ms of 2 ms calls (sleep overshoots), never just 3


def test_max_repeat_caps_the_calls():
    calls: list = []
    median_ms(_sleeper(1.0, calls), torch.device("cpu"), warmup=0, repeat=2, min_total_ms=1e6, max_repeat=7)
    assert len(calls) == 7
