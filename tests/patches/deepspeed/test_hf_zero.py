"""A Hugging Face Llama decoder (built from a config) under DeepSpeed ZeRO on 2 gloo ranks.

One spawn runs, on each rank with its own data:
- ZeRO-2 without and with compression (plan "compress"): the first loss is identical
  (compression changes only what backward reads), the first step's parameter gradients stay
  within `GRAD_TOTAL` / `GRAD_EACH` of the uncompressed run's, later losses within `LOSS_TOL`
  (relative), and the saved bytes shrink;
- checkpoint save/load: a fresh engine that loads the checkpoint has the controller's
  iteration, plan and codec random streams back, and its next loss equals the original's;
- plan agreement: each rank picks a plan from its own batch (they differ): `set_plan` stops
  both ranks with `Disagreement`; with rank 0's plan on both, both run it after `engine.step()`;
- plan "recompute" through DeepSpeed's activation checkpointing  under
  ZeRO-2 and through torch's checkpoint under ZeRO-3: losses equal the stock run's.

`test_hf_gradient_bound_fails_with_a_broken_codec`: a codec decoding zeros at one site fails
the gradient bound (ZeRO-2 in the default run, ZeRO-3 `slow`: the same math).
"""
import os

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from tests.testing import spawn  # noqa: E402
from tests.patches import broken_codec  # noqa: E402

#: relative tolerance on the loss of a compressed run vs the same run without compression.
#: Measured (ZeRO-2, steps 2 and 3): the real codecs 3.8e-4 and 4.2e-4; every site decoding
#: zeros 1.5e-3 and 2.3e-3 (the old tolerance, 0.02, let it through). One broken site of
#: layer 1 stays within the real codecs' noise (ln1.input 4.6e-4 and 1.9e-4, mlp.fc2_input
#: 3.8e-4 and 4.8e-4): the gradient bound below is what catches that.
LOSS_TOL = 1e-3
#: bound on the first step's gradients (same weights, same batch) of plan "compress" vs no
#: compression: relative error over all parameters, and per parameter (`check_gradients`).
#: Measured on rank 0 (Llama, h=64, 2 layers), ZeRO-2: real codecs 0.069 total, worst
#: parameter 0.195 (layer 1's post-attention norm). A codec decoding zeros at one site of
#: layer 1: total 0.070 (attn.q), 0.077 (ln2.input), 0.079 (ln1.input), 0.100 (mlp.fc2_input),
#: 0.123 (mlp.fc1_input), 0.192 (mlp.act_input), 0.294 (attn.out), 0.322 (attn.qkv_input);
#: every site 0.653 -- and in each case 1.000 in the parameter next to the broken site.
#: ZeRO-3 gives the same figures (checked: real, mlp.act_input, mlp.fc2_input, every site).
GRAD_TOTAL, GRAD_EACH = 0.1, 0.4
STEPS = 3


def _ds(stage, section=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           # torch_adam: torch's AdamW, no FusedAdam op to build on CPU
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**6, **extra}
    if section is not None:
        cfg["activation_compression"] = section
    return cfg


def _batches(rank, steps, seq=32, vocab=256):
    g = torch.Generator().manual_seed(100 + rank)
    half = vocab // 2  # every rank its own data: rank 0 the lower half of the vocabulary
    out = []
    for _ in range(steps):
        ids = torch.randint(0, half, (2, seq + 1), generator=g) + half * (rank % 2)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _engine(ds):
    from llm_act.patches.deepspeed import hf_decoder, initialize

    model = hf_decoder.build("llama", hidden_size=64, num_layers=2, max_positions=64, seed=7)
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def _full_grads(engine):
    """{name: the whole (unpartitioned, reduced) gradient}, between backward and step."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().double().clone()
            for n, p in engine.module.named_parameters()}


def _train(engine, batches, grads=None):
    """(losses, saved bytes) of one step per batch; `grads` (a dict) receives the first
    step's gradients."""
    from llm_act.ledger import SavedTensorLedger
    from llm_act.patches.deepspeed import hf_decoder

    losses, saved = [], []
    for tokens, labels in batches:
        with SavedTensorLedger() as ledger:
            loss = hf_decoder.lm_loss(engine, tokens, labels)
        saved.append(ledger.total_bytes)
        engine.backward(loss)
        if grads is not None and not losses:
            grads.update(_full_grads(engine))
        engine.step()
        losses.append(loss.item())
    return losses, saved


