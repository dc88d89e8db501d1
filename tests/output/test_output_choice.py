"""`ActConfig.output_loss`: the chunked output loss as a choice (issue 27, item 2).

The config field and its doors (Megatron-LM flags, the DeepSpeed section, `llm-act train`);
`apply()` with "chunked" on a real tiny megatron-core GPTModel (stock's loss and gradients
within tests/output's fp32 tolerance, 1e-5; no [tokens, vocab] tensor), "keep" with "auto"
bit-identical to stock, the one-line refusals; the Controller's switch between iterations;
and the adaptive planner's choice (`llm_act.runtime.output_choice`): stock when memory is
plentiful, chunked when only it fits.
"""
from __future__ import annotations

import argparse
import logging
import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.config import OUTPUT_LOSS_MODES
from llm_act.output import DEFAULT_CHUNK_TOKENS
from llm_act.runtime import output_choice
from llm_act.runtime.output_choice import OutputSizes, choose
from tests.output.test_chunked_loss import _MaxNumel
from tests.rel_error import rel_error

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

VOCAB, SEQ, BATCH, HIDDEN = 2048, 32, 2, 32
TOKENS = SEQ * BATCH


# ---- the config and its doors ---------------------------------------------------------------
def test_config_defaults_and_resolution():
    cfg = ActConfig()
    # the default is megatron's own loss: the planner chooses only when asked ("auto")
    assert cfg.output_loss == "stock" and cfg.output_chunk_tokens == DEFAULT_CHUNK_TOKENS
    assert OUTPUT_LOSS_MODES == ("auto", "stock", "chunked")
    assert ActConfig().output_loss_mode() == "stock"
    assert ActConfig(output_loss="auto").output_loss_mode() == "auto"  # plan "auto": the planner decides
    for plan in ("keep", "compress", "recompute"):
        assert ActConfig(plan=plan).output_loss_mode() == "stock"  # auto = stock under a fixed plan
        assert ActConfig(plan=plan, output_loss="chunked").output_loss_mode() == "chunked"
    assert ActConfig(output_loss="stock").output_loss_mode() == "stock"


@pytest.mark.parametrize("bad, key, words", [
    ({"output_loss": "fast"}, "output_loss", "auto, stock, chunked"),
    ({"output_loss": None}, "output_loss", "auto, stock, chunked"),
    ({"output_chunk_tokens": 0}, "output_chunk_tokens", ">= 1"),
    ({"output_chunk_tokens": True}, "output_chunk_tokens", ">= 1"),
    ({"output_chunk_tokens": "64"}, "output_chunk_tokens", ">= 1"),
])
def test_bad_values_name_the_field_and_the_allowed_values(bad, key, words):
    with pytest.raises(ValueError) as err:
        ActConfig.from_dict(bad)
    text = str(err.value)
    assert text.startswith(key + ":") and words in text and "\n" not in text


def test_megatron_lm_flags():
    from llm_act.patches.megatron.args import add_arguments, config_from_args

    p = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = p.parse_args(["--act-compress", "--act-compress-output-loss", "chunked",
                         "--act-compress-output-chunk-tokens", "64"])
    assert config_from_args(args) == ActConfig(output_loss="chunked", output_chunk_tokens=64)
    assert config_from_args(p.parse_args(["--act-compress"])).output_loss == "stock"
    help_text = p.format_help()
    assert "--act-compress-output-loss" in help_text and "never the full logits" in help_text


@pytest.mark.parametrize("argv, flag", [
    (["--act-compress-output-loss", "fused"], "--act-compress-output-loss"),
    (["--act-compress-output-chunk-tokens", "0"], "--act-compress-output-chunk-tokens"),
])
def test_bad_flags_are_argparse_errors_naming_the_flag(argv, flag, capsys):
    from llm_act.patches.megatron.args import add_arguments

    p = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with pytest.raises(SystemExit) as err:
        p.parse_args(["--act-compress", *argv])
    assert err.value.code == 2 and flag in capsys.readouterr().err


def test_deepspeed_section():
    from llm_act.patches.deepspeed import ds_config

    cfg = ds_config.act_config({"activation_compression": {"output_loss": "stock", "output_chunk_tokens": 256}})
    assert cfg == ActConfig(output_loss="stock", output_chunk_tokens=256)
    with pytest.raises(ValueError, match=r"^activation_compression\.output_loss: expected one of auto"):
        ds_config.act_config({"activation_compression": {"output_loss": "chunky"}})


def test_llm_act_train_options():
    from llm_act.train.args import parse_args

    args = parse_args(["--act-compress", "--act-compress-output-loss", "chunked",
                       "--act-compress-output-chunk-tokens", "128"])
    assert args.act_config.output_loss == "chunked" and args.act_config.output_chunk_tokens == 128


