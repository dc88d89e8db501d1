"""What the training step itself measures (`llm_act.measurement.step_tap.StepTap`), on a real
megatron-core GPT (CPU): a sample of every site's tensor, whatever the plan stores there, from
which the profile is rebuilt with no pass of its own (`measure.profile_from_samples`); and
the linears' c from the step's own backward, equal to the exact pass's where the plan keeps
what lies above them, and within the plan's codec error where it compresses it."""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.measurement import linear_tap
from llm_act.measurement.measure import measure_profile, profile_from_samples
from llm_act.measurement.sensitivity import measure_sensitivity, sensitive_sites
from llm_act.measurement.step_tap import StepTap
from llm_act.patches.megatron import apply
from llm_act.sites import ATTN_OUT, ATTN_Q, ATTN_QKV_INPUT, LN2_INPUT, MLP_ACT_INPUT, MLP_FC1_INPUT, MLP_FC2_INPUT
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

LINEAR_INPUTS = [ATTN_QKV_INPUT, ATTN_OUT, MLP_FC1_INPUT, MLP_FC2_INPUT]


def _gpt(plan="compress", **cfg):
    model = R.build(dropout=0.0, num_layers=2)
    controller = apply(model, ActConfig(plan=plan, **cfg))
    ids, pos, labels = R.batch(1, batch_size=4)
    return model, controller, lambda: model(ids, pos, None, labels=labels)


def _step(model, controller, fwd, micro_batches=1):
    """One training step (forward and backward, `micro_batches` times) under the tap."""
    params = [p for p in model.parameters() if p.requires_grad]
    tap = StepTap(controller, LINEAR_INPUTS, params).install()
    try:
        for _ in range(micro_batches):
            fwd().float().mean().backward()
    finally:
        tap.remove()
    model.zero_grad(set_to_none=True)
    return tap


def test_a_sample_is_a_copy_of_the_steps_tensor():
    """What the step writes to a site's tensor in place after the hook (a residual added
    into it) does not reach the sample, small tensors (their own sample) and large alike."""
    _, controller, _ = _gpt()
    tap = StepTap(controller)
    for layer, numel in ((0, 64), (1, 1 << 16)):
        x = torch.randn(numel // 8, 8)
        tap._keep((layer, LN2_INPUT), x)
        before = tap.samples[(layer, LN2_INPUT)].sample.clone()
        x.add_(1.0)
        assert torch.equal(tap.samples[(layer, LN2_INPUT)].sample, before), numel


def test_every_value_site_is_sampled_with_its_shape_whatever_the_plan_stores():
    model, controller, fwd = _gpt()
    whole = measure_profile(controller, fwd)
    tap = _step(model, controller, fwd)
    values = {key for key, st in whole.sites.items() if st.dtype.is_floating_point and "mask" not in key[1]}
    assert set(tap.samples) == values
    for key, smp in tap.samples.items():
        assert smp.shape == whole.sites[key].shape and smp.dtype == whole.sites[key].dtype, key
        assert smp.sample.numel() <= 2 * (1 << 14)
    # the activation's input is fc1's output plus its bias (what the MLP's activation reads)
    assert tap.samples[(0, MLP_ACT_INPUT)].shape[-1] == whole.sites[(0, MLP_ACT_INPUT)].shape[-1]
    # nothing stays hooked
    assert not tap.handles and not tap.linear.handles


def test_the_profile_from_the_samples_agrees_with_the_full_profile():
    """The same batch, measured by a keep and a capture pass against the step's samples:
    bytes and times carried; the errors of per-group codecs agree within the sampling
    error, the per-channel codec in force (int4_channel at attn.q) exactly (its error is
    taken on the whole tensor in the step), the outlier rates within a few channels."""
    model, controller, fwd = _gpt()
    whole = measure_profile(controller, fwd)
    tap = _step(model, controller, fwd)
    rebuilt = profile_from_samples(controller, tap.samples, whole)
    assert rebuilt is not None and set(rebuilt.sites) == set(whole.sites)
    for key, st in rebuilt.sites.items():
        ref = whole.sites[key]
        assert st.keep_bytes == ref.keep_bytes and set(st.options) == set(ref.options)
        for name, opt in st.options.items():
            assert opt.nbytes == ref.options[name].nbytes and opt.encode_ms == ref.options[name].encode_ms
            if ref.options[name].rel_error > 0 and name in ("int4", "int2", "int8", "outlier_int4", "fp8_e4m3"):
                assert opt.rel_error == pytest.approx(ref.options[name].rel_error, rel=0.25), (key, name)
    q = rebuilt.sites[(0, ATTN_Q)].options["int4_channel"]
    assert q.rel_error == pytest.approx(whole.sites[(0, ATTN_Q)].options["int4_channel"].rel_error, rel=1e-6)
    # a sample taken at another shape (another sequence length) asks for a full profile
    key = next(iter(tap.samples))
    tap.samples[key].shape = (1,) + tuple(tap.samples[key].shape)
    assert profile_from_samples(controller, tap.samples, whole) is None


def test_the_linears_c_from_the_step_is_the_exact_passes():
    """Under a plan that keeps every site the step's backward is exact: the step's c equals
    the exact measurement pass's; under "compress" its dy carries the codecs' errors above
    each linear, well inside 10%; a tap that summed every micro-batch would count two."""
    for plan, rel in (("keep", 1e-4), ("compress", 0.1)):
        model, controller, fwd = _gpt(plan=plan, attention="chunked")
        exact = measure_sensitivity(controller, fwd, model, sites=LINEAR_INPUTS, sampling=False)
        params = [p for p in model.parameters() if p.requires_grad]
        tap = _step(model, controller, fwd, micro_batches=2)
        c, _, _ = tap.linear.results()
        for site in LINEAR_INPUTS:
            print(f"{plan} {site}: step {c[site]:.5g}, exact pass {exact.c[site]:.5g}")
            assert c[site] == pytest.approx(exact.c[site], rel=rel), (plan, site)
        assert params


def test_the_step_c_replaces_the_passes_tap():
    model, controller, fwd = _gpt(plan="keep", attention="chunked")
    tap = _step(model, controller, fwd)
    probed = [s for s in sensitive_sites(controller) if not linear_tap.exact_for(controller, s)]
    assert LN2_INPUT in probed
    calls = []

    def counted():
        calls.append(1)
        return fwd()

    s = measure_sensitivity(controller, counted, model, sites=LINEAR_INPUTS + [LN2_INPUT], sampling=False,
                            tapped_from=tap.linear)
    assert len(calls) == 2  # the exact pass and ln2.input's probe
    c, _, _ = tap.linear.results()
    assert all(s.c[site] == c[site] for site in LINEAR_INPUTS)
    assert s.c[LN2_INPUT] > 0
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("plan", ["compress", "keep"])
def test_a_tapped_training_step_issues_no_host_sync(plan):
    """The tap reads nothing on the host inside the step (tests/no_syncs.py): its samples are
    device copies, its errors and c device tensors read at the step boundary."""
    from tests.no_syncs import NoSyncs

    model, controller, fwd = _gpt(plan=plan, codecs={ATTN_Q: "int4_channel"} if plan == "compress" else {})
    fwd().float().mean().backward()  # the codecs' first step builds their generators
    model.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    tap = StepTap(controller, LINEAR_INPUTS, params).install()
    try:
        with NoSyncs():
            fwd().float().mean().backward()
    finally:
        tap.remove()
    assert tap.samples and all(v > 0 for v in tap.linear.results()[0].values())
    if plan == "compress":
        assert tap.samples[(0, ATTN_Q)].whole is not None  # int4_channel's error on the whole tensor
