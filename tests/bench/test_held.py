"""`held_after_forward` and `ledger_and_held`, the process-memory check of the ledger: what
they report must not depend on what ran before (the test that compared them once failed in a
full run and passed alone)."""
import torch
from torch.profiler import ProfilerActivity, profile

from llm_act.bench.memory import held_after_forward, ledger_and_held


def test_a_free_of_an_older_block_is_not_this_forwards():
    """A block allocated under an earlier profiler (another test's, say) and freed inside the
    measured forward: summing the profiler's events would subtract it."""
    cache = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        cache["old"] = torch.empty(1 << 16, dtype=torch.uint8)

    def forward():
        cache.pop("old", None)  # the older block goes
        cache["saved"] = torch.ones(1000)  # what this forward keeps, as an activation would
        return torch.zeros(10)

    assert held_after_forward(forward, runs=1) == 4000


def test_ledger_and_held_see_the_same_draws():
    """A forward whose saved size follows its random draws (as outlier_int4's does under
    dropout): the ledger's forward and the profiled ones start from one RNG state."""
    w = torch.ones(1, requires_grad=True)

    def forward():
        n = int(torch.randint(1_000, 10_000, ()))  # a different size every draw
        return (w.expand(n) * 1.0).exp().sum()  # exp saves its output: 4n bytes

    torch.manual_seed(0)
    sizes = set()
    for _ in range(3):
        led, held = ledger_and_held(forward)
        sizes.add(led.total_bytes)
        assert abs(held - led.total_bytes) <= 64  # a few bytes of scalars beside it
    assert len(sizes) == 3  # the RNG moves on between measurements, as it does between tests