# ---- the decision rule (pure) ---------------------------------------------------------------
class _Plan:
    def __init__(self, overhead_ms):
        self.overhead_ms = overhead_ms


def _trial(need_static_at_most, ms_at):
    """A fake solver: fits while static <= need_static_at_most, adding ms_at(static)."""
    return lambda static, _loss: _Plan(ms_at(static)) if static <= need_static_at_most else None


SIZES = OutputSizes(tokens=TOKENS, hidden=HIDDEN, vocab_local=VOCAB, elem_bytes=4)


def test_sizes_are_the_ops_byte_counts():
    from llm_act.output import stock_logits_bytes, stored_bytes

    assert SIZES.stock_bytes == TOKENS * HIDDEN * 4 + stock_logits_bytes(TOKENS, VOCAB)
    assert SIZES.chunked_bytes == stored_bytes(TOKENS, HIDDEN, 4)
    assert SIZES.saving == TOKENS * (4 * VOCAB + 9) - 4 * TOKENS
    assert SIZES.gemm_flops == 2 * TOKENS * VOCAB * HIDDEN


def test_choose_stock_when_plentiful_chunked_when_only_it_fits_or_cheaper():
    base = 10**6
    stock_static = base + SIZES.stock_bytes
    chunked_static = base + SIZES.chunked_bytes
    # plenty of memory: the stock plan adds nothing, chunked would add its GEMM
    got = choose(_trial(10**9, lambda s: 0.0), stock_static, "stock", SIZES, 1, gemm_ms=0.5)
    assert got.choice == "stock" and got.static_bytes == stock_static and got.chunked_ms is None
    # the same, measured while the chunked loss was in force: the same static bytes result
    got = choose(_trial(10**9, lambda s: 0.0), chunked_static, "chunked", SIZES, 1, gemm_ms=0.5)
    assert got.choice == "stock" and got.static_bytes == stock_static
    # only chunked fits
    got = choose(_trial(chunked_static, lambda s: 3.0), stock_static, "stock", SIZES, 1, gemm_ms=0.5)
    assert got.choice == "chunked" and got.static_bytes == chunked_static and got.stock_ms is None
    assert got.chunked_ms == 3.5 and "only it fits" in got.describe()
    # both fit; the chunked plan + GEMM is cheaper, or dearer
    cheaper = choose(_trial(10**9, lambda s: 5.0 if s == stock_static else 1.0), stock_static, "stock",
                     SIZES, 1, gemm_ms=0.5)
    dearer = choose(_trial(10**9, lambda s: 5.0 if s == stock_static else 4.8), stock_static, "stock",
                    SIZES, 1, gemm_ms=0.5)
    assert (cheaper.choice, cheaper.chunked_ms, dearer.choice) == ("chunked", 1.5, "stock")
    # nothing fits: chunked, the smaller memory, goes on to the tightest-plan path
    assert choose(_trial(0, lambda s: 0.0), stock_static, "stock", SIZES, 1, 0.5).choice == "chunked"
    # micro-batches in flight multiply the bytes
    two = choose(_trial(10**9, lambda s: 0.0), stock_static, "stock", SIZES, 2, 0.5)
    assert two.stock_bytes == 2 * SIZES.stock_bytes


def test_gemm_time_is_measured_or_estimated():
    from llm_act.planner.model_shape import DeviceModel

    weight = torch.randn(VOCAB, HIDDEN)
    sizes = OutputSizes(TOKENS, HIDDEN, VOCAB, 4, chunk_tokens=16)
    assert output_choice.measure_gemm_ms(weight, sizes) > 0
    dev = DeviceModel.cpu()
    flops = 2 * TOKENS * VOCAB * HIDDEN
    assert output_choice.estimate_gemm_ms(sizes, dev) == pytest.approx(flops / 1e12 * 1e3 + dev.launch_ms)
    # a weight that is not whole here (a ZeRO-3 partition): the estimate
    assert output_choice.measure_gemm_ms(torch.empty(0), sizes) == output_choice.estimate_gemm_ms(sizes, dev)


# ---- apply() on a real megatron-core GPTModel -----------------------------------------------
def _build(dropout=0.0, tied=True, num_layers=1, seed=0):
    from tests import testing as T
    from tests.gpt_runs import seed_all

    seed_all(seed)
    cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=4, num_layers=num_layers, dropout=dropout)
    return T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)


def _batch(seed=1):
    from tests import testing as T

    return T.gpt_batch(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(seed))


