"""Training-level companions of the broken codecs (`tests.patches.broken_codec`): short runs
of `llm-act train`'s comparison (the configuration of tests/train/test_cli_train.py: GPT 2 x
64, seq 64, 12 iterations, fp32, plan "compress"), in process, stock and compressed each with
its own RNG state as `llm-act train` runs them.

What a quick run can tell, measured (healthy: codec seeds 1234-1237):
- the mean |train-loss gap| over the 12 iterations: healthy 0.0003-0.0004; a codec decoding
  zeros at mlp.fc2_input of layer 1 0.0085, at attn.qkv_input 0.0018; stochastic rounding
  that always rounds down (every stochastic codec) 0.0018. Bound: 3x the healthy worst.
- a constant few-bit derivative moves the losses about as much as fewbit3's own error (mean
  gap 0.0007, final 0.0016 against 0.0004-0.0007): on these inputs a constant approximates
  f' about as well in L2 as the 3-bit table (0.25 against 0.14 relative gradient error in
  tests/patches/megatron/test_layers.py). What exposes it is exactness: fewbit is
  deterministic, so a run storing mlp.act_input with fewbit3 must train exactly like a run
  whose backward uses the codec's own table q(x) (`TableTwin`), up to float rounding.
- dropped outlier channels do nothing here: a freshly initialized GPT of this size has no
  outlier channels (every loss equal to the healthy run's); with channels made 30x larger
  through the norms' weights, dropping them doubles the gap (0.0014 -> 0.0030), inside any
  margin a noisy loss allows. What a training run sees is its own gradient-fidelity report
  (the one every run summary ends with): on that model fc1's weight gradient carries 0.088
  and 0.101 relative error at iteration 12 (codec seeds 1234, 1235), 0.197 and 0.198 with
  the outliers dropped. Bound: 1.4x the healthy worst.

The per-iteration loss guard is tests/train/test_loss_guard.py; this file bounds whole-run
statistics (the mean gap, and test_cli_train's final and validation losses).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

from tests.patches import broken_codec
from tests.patches.megatron.layer_pairs import GaussianChannel
from tests.train.test_cli_train import FINAL_GAP, VALID_GAP

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

ITERATIONS = 12
#: mean |compressed - stock| train loss over the run; healthy worst 0.0004, x3
MEAN_GAP = 0.0012
#: a fewbit run against its table twin: float rounding only (measured 0 in fp32), and the
#: smallest sabotage moves it by > 1e-3
TWIN_GAP = 1e-5
#: with outlier channels: fc1's weight-gradient error in the run's last fidelity report;
#: healthy worst 0.101, x1.4
FC1_ERROR = 0.14
FC1 = "decoder.layers.*.mlp.linear_fc1.weight"
#: channels the norms' weights make 30x larger (outlier channels, as trained LLMs have)
OUTLIER_CHANNELS = (3, 17, 40)


def _args(plan="compress", seed=1234, adapt=True):
    from llm_act.cli.main import _parser
    from llm_act.train.args import check

    a = _parser().parse_args(["train", "--train-iters", str(ITERATIONS), "--hidden-size", "64",
                              "--seq-length", "64", "--eval-iters", "1"])
    a.lr_warmup_iters, a.act_compress, a.act_compress_plan = 4, True, plan
    a.act_compress_adapt = adapt
    a = check(a.train_parser, a, world_size=1)
    a.act_config = dataclasses.replace(a.act_config, seed=seed)
    return a


@pytest.fixture(scope="module")
def trainer():
    """run(stock=False, broken=None, twin=False, adapt=True) -> (train losses, valid loss),
    with the process group up for the module; stock is run once."""
    from llm_act.train import compare, parallel
    from llm_act.train.loop import load_data, quiet_megatron_warnings

    quiet_megatron_warnings()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    first = _args()
    parallel.init(first)
    data = load_data(first)
    cache = {}

    def run(stock=False, broken=None, twin=False, adapt=True, seed=1234, outliers=False):
        """With `outliers`: outlier channels, and the compressed run's last fidelity report
        is returned third."""
        key = ("stock",) if stock else (broken, twin, adapt, seed, outliers)
        if key in cache:
            return cache[key]
        args = _args(seed=seed, adapt=adapt)
        args.vocab_size = first.vocab_size
        if stock:
            args = compare._stock_args(args)
        with contextlib.ExitStack() as stack:
            if broken is not None:
                kind, site, layer = broken
                count = stack.enter_context(broken_codec.broken(site, layer, kind))
            if twin:
                stack.callback(_install_twin())
            r = compare._Run("run", args, data)
            if outliers:
                _make_outlier_channels(r.trainer)
            for it in range(1, ITERATIONS + 1):
                if outliers and it == ITERATIONS:
                    r.trainer.controller.request_fidelity()
                r.step(measure=False, timed=False)
            if not outliers:
                r.evaluate()
            if broken is not None:
                assert count() > 0, f"the sabotage {broken} met no codec"
        cache[key] = (r.losses, r.valid_loss) + ((r.trainer.controller.adapter.measured.fidelity[-1],) if outliers else ())
        return cache[key]

    yield run
    parallel.destroy_parallel()
    torch.set_num_threads(threads)


def mean_gap(stock, comp) -> float:
    return sum(abs(a - b) for a, b in zip(stock, comp)) / len(stock)


def check_mean_gap(stock, comp):
    gap = mean_gap(stock, comp)
    assert gap <= MEAN_GAP, f"mean train-loss gap {gap:.4f} > {MEAN_GAP}"


@pytest.mark.parametrize("seed", [1234, 1235])
def test_compress_trains_like_stock(trainer, seed):
    (stock, sv), (comp, cv) = trainer(stock=True), trainer(seed=seed)
    assert comp[0] == pytest.approx(stock[0], abs=1e-5)  # compression acts in backward only
    assert comp != stock
    check_mean_gap(stock, comp)
    # test_cli_train's bounds, on the same configuration
    assert abs(comp[-1] - stock[-1]) <= FINAL_GAP and abs(cv - sv) <= VALID_GAP


BROKEN_RUNS = [("zeros", "mlp.fc2_input", 1), ("zeros", "attn.qkv_input", 1),
               ("round_down", broken_codec.ALL, None)]


@pytest.mark.parametrize("broken", BROKEN_RUNS, ids=lambda b: f"{b[0]}-{b[1]}")
def test_mean_gap_fails_with_a_broken_codec(trainer, broken):
    stock, comp = trainer(stock=True)[0], trainer(broken=broken)[0]
    with pytest.raises(AssertionError, match="mean train-loss gap"):
        check_mean_gap(stock, comp)


def _megatron_core_at_least(major: int, minor: int) -> bool:
    from importlib.metadata import version

    return tuple(int(p) for p in version("megatron-core").split(".")[:2]) >= (major, minor)


#: megatron-core 0.17+ initialises this GPT otherwise (stock's first loss 5.4664 against
#: 0.16.1's 5.3958); there zeros at layer 1's qkv input move the final loss by 0.00016 and the
#: validation loss by 0.0012, inside test_cli_train's bounds (0.0021, 0.0015). The mean-gap
#: guard (`test_mean_gap_fails_with_a_broken_codec`) still fails on that codec there.
QKV_ZEROS_ON_0_17 = pytest.mark.xfail(
    condition=_megatron_core_at_least(0, 17), strict=True,
    reason="on megatron-core >= 0.17's initial weights the final/validation bounds miss zeros at "
           "attn.qkv_input (0.00016 / 0.0012 measured on 0.19.2); the mean-gap guard catches it")


@pytest.mark.parametrize("site", ["mlp.fc2_input", pytest.param("attn.qkv_input", marks=QKV_ZEROS_ON_0_17)])
def test_cli_train_bounds_fail_with_zeros(trainer, site):
    """The holes of issue 28: test_cli_train's old final-loss bound (0.1) passed a codec
    decoding zeros at either site (final gaps 0.0087 and 0.0019, validation 0.0089 and
    0.0024)."""
    (stock, sv), (comp, cv) = trainer(stock=True), trainer(broken=("zeros", site, 1))
    assert abs(comp[-1] - stock[-1]) > FINAL_GAP or abs(cv - sv) > VALID_GAP


def _make_outlier_channels(trainer) -> None:
    """Scale `OUTLIER_CHANNELS` of every norm's weight by 30: the residual stream's normalized
    copies (what ln1/ln2/fc1 inputs store) get outlier channels."""
    with torch.no_grad():
        for chunk in trainer.chunks:
            for name, p in chunk.named_parameters():
                if name.endswith("layernorm.weight"):
                    p[list(OUTLIER_CHANNELS)] *= 30.0


def check_fc1_error(report):
    err = report.groups[FC1]
    assert err <= FC1_ERROR, f"fc1's weight gradient error {err:.3f} > {FC1_ERROR} ({report.format()})"


@pytest.mark.parametrize("seed", [1234, 1235])
def test_outlier_channels_are_kept_in_training(trainer, seed):
    check_fc1_error(trainer(seed=seed, outliers=True)[2])


def test_the_fidelity_of_a_run_fails_with_dropped_outliers(trainer):
    bad = trainer(broken=("drop_outliers", broken_codec.ALL, None), outliers=True)[2]
    with pytest.raises(AssertionError, match="fc1's weight gradient error"):
        check_fc1_error(bad)


def _install_twin():
    """Every mlp.act_input codec the controller builds becomes `TableTwin` of itself: stores
    x exactly, decodes the codec's table q(x) (what fewbit claims to decode). Returns the
    undo."""
    from llm_act.runtime.controller import Controller

    original = Controller.new_codec

    def new_codec(self, layer, site, name, seed):
        codec = original(self, layer, site, name, seed)
        if site != "mlp.act_input":
            return codec
        return GaussianChannel(0.0, fn=codec.table.lookup, table=codec.table,
                               activation=codec.activation)

    Controller.new_codec = new_codec

    def undo():
        Controller.new_codec = original

    return undo


def check_twin(real, twin):
    gap = max(abs(a - b) for a, b in zip(real, twin))
    assert gap <= TWIN_GAP, f"the fewbit run is {gap:.2e} from its table twin's"


def test_fewbit_run_is_its_table_twin(trainer):
    twin = trainer(twin=True, adapt=False)[0]
    check_twin(trainer(adapt=False)[0], twin)


@pytest.mark.parametrize("kind", ["constant_derivative", "zeros"])
def test_table_twin_fails_with_a_broken_fewbit(trainer, kind):
    twin = trainer(twin=True, adapt=False)[0]
    bad = trainer(broken=(kind, "mlp.act_input", None), adapt=False)[0]
    with pytest.raises(AssertionError, match="twin"):
        check_twin(bad, twin)