def _init(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _worker(rank, world, port, tmp):
    import deepspeed  # noqa: F401
    import torch.distributed as dist

    _init(rank, world, port)
    batches = _batches(rank, STEPS + 1)
    compress = {"enabled": True, "plan": "compress"}

    # ZeRO-2 with and without compression
    ref_grads, grads = {}, {}
    ref_losses, ref_saved = _train(_engine(_ds(2)), batches[:STEPS], ref_grads)
    engine = _engine(_ds(2, compress))
    ctl = engine.act_controller
    assert ctl.enabled and ctl.plan[0]["attn.qkv_input"] == "outlier_int4"
    losses, saved = _train(engine, batches[:STEPS], grads)
    assert ctl.iteration == STEPS
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-6, abs=1e-6)
    broken_codec.check_gradients(grads, ref_grads, GRAD_TOTAL, GRAD_EACH)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= LOSS_TOL * abs(b), (losses, ref_losses)
    assert max(saved) < 0.6 * min(ref_saved), (saved, ref_saved)

    # checkpoint: save, then a fresh engine loads it
    engine.save_checkpoint(tmp, tag="t", client_state={"mine": 5})
    state = ctl.state_dict()
    fresh = _engine(_ds(2, compress))
    assert fresh.act_controller.iteration == 0
    _, client = fresh.load_checkpoint(tmp, tag="t")
    assert client["mine"] == 5 and "llm_act" not in client
    got = fresh.act_controller.state_dict()
    assert got["iteration"] == STEPS and got["plan"] == state["plan"]
    assert got["codecs"].keys() == state["codecs"].keys()
    for key, codec_state in state["codecs"].items():
        for name, value in codec_state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got["codecs"][key][name], value), key
    next_a, _ = _train(engine, batches[STEPS:])
    next_b, _ = _train(fresh, batches[STEPS:])
    assert next_a == pytest.approx(next_b, rel=1e-6)

    # plan agreement: each rank decides from its own data; different plans stop every rank
    # with one message (issue 13 part 3), the same plan on every rank is taken
    from llm_act.runtime.agreement import Disagreement

    tokens, labels = batches[0]
    local = "int8" if tokens.float().mean() > 127.5 else "int4"
    decisions = [None] * world
    dist.all_gather_object(decisions, local)
    assert len(set(decisions)) == world, decisions  # the ranks really disagree
    with pytest.raises(Disagreement, match="mlp.fc1_input"):
        ctl.set_plan({i: {**ctl.plan[i], "mlp.fc1_input": local} for i in ctl.plan})
    ctl.set_plan({i: {**ctl.plan[i], "mlp.fc1_input": decisions[0]} for i in ctl.plan})
    _train(engine, batches[:1])
    plans = [None] * world
    dist.all_gather_object(plans, ctl.plan)
    assert plans[0] == plans[1] and plans[0][0]["mlp.fc1_input"] == decisions[0]

    # recompute through deepspeed.checkpointing under ZeRO-2
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    for bad in ({"cpu_checkpointing": True}, {"partition_activations": True}):
        with pytest.raises(ValueError, match="CPU accelerator"):  # DeepSpeed 0.19 on CPU
            _engine(_ds(2, {"plan": "recompute"}, activation_checkpointing=bad))
    calls = []
    checkpoint = ds_ckpt.CheckpointFunction.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    ds_ckpt.CheckpointFunction.forward = staticmethod(counting)
    rec = _engine(_ds(2, {"plan": "recompute"}, activation_checkpointing={"profile": False}))
    assert ds_ckpt.is_configured()
    assert rec.act_generic.recompute
    rec_losses, rec_saved = _train(rec, batches[:STEPS])
    ds_ckpt.CheckpointFunction.forward = checkpoint
    assert len(calls) == 2 * STEPS  # both blocks, every step, through deepspeed.checkpointing
    assert rec_losses == pytest.approx(ref_losses, rel=1e-5)
    assert max(rec_saved) < 0.5 * min(ref_saved)


