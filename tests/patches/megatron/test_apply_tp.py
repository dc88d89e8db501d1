"""`apply` under tensor parallelism: 2 gloo ranks on CPU.

"keep" gives stock gradients bit for bit on every rank (dropout on, float32 and bfloat16,
the stock model run in the same process first), also after compress -> keep through the
Controller; "compress" runs the TP paths of the compressed linears within the TP=1 bound;
a sequence-parallel model builds from `block_spec` and matches the non-SP stock model.
"""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests import testing as T  # noqa: E402

pytestmark = pytest.mark.dist
#: gradient bound of "compress" vs "keep" (chunked attention) under TP=2: relative error over
#: all parameters and per parameter (`check_gradients`). Measured (fp32 and bf16 alike):
#: the real codecs 0.110 total, worst parameter 0.243; zeros decoded at ln1.input of layer 1
#: 0.111 and 1.005 (the old bound, 0.25 on the total alone, let it through); at
#: mlp.fc2_input of layer 0 0.33-0.34 and 1.000; at final_norm.input (the last layer's, replicated
#: over TP) 0.164 and 1.04 (17th session, fp32 and bf16).
BOUND = (0.16, 0.4)


def _keep_worker(rank, world_size, port):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply
    from tests.patches import broken_codec
    from tests import gpt_runs as R

    T.init_parallel(tp=2, rank=rank, world_size=world_size, port=port)
    for dtype in (torch.float32, torch.bfloat16):
        stock = R.build(dtype=dtype, dropout=0.1)
        loss0, grads0, _ = R.step(stock)
        rng0 = torch.get_rng_state()
        model = R.build(dtype=dtype, dropout=0.1)
        ctl = apply(model, ActConfig(plan="keep"))
        loss1, grads1, _ = R.step(model)
        assert torch.equal(loss0, loss1), (rank, dtype)
        R.assert_same(grads0, grads1)
        assert torch.equal(rng0, torch.get_rng_state())

        # "compress" runs the memory-efficient attention (chunked on CPU with dropout), whose
        # attention-dropout draws are not stock's: its reference is "keep" on that attention
        ref = R.build(dtype=dtype, dropout=0.1)
        apply(ref, ActConfig(plan="keep", attention="chunked"))
        loss_r, grads_r, _ = R.step(ref)
        ctl.set_plan("compress")
        with ctl.step():
            loss_c, grads_c, _ = R.step(model)
        assert torch.equal(loss_c, loss_r)
        assert R.rel_error(grads_c, grads_r) > 0
        R.check_gradients(grads_c, grads_r, *BOUND)
        # the bound is not loose; the final norm's input (replicated over TP, after the last
        # block) is one of the sites it catches
        for site, layer in (("ln1.input", 1), ("mlp.fc2_input", 0), ("final_norm.input", 1)):
            with broken_codec.broken(site, layer):
                broken = R.build(dtype=dtype, dropout=0.1)
                apply(broken, ActConfig(plan="compress"))
            grads_b = R.step(broken)[1]
            with pytest.raises(AssertionError, match="relative"):
                R.check_gradients(grads_b, grads_r, *BOUND)
        ctl.set_plan("keep")
        with ctl.step():
            loss2, grads2, _ = R.step(model)
        assert torch.equal(loss2, loss0)
        R.assert_same(grads0, grads2)


def test_keep_is_stock_under_tp2():
    T.spawn(_keep_worker, 2, timeout=180)


def _sp_worker(rank, world_size, port):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply, block_spec
    from tests import gpt_runs as R

    T.init_parallel(tp=2, rank=rank, world_size=world_size, port=port)
    stock = R.build(dropout=0.0)
    loss0, grads0, _ = R.step(stock)
    sp = dict(sequence_parallel=True, tensor_model_parallel_size=2)
    sp_cfg = T.small_config(dropout=0.0, **sp)
    model = R.build(dropout=0.0, spec=block_spec(ActConfig(), sp_cfg), **sp)
    ctl = apply(model, ActConfig(plan="keep"))
    assert ctl.layers == (0, 1)
    loss1, grads1, _ = R.step(model)
    # SP only moves where the sums happen (reduce-scatter / all-gather instead of
    # all-reduce); the norms' gradients are partial sums over the sequence shards, which
    # megatron's DDP all-reduces over TP (params marked `sequence_parallel`)
    from megatron.core import parallel_state

    marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]
    assert any("input_layernorm" in n for n in marked) and any("final_layernorm" in n for n in marked)
    for name in marked:
        torch.distributed.all_reduce(grads1[name], group=parallel_state.get_tensor_model_parallel_group())
    assert torch.allclose(loss0, loss1, rtol=1e-6, atol=1e-6)
    assert R.rel_error(grads1, grads0) < 1e-5


def test_sequence_parallel_model_builds_from_block_spec():
    T.spawn(_sp_worker, 2, timeout=180)


def _qk_layernorm_worker(rank, world_size, port):
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    from llm_act import ActConfig
    from llm_act.ledger import SavedTensorLedger
    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    T.init_parallel(tp=2, rank=rank, world_size=world_size, port=port)
    kw = dict(dropout=0.0, qk_layernorm=True, normalization="RMSNorm", num_query_groups=2,
              spec=T.local_layer_spec(normalization="RMSNorm", qk_layernorm=True))
    loss0, grads0, _ = R.step(R.build(**kw))
    model = R.build(**kw)
    ctl = apply(model, ActConfig(plan="keep"))
    loss1, grads1, _ = R.step(model)
    assert torch.equal(loss0, loss1), rank
    R.assert_same(grads0, grads1)
    # "compress" encodes the per-head norm inputs of this rank's heads
    ctl.set_plan("compress")
    with ctl.step():
        loss_c, grads_c, led = R.step(model, ledger=True)
    assert abs(float(loss_c) - float(loss0)) < 0.05
    assert all(torch.isfinite(g).all() for g in grads_c.values())
    sites = led.by_site()
    for site in ("attn.q_norm_input", "attn.k_norm_input"):
        assert ctl.codec(0, site).name == "outlier_int4" and (0, site) in sites
    assert not [k for k in sites if k[0] is not None and k[1] == "other"]


def test_qk_layernorm_under_tp2():
    T.spawn(_qk_layernorm_worker, 2, timeout=180)
