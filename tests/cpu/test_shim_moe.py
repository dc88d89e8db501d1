"""The CPU shim runs stock megatron-core MoE layers: SequentialMLP experts, top-2 routing
with the aux loss, the allgather and alltoall token dispatchers, EP=2 over gloo; `apply()` refuses
only the MoE settings it does not handle (grouped GEMM here)."""
import importlib

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only torch"),
              pytest.mark.usefixtures("megatron_one_rank")]  # tests/conftest.py

from llm_act.cpu import shim  # noqa: E402
from tests import testing as T  # noqa: E402

VOCAB, SEQ, BATCH, EXPERTS, TOPK = 64, 16, 2, 4, 2
DISPATCHERS = ("allgather", "alltoall")


def _moe_config(dispatcher, **overrides):
    # add_bias_linear=False as in every megatron MoE recipe: with expert biases at ETP=1,
    # stock MLP.forward adds the bias in place on a custom Function's view (an autograd
    # error on any device, not a CUDA assumption).
    kw = dict(
        hidden_size=32, num_attention_heads=4, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
    )
    kw.update(overrides)
    return T.small_config(**kw)


def _moe_model(cfg):
    return T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ,
                       spec=T.local_layer_spec(num_experts=EXPERTS, moe_grouped_gemm=False))


def _loss(model, batch):
    ids, pos, labels = batch
    return model(ids, pos, None, labels=labels).float().mean()


def _batch(seed=7):
    return T.gpt_batch(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_install_patches_moe_once():
    shim.install()
    assert shim.install() == []
    router = importlib.import_module("megatron.core.transformer.moe.router")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    for mod in (router, dispatcher, moe_utils):
        assert getattr(mod.torch, shim.MARK) and mod.torch.__wrapped__ is torch
    assert router.torch.cuda.current_device() == torch.device("cpu")
    move = moe_utils.maybe_move_tensor_to_cpu
    assert getattr(move, shim.MARK) and dispatcher.maybe_move_tensor_to_cpu is move
    assert list(move(torch.tensor([3, 4]), as_numpy=True)) == [3, 4]
    stream = dispatcher.torch.cuda.Stream()
    with dispatcher.torch.cuda.stream(stream):
        stream.wait_stream(dispatcher.torch.cuda.current_stream())
    stream.record_event().synchronize()
    if not moe_utils.HAVE_TE:
        assert moe_utils.te_general_gemm is None


@pytest.mark.parametrize("dispatcher,shared", [(d, False) for d in DISPATCHERS] + [("alltoall", True)])
def test_moe_gpt_trains(dispatcher, shared):
    """Top-2 of 4 SequentialMLP experts with the aux loss (and, with `shared`, a shared expert
    overlapped on its side stream): forward, backward and a few AdamW steps on one rank give
    a finite, decreasing loss; megatron's MoE metrics logging runs."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        track_moe_metrics,
    )

    torch.manual_seed(0)
    extra = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True) if shared else {}
    model = _moe_model(_moe_config(dispatcher, **extra))
    mlp = model.decoder.layers[0].mlp
    assert isinstance(mlp.experts, SequentialMLP) and mlp.router.topk == TOPK
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch()
    losses = []
    for _ in range(6):
        clear_aux_losses_tracker()
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        opt.step()
        losses.append(loss.item())
    aux = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert torch.isfinite(aux).all() and (aux > 0).all()  # aux loss computed in every layer
    assert grads["decoder.layers.0.mlp.router.weight"].abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.1, losses
    logged = {}
    track_moe_metrics(loss_scale=1.0, iteration=1, total_loss_dict=logged, force_initialize=True,
                      track_names=["load_balancing_loss"], num_layers=2)
    assert torch.isfinite(logged["load_balancing_loss"])


def test_grouped_mlp_needs_the_grouped_gemm_package():
    """megatron-core 0.16's local spec builds the legacy GroupedMLP for moe_grouped_gemm=True,
    which calls the CUDA-only `grouped_gemm` extension; without it megatron refuses at build
    time (the shim does not emulate it). From 0.17 on the legacy GroupedMLP and its
    `grouped_gemm_util` are gone and the local spec builds SequentialMLP whatever the flag
    says: the model builds, and `apply` still refuses the flag naming the fix."""
    from llm_act.patches.megatron import apply, compat

    cfg = _moe_config("alltoall", moe_grouped_gemm=True)
    spec = T.local_layer_spec(num_experts=EXPERTS, moe_grouped_gemm=True)
    legacy = compat.legacy_grouped_gemm()
    if legacy is None:
        model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=spec)
        assert type(model.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
        with pytest.raises(NotImplementedError, match="moe_grouped_gemm=False"):
            apply(model)
        return
    if legacy.grouped_gemm_is_available():
        pytest.skip("grouped_gemm is installed")
    with pytest.raises(AssertionError, match="Grouped GEMM is not available"):
        T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=spec)


def test_apply_refuses_grouped_gemm_with_the_fix():
    """apply() converts SequentialMLP MoE layers (tests/patches/megatron/test_moe.py); what it
    still refuses, it refuses naming the fix."""
    from llm_act.patches.megatron import apply

    model = _moe_model(_moe_config("alltoall"))
    model.config.moe_grouped_gemm = True  # the layers share the model's config
    with pytest.raises(NotImplementedError, match="moe_grouped_gemm=False"):
        apply(model)


# ---- expert parallel over gloo -------------------------------------------------------------


def _ep_worker(rank, world_size, port, dispatcher, state, expected):
    import torch

    from tests import testing as T

    T.init_parallel(rank=rank, world_size=world_size, port=port, ep=world_size, seed=1234)
    model = _moe_model(_moe_config(dispatcher))
    local = EXPERTS // world_size
    mine = {}
    for name, value in model.state_dict().items():  # local expert i of rank r: r*local+i
        if not torch.is_tensor(value):  # megatron's _extra_state entries
            mine[name] = value
            continue
        src = name
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            i, rest = tail.split(".", 1)
            src = f"{head}.local_experts.{rank * local + int(i)}.{rest}"
        mine[name] = state[src]
    model.load_state_dict(mine)
    # the same batch on both ranks: every token's path is the EP=1 path
    loss = _loss(model, _batch())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [loss.item()]
    for _ in range(3):
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, _batch())
        loss.backward()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.dist
@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_expert_parallel_2_matches_ep1(dispatcher):
    """EP=2 over gloo (2 experts per rank): same weights and batch give the EP=1 loss, and
    training steps run."""
    torch.manual_seed(0)
    model = _moe_model(_moe_config(dispatcher))
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        expected = _loss(model, _batch())
    T.spawn(_ep_worker, 2, dispatcher, state, expected)