def _worker_zero3(rank, world, port):
    _init(rank, world, port)
    batches = _batches(rank, 2)
    ref_grads, grads = {}, {}
    ref, _ = _train(_engine(_ds(3)), batches, ref_grads)
    rec = _engine(_ds(3, {"plan": "recompute"}))
    losses, _ = _train(rec, batches)  # recompute re-enters the blocks' submodules: gathered
    assert losses == pytest.approx(ref, rel=1e-5)
    comp = _engine(_ds(3, {"plan": "compress"}))
    losses, _ = _train(comp, batches, grads)
    assert losses[0] == pytest.approx(ref[0], rel=1e-6)
    broken_codec.check_gradients(grads, ref_grads, GRAD_TOTAL, GRAD_EACH)
    assert abs(losses[1] - ref[1]) <= LOSS_TOL * abs(ref[1])


#: sites broken one at a time (layer 1): the least visible in the total gradient error
#: (ln1.input), an MLP site, and every site at once
BROKEN = (("ln1.input", 1), ("mlp.fc2_input", 1), (broken_codec.ALL, None))


def _worker_broken(rank, world, port, stage):
    """Each broken site fails the gradient bound the runs above hold plan "compress" to."""
    _init(rank, world, port)
    batch = _batches(rank, 1)
    ref = {}
    _train(_engine(_ds(stage)), batch, ref)
    for site, layer in BROKEN:
        grads = {}
        with broken_codec.broken(site, layer):
            _train(_engine(_ds(stage, {"plan": "compress"})), batch, grads)
        with pytest.raises(AssertionError, match="relative"):
            broken_codec.check_gradients(grads, ref, GRAD_TOTAL, GRAD_EACH)


@pytest.mark.dist
def test_hf_decoder_zero2_compress_checkpoint_agreement_recompute(tmp_path):
    spawn(_worker, 2, str(tmp_path), timeout=420)


@pytest.mark.dist
def test_hf_decoder_zero3_recompute_and_compress():
    spawn(_worker_zero3, 2, timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_hf_gradient_bound_fails_with_a_broken_codec(stage):
    spawn(_worker_broken, 2, stage, timeout=300)


def _worker_broken_quick(rank, world, port, stage):
    """One rank, one step, every site's codec broken at once, one kind after another: each
    fails the gradient bound under a real ZeRO engine. Measured on one rank, ZeRO-3 (total /
    worst parameter): healthy 0.084 / 0.27; zeros 0.62 / 1.00; always rounding down 0.21 /
    0.51. (This Llama has SwiGLU, so no few-bit codec, and no outlier channels at init:
    "constant_derivative" and "drop_outliers" leave its gradients as they are.)"""
    _init(rank, world, port)
    batch = _batches(rank, 1)
    ref = {}
    _train(_engine(_ds(stage)), batch, ref)
    grads = {}
    _train(_engine(_ds(stage, {"plan": "compress"})), batch, grads)
    broken_codec.check_gradients(grads, ref, GRAD_TOTAL, GRAD_EACH)  # healthy, same run
    for kind in (broken_codec.ZEROS, broken_codec.ROUND_DOWN):
        grads = {}
        with broken_codec.broken(broken_codec.ALL, None, kind) as count:
            _train(_engine(_ds(stage, {"plan": "compress"})), batch, grads)
        assert count() > 0
        with pytest.raises(AssertionError, match="relative"):
            broken_codec.check_gradients(grads, ref, GRAD_TOTAL, GRAD_EACH)


@pytest.mark.dist
def test_hf_zero3_gradient_bound_fails_with_a_broken_codec_quick():
    """The default run's version of the slow ZeRO-3 companion above: one rank, every site."""
    spawn(_worker_broken_quick, 1, 3, timeout=300)
