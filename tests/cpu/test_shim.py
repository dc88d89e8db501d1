"""The megatron-core CPU shim: a stock GPT trains on CPU, seeds reproduce, TP=2 over gloo."""
import functools
import importlib
import sys
import textwrap

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CPU-only torch"),
              pytest.mark.usefixtures("megatron_one_rank")]

from llm_act.cpu import shim, stand_ins  # noqa: E402
from tests import testing as T  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 2


def _grads(model, batch):
    ids, pos, labels = batch
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels)
    loss.float().mean().backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _batch():
    return T.gpt_batch(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(7))


def test_install_is_idempotent_and_marks_what_it_patches():
    shim.install()
    assert shim.install() == []  # second call: nothing left to patch
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    fork = random.CudaRNGStatesTracker.__dict__["fork"]
    assert getattr(fork, shim.MARK) and fork.__wrapped__.__module__ == random.__name__
    assert getattr(random._get_cuda_rng_state, shim.MARK)
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    assert getattr(mappings.torch, shim.MARK) and mappings.torch.__wrapped__ is torch
    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    assert mappings.torch.zeros(2, device="cuda").device.type == "cpu"
    assert mappings.torch.Tensor is torch.Tensor
    assert shim.installed()


def test_foreign_patches_are_left_alone(tmp_path, monkeypatch):
    (tmp_path / "shimtarget.py").write_text(textwrap.dedent("""
        import contextlib
        import torch

        def plain():
            return 1

        @contextlib.contextmanager
        def managed():
            yield
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("shimtarget")
    try:
        assert stand_ins.is_stock_function(mod.plain, mod)
        assert stand_ins.is_stock_function(mod.managed, mod)  # stock @contextmanager counts
        original = mod.plain
        mod.plain = functools.wraps(original)(lambda: 2)  # someone else's wrapper
        assert not stand_ins.patch_attr(mod, "plain", lambda f: (lambda: 3), mod)
        assert mod.plain() == 2
        mod.plain = original
        assert stand_ins.patch_attr(mod, "plain", lambda f: (lambda: 3), mod)
        assert mod.plain() == 3 and mod.plain.__wrapped__ is original
        assert not stand_ins.patch_attr(mod, "plain", lambda f: (lambda: 4), mod)  # once
        mod.torch = object()  # a replaced global is not ours to replace
        assert stand_ins.replace_torch(("shimtarget",), stand_ins.CpuTorch) == []
    finally:
        sys.modules.pop("shimtarget", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_forward_backward(dtype):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    cfg = T.small_config(hidden_size=32, num_attention_heads=4, dtype=dtype, dropout=0.1)
    model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    loss, grads = _grads(model, _batch())
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32
    assert torch.isfinite(loss).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert all(p.dtype == dtype for n, p in model.named_parameters() if "layernorm" not in n)
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].abs().sum() > 0


def test_tracker_dropout_reproduces_from_the_seed():
    """Attention dropout runs under the tracker: it follows model_parallel_cuda_manual_seed,
    not the default generator, and leaves the default generator where it was."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    cfg = T.small_config(hidden_size=32, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.5)
    model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    batch = _batch()
    runs = []
    for i, seed in enumerate((11, 11, 12)):
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(100 + i)  # a different default stream every run
        before = torch.get_rng_state()
        runs.append(_grads(model, batch))
        assert torch.equal(before, torch.get_rng_state())
    (l1, g1), (l2, g2), (l3, g3) = runs
    assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    assert not torch.equal(l1, l3)
    assert not torch.equal(g1["decoder.layers.0.self_attention.linear_qkv.weight"],
                           g3["decoder.layers.0.self_attention.linear_qkv.weight"])


def test_seed_call_seeds_the_default_generator_like_cuda():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5)
    a = torch.rand(4)
    model_parallel_cuda_manual_seed(5)
    assert torch.equal(a, torch.rand(4))
    states = get_cuda_rng_tracker().get_states()
    assert set(states) >= {"model-parallel-rng", "data-parallel-rng"}
    assert all(s.dtype == torch.uint8 and s.device.type == "cpu" for s in states.values())


def _tp_worker(rank, world_size, port, expected_loss):
    import torch

    from tests import testing as T

    T.init_parallel(tp=world_size, rank=rank, world_size=world_size, port=port, seed=1234)
    torch.manual_seed(0)
    cfg = T.small_config(hidden_size=32, num_attention_heads=4, dropout=0.0)
    model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    loss, grads = _grads(model, _batch())
    assert all(torch.isfinite(g).all() for g in grads.values())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-4, atol=1e-5)


@pytest.mark.dist
def test_tensor_parallel_2_matches_tp1():
    """TP=2 over gloo gives the TP=1 loss (CPU init builds the same full weights, then splits)."""
    torch.manual_seed(0)
    cfg = T.small_config(hidden_size=32, num_attention_heads=4, dropout=0.0)
    model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    loss, _ = _grads(model, _batch())
    T.spawn(_tp_worker, 2, loss)


def _pp_worker(rank, world_size, port):
    import math

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests import testing as T

    T.init_parallel(pp=world_size, rank=rank, world_size=world_size, port=port)
    cfg = T.small_config(hidden_size=32, num_attention_heads=4, pipeline_dtype=torch.float32)
    model = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ,
                        pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage())
    batches = iter([T.gpt_batch(BATCH, SEQ, VOCAB, torch.Generator().manual_seed(i)) for i in range(3)])

    def step(data_iterator, model):
        ids, pos, labels = next(data_iterator)
        out = model(ids, pos, None, labels=labels)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    losses = get_forward_backward_func()(
        forward_step_func=step, data_iterator=batches, model=[model], num_microbatches=3,
        seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    if ps.is_pipeline_last_stage():  # an untrained model: per-token loss ~ ln(vocab)
        assert len(losses) == 3
        values = [d["loss"].item() for d in losses]
        assert all(abs(v - math.log(VOCAB)) < 0.5 for v in values), values


@pytest.mark.dist
def test_pipeline_parallel_2_runs_1f1b():
    """PP=2 over gloo: the 1F1B schedule's p2p exchange and token counter run on CPU."""
    T.spawn(_pp_worker, 2)