def _step(model, seed=5, data_seed=1):
    """(per-token loss, {name: grad}) of one forward/backward with fixed RNG streams."""
    from tests.gpt_runs import seed_all

    seed_all(seed)
    ids, pos, labels = _batch(data_seed)
    out = model(ids, pos, None, labels=labels)
    out.backward(torch.rand(out.shape, generator=torch.Generator().manual_seed(3)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.usefixtures("megatron_one_rank")
@pytest.mark.parametrize("tied", [True, False])
def test_apply_chunked_matches_stock_and_never_holds_the_logits(tied):
    from llm_act.patches.megatron import apply
    from llm_act.patches.megatron.output import chunked_loss_tokens

    stock = _build(tied=tied)
    model = _build(tied=tied)
    controller = apply(model, ActConfig(plan="keep", output_loss="chunked", output_chunk_tokens=16))
    assert controller.output_loss == "chunked" and chunked_loss_tokens(model) == 16
    ref_loss, ref_grads = _step(stock)
    with _MaxNumel() as mode:
        loss, grads = _step(model)
    assert mode.largest < TOKENS * VOCAB, mode.largest  # stock's logits never exist
    assert loss.shape == ref_loss.shape == (BATCH, SEQ)
    assert float((loss - ref_loss).abs().max()) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert rel_error(grads[name], ref) < 1e-5, name


@pytest.mark.usefixtures("megatron_one_rank")
def test_keep_with_auto_output_is_bit_identical_to_stock():
    from llm_act.patches.megatron import apply

    stock = _build(dropout=0.1, num_layers=2)
    model = _build(dropout=0.1, num_layers=2)
    controller = apply(model, ActConfig(plan="keep", output_loss="auto"))  # "auto" = stock under "keep"
    assert controller.output is None and controller.output_loss is None
    assert "_postprocess" not in vars(model) and "forward" not in vars(model.output_layer)
    ref_loss, ref_grads = _step(stock)
    loss, grads = _step(model)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


@pytest.mark.usefixtures("megatron_one_rank")
def test_what_cannot_take_it_is_refused_in_one_line_or_stays_stock():
    from llm_act.patches.megatron import apply

    model = _build()
    model.config.defer_embedding_wgrad_compute = True  # megatron's deferred embedding wgrad
    with pytest.raises(ValueError) as err:
        apply(model, ActConfig(plan="keep", output_loss="chunked"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("output_loss 'chunked': defer_embedding_wgrad_compute")
    assert "fix: set output_loss to 'stock'" in text and "--act-compress-output-loss" in text
    assert "_llm_act_controller" not in vars(model.decoder.layers[0])  # refused before any change
    controller = apply(model, ActConfig(plan="auto", output_loss="auto"))  # auto: quietly stock
    assert controller.output is None and "_postprocess" not in vars(model)
    # no GPTModel at all (a bare TransformerBlock): nothing to replace
    with pytest.raises(ValueError, match="holds no megatron-core GPTModel"):
        apply(_build().decoder, ActConfig(plan="keep", output_loss="chunked"))


@pytest.mark.usefixtures("megatron_one_rank")
def test_the_controller_switches_between_iterations_and_back_to_stock_exactly():
    from llm_act.patches.megatron import apply

    stock = _build()
    model = _build()
    controller = apply(model, ActConfig(plan="keep", output_loss="chunked"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay stock's
    controller.attach_optimizer(opt)
    ref_loss, ref_grads = _step(stock)
    _step(model)
    opt.step()  # iteration 1 ends: the controller is driven from now on
    assert controller.set_output_loss("stock") == "output loss: chunked->stock"
    assert controller.output_loss == "chunked"  # pending until the step boundary
    assert controller.set_output_loss("stock") == ""  # asked for already
    opt.step()
    assert controller.output_loss == "stock"
    assert "_postprocess" not in vars(model) and "forward" not in vars(model.output_layer)
    loss, grads = _step(model)
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())
    state = controller.state_dict()
    assert state["output_loss"] == "stock"
    with pytest.raises(ValueError, match="'stock' or 'chunked'"):
        controller.set_output_loss("fused")


def test_a_checkpoint_older_than_a_field_keeps_its_plan():
    from llm_act.runtime.controller_state import _config_changes

    now = ActConfig(plan="compress").to_dict()
    old = {k: v for k, v in now.items() if k not in ("output_loss", "output_chunk_tokens")}
    assert _config_changes(old, now) == []
    assert _config_changes(old, {**now, "output_loss": "chunked"}) == [
        "output_loss: checkpoint 'stock', now 'chunked'"]


# ---- the adaptive planner's choice ----------------------------------------------------------
@pytest.mark.usefixtures("megatron_one_rank")
def test_auto_picks_stock_when_plentiful_and_chunked_when_only_it_fits(monkeypatch, caplog):
    from llm_act.patches.megatron import apply
    from llm_act.planner.budget import min_budget
    from llm_act.runtime.adapt import Adapter

    budget = [10**12]
    monkeypatch.setattr(Adapter, "_budget", lambda self, profile, static: budget[0])
    model = _build(num_layers=2)
    controller = apply(model, ActConfig(plan="auto", sensitivity=False, noise_fraction=None,
                                        output_loss="auto"))
    assert controller.output_loss == "chunked"  # "auto" starts from the memory-saving side
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    from tests import testing as T

    def train(steps):
        for _ in range(steps):
            ids, pos, labels = T.gpt_batch(BATCH, SEQ, VOCAB, generator=gen)
            with controller.step(probe=lambda: model(ids, pos, None, labels=labels)):
                loss = model(ids, pos, None, labels=labels).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert torch.isfinite(loss)

    with caplog.at_level(logging.INFO, logger="llm_act.runtime.controller"):
        train(1)  # tracked at iteration 1
    a = controller.adapter
    assert controller.output_loss == "stock" and a.output_decision["choice"] == "stock"
    assert "output loss: chunked->stock" in controller.history[-1]["changes"]
    assert any("output loss stock:" in r.getMessage() for r in caplog.records)
    # a budget between the smallest with the chunked loss and the smallest with stock's
    blocks, static = a.problem(a.measured.profile)
    sizes = controller.output.sizes()
    assert sizes == OutputSizes(TOKENS, HIDDEN, VOCAB, 4, DEFAULT_CHUNK_TOKENS)
    stock_need = min_budget(blocks, static, None)  # the stock loss is in force now
    chunked_need = min_budget(blocks, static - sizes.saving, None)
    assert chunked_need + sizes.saving == stock_need
    budget[0] = (chunked_need + stock_need) // 2
    train(1)  # tracked at iteration 2
    assert a.tracked == [1, 2] and a.solver_failures == 0
    assert controller.output_loss == "chunked" and a.output_decision["choice"] == "chunked"
    assert a.output_decision["stock_ms"] is None  # stock does not fit
    assert controller.history[-1]["changes"].endswith("output loss: stock->chunked")
    assert controller.history[-1]["predicted_bytes"] <= budget[0]
    train(2)  # it trains under it (tracked at 4)
    assert controller.output_loss == "chunked"


# ---- vocab-parallel TP=2 (2 gloo ranks) -----------------------------------------------------
def _tp_worker(rank, world_size, port):
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    from llm_act.patches.megatron import apply
    from tests import testing as T

    T.init_parallel(tp=2, rank=rank, world_size=world_size, port=port, seed=1234)
    stock = _build(tied=False)
    model = _build(tied=False)
    controller = apply(model, ActConfig(plan="keep", output_loss="chunked", output_chunk_tokens=16))
    assert controller.output.sizes() is None and controller.output_loss == "chunked"
    ref_loss, ref_grads = _step(stock)
    loss, grads = _step(model)
    assert float((loss - ref_loss).abs().max()) < 1e-5, rank
    for name, ref in ref_grads.items():
        assert rel_error(grads[name], ref) < 1e-5, (rank, name)
    # plan "auto": every rank of the TP group switches alike (the source rank's broadcast)
    auto = _build(num_layers=2, tied=False)
    ctl = apply(auto, ActConfig(plan="auto", sensitivity=False, noise_fraction=None, budget="1GB",
                                output_loss="auto"))
    assert ctl.output_loss == "chunked"
    opt = torch.optim.SGD(auto.parameters(), lr=1e-3)
    ids, pos, labels = _batch()
    with ctl.step(probe=lambda: auto(ids, pos, None, labels=labels)):
        auto(ids, pos, None, labels=labels).mean().backward()
        opt.step()
    assert ctl.output.sizes().vocab_local == VOCAB // 2
    seen = [None, None]
    dist.all_gather_object(seen, (ctl.output_loss, ctl.adapter.output_decision["choice"]))
    assert seen[0] == seen[1] == ("stock", "stock"), seen  # 1 GB: plentiful


@pytest.mark.dist
@pytest.mark.slow  # ~20 s here: each rank imports megatron-core and builds its groups
def test_tp2_vocab_parallel_through_apply_and_one_decision():
    from tests import testing as T

    T.spawn(_tp_worker, 2, timeout=180)


def test_sizes_under_sequence_parallelism():
    """Each rank keeps its shard of the hidden states under either loss; the saving is the
    logits of every token the loss sees, as without sequence parallelism."""
    from llm_act.output.chunked_loss import stock_logits_bytes

    whole = OutputSizes(tokens=4096, hidden=1024, vocab_local=25000, elem_bytes=2)
    shards = OutputSizes(tokens=4096, hidden=1024, vocab_local=25000, elem_bytes=2, sequence_shards=4)
    assert whole.stock_bytes - shards.stock_bytes == 4096 * 3 // 4 * 1024 * 2
    assert shards.chunked_bytes == 1024 * 1024 * 2 + 4 * 4096
    assert shards.saving == whole.saving == stock_logits_bytes(4096, 25000) - 4 * 4096
