"""The global optimizer-step hook of `Controller.watch` (plan boundaries with no call of ours)
survives a controller collected in the middle of an `optimizer.step()`: torch iterates its
hook dict while calling the hooks, and a hook removed then (the old per-controller hook,
removed by the controller's finalizer when a garbage collection ran inside a hook) ended the
step with "OrderedDict mutated during iteration" (seen when one test built a second model
while the first one's controller was still alive in a reference cycle)."""
from __future__ import annotations

import gc

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from llm_act import ActConfig
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _step(model, opt, seed=0):
    ids, pos, labels = R.batch(seed=seed)
    model(ids, pos, None, labels=labels).float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_controller_collected_during_a_step_leaves_the_step_alone():
    from llm_act.patches.megatron import apply

    enabled = gc.isenabled()
    gc.disable()  # the collection happens inside the step, where this test puts it
    collect = register_optimizer_step_post_hook(lambda *_: gc.collect())
    try:
        old = R.build()
        apply(old, ActConfig(plan="keep"))
        _step(old, torch.optim.SGD(old.parameters(), lr=0.0))
        del old  # its controller now lives only in reference cycles
        model = R.build()
        controller = apply(model, ActConfig(plan="keep"))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for i in range(3):
            _step(model, opt, seed=i)  # the first collects the old controller mid-step
        assert controller.iteration == 3
    finally:
        collect.remove()
        if enabled:
            gc.enable()
