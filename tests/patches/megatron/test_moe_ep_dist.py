"""Compressed MoE layers under expert parallelism (EP=2 over gloo, 2 experts per rank): "keep"
is bit-identical to stock EP=2, "compress" stays within the dense bound and a quarter of the
bytes on every rank, "recompute" (the whole block, dispatch included) matches stock, and the plan is agreed across the expert-parallel group -- a rank handed
another MoE choice stops every rank with the site named, at `apply` and at `set_plan`."""
import pytest

pytest.importorskip("megatron.core")

from tests import testing as T  # noqa: E402

pytestmark = pytest.mark.dist


def _worker(rank, world_size, port, dispatchers):
    import torch

    from llm_act.runtime import agreement
    from tests import testing as T

    torch.set_num_threads(1)
    T.init_parallel(rank=rank, world_size=world_size, port=port, ep=world_size, seed=1234)
    g = agreement.groups()
    assert agreement.expert_parallel_ranks() == [0, 1]
    assert sorted(torch.distributed.get_process_group_ranks(g.stage)) == [0, 1]  # EP inside the stage
    for dispatcher in dispatchers:
        _check(rank, dispatcher)


def _check(rank, dispatcher):
    import torch

    from llm_act import ActConfig
    from llm_act.runtime import agreement
    from llm_act.patches.megatron import apply
    from llm_act.sites import MOE_SITES
    from tests import gpt_runs as R
    from tests.patches.megatron.moe_runs import build_moe
    from tests.patches.megatron.test_apply import SWIGLU_BOUND

    stock = R.step(build_moe(dispatcher), ledger=True)
    model = build_moe(dispatcher)
    apply(model, ActConfig(plan="keep"))
    loss, grads, _ = R.step(model)
    assert torch.equal(loss, stock[0])
    R.assert_same(grads, stock[1])

    model = build_moe(dispatcher)
    ctl = apply(model, ActConfig(plan="compress"))
    _, grads, led = R.step(model, ledger=True)
    R.check_gradients(grads, stock[1], *SWIGLU_BOUND)
    for layer in (0, 1):
        comp = sum(led.by_site().get((layer, s), 0) for s in MOE_SITES)
        base = sum(stock[2].by_site()[(layer, s)] for s in MOE_SITES)
        assert 0 < comp <= 0.25 * base, (rank, layer, comp, base)

    plan = {layer: dict(ctl.plan[layer]) for layer in ctl.plan}  # "compress"

    # the whole block recomputed: backward re-runs the dispatcher's collectives on both ranks
    ctl.set_plan("recompute")
    _, grads, led = R.step(model, ledger=True)
    assert not any(site.startswith("moe.") for (_, site) in led.by_site())
    assert R.rel_error(grads, stock[1]) < 1e-5

    # a set_plan that differs on one expert-parallel rank stops both
    if rank == 1:
        plan[1]["moe.act_input"] = "int8"
    with pytest.raises(agreement.Disagreement, match="moe.act_input"):
        ctl.set_plan(plan)

    # so does an apply handed other MoE codecs on one rank
    codecs = {"moe.fc1_input": "int8"} if rank == 1 else {}
    with pytest.raises(agreement.Disagreement, match="moe.fc1_input"):
        apply(build_moe(dispatcher), ActConfig(plan="compress", codecs=codecs))


def test_moe_under_expert_parallelism():
    """Both token dispatchers in one pair of processes (starting them is most of the time)."""
    T.spawn(_worker, 2, ("alltoall", "allgather"), timeout=240)
