"""GACT's sensitivity (Alg. 1) on a real megatron-core GPT (CPU) and failure prediction.

The scaling construction: in a ReLU MLP, multiplying fc1's weight and bias by 10 and fc2's
weight by 1/10 leaves the forward unchanged (ReLU is positively homogeneous) while
`mlp.fc2_input` grows 10x. Its noise enters the gradient only through fc2's weight
gradient, grad_y^T (x + dx), with grad_y unchanged; a scale-equivariant stochastic codec
with the same draws gives dx 10x larger, so Var_Q[g] grows 100x while the relative error
S stays: c must move by 100x (up to rounding).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from llm_act import ActConfig
from llm_act.measurement.measure import measure_profile
from llm_act.measurement.sensitivity import CompressionNoiseWarning, check_noise, measure_sensitivity, sensitive_sites
from llm_act.patches.megatron import apply
from tests import gpt_runs as R

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


# megatron-core on one gloo rank, one torch thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_one_rank")


def _gpt(**kw):
    model = R.build(dropout=0.0, num_layers=2, **kw)
    controller = apply(model, ActConfig(plan="compress"))
    ids, pos, labels = R.batch(1, batch_size=4)
    return model, controller, lambda: model(ids, pos, None, labels=labels)


def test_scaling_a_site_input_by_10_moves_c_by_100():
    model, controller, fwd = _gpt(activation_func=F.relu)
    sites = ["mlp.fc2_input", "attn.out"]
    before = measure_sensitivity(controller, fwd, model, sites=sites, sampling=False)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.mlp.linear_fc1.weight.mul_(10.0)
            layer.mlp.linear_fc1.bias.mul_(10.0)
            layer.mlp.linear_fc2.weight.mul_(0.1)
    after = measure_sensitivity(controller, fwd, model, sites=sites, sampling=False)
    ratio = after.c["mlp.fc2_input"] / before.c["mlp.fc2_input"]
    print(f"c(mlp.fc2_input): {before.c['mlp.fc2_input']:.4g} -> {after.c['mlp.fc2_input']:.4g} ({ratio:.1f}x)")
    assert 80.0 < ratio < 125.0
    # a site whose tensor and downstream are unchanged keeps its sensitivity
    assert after.c["attn.out"] == pytest.approx(before.c["attn.out"], rel=0.05)


def test_sensitivities_on_a_small_gpt_and_isolation():
    model, controller, fwd = _gpt()
    assert "mlp.act_input" in sensitive_sites(controller)
    codec = controller.codec(1, "ln2.input")
    grads = {}
    loss = fwd().float().mean()  # a real step: the codecs draw, .grad is filled
    loss.backward()
    for n, p in model.named_parameters():
        grads[n] = p.grad
    gen = codec.state_dict()["generators"]["cpu"].clone()
    rng = torch.get_rng_state()
    s = measure_sensitivity(controller, fwd, model)
    print("c_i:", {k: f"{v:.3g}" for k, v in s.c.items()}, f"sampling noise {s.sampling_noise:.3g}")
    # every value site is sensitive, Q/K/V included; the GELU derivative site too (in f'
    # units); not attn.softmax: the memory-efficient attention stores no probabilities; the
    # final norm's input (after the blocks, a site of the last layer) too
    assert set(s.c) == {"ln1.input", "attn.qkv_input", "attn.q", "attn.k", "attn.v", "attn.out",
                        "ln2.input", "mlp.fc1_input", "mlp.act_input", "mlp.fc2_input", "final_norm.input"}
    assert all(v > 0 for v in s.c.values()) and s.sampling_noise > 0
    # nothing of the run moved: RNG, .grad (same tensors, same values), codec generators
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(codec.state_dict()["generators"]["cpu"], gen)
    for n, p in model.named_parameters():
        assert p.grad is grads[n]
    assert controller.module(0, "mlp.fc2_input").act_codecs["mlp.fc2_input"] is controller.codec(0, "mlp.fc2_input")
    # deterministic: the same seed gives the same estimate
    again = measure_sensitivity(controller, fwd, model, sites=["attn.out"], sampling=False)
    assert again.c["attn.out"] == s.c["attn.out"]


def test_noise_warning_fires_only_when_compression_noise_dominates():
    model, controller, fwd = _gpt()
    profile = measure_profile(controller, fwd, codecs=["outlier_int4", "fewbit3", "int1", "fewbit1"])
    normal = measure_sensitivity(controller, fwd, model)
    noise = profile.noise(controller.plan, normal.c)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompressionNoiseWarning)
        ratio = check_noise(noise, normal.sampling_noise)
    print(f"compress plan: noise {noise:.3g}, sampling {normal.sampling_noise:.3g}, ratio {ratio:.3g}")
    assert ratio < 1.0
    # crafted: a batch of four identical samples has no sampling noise at all
    ids, pos, labels = R.batch(1, batch_size=1)
    same = [t.expand(4, -1).contiguous() for t in (ids, pos, labels)]
    crafted = measure_sensitivity(controller, lambda: model(same[0], same[1], None, labels=same[2]), model,
                                  sites=["attn.out"])
    # zero up to the rounding of g_b = 2 g - g_a (`sampling_halves`)
    assert 0.0 <= crafted.sampling_noise < 1e-9 * normal.sampling_noise
    with pytest.warns(CompressionNoiseWarning, match="variance_budget"):
        check_noise(noise, crafted.sampling_noise)
    # and a 1-bit plan is far noisier than the sampling noise of a normal batch
    loud = {layer: {**choice, **{s: "int1" for s in normal.c if s != "mlp.act_input"}, "mlp.act_input": "fewbit1"}
            for layer, choice in controller.plan.items()}
    loud_noise = profile.noise(loud, normal.c)
    assert loud_noise > 10 * noise


def test_probe_passes_never_write_main_grad():
    """Megatron's linears with gradient-accumulation fusion add their weight gradient into
    `main_grad` in backward (the real run's buffer): the probes turn it off and restore it.
    (On CPU the fused kernel does not exist: a probe that left it on would raise.)"""
    model, controller, fwd = _gpt()
    fused = [m for m in model.modules() if hasattr(m, "gradient_accumulation_fusion")]
    assert fused
    for m in fused:
        m.gradient_accumulation_fusion = True
        m.weight.main_grad = torch.full_like(m.weight, 3.0)
    try:
        s = measure_sensitivity(controller, fwd, model, sites=["mlp.fc2_input"])
        assert s.c["mlp.fc2_input"] > 0
        for m in fused:
            assert m.gradient_accumulation_fusion is True
            assert torch.equal(m.weight.main_grad, torch.full_like(m.weight, 3.0))
    finally:
        for m in fused:
            m.gradient_accumulation_fusion = False
            del m.weight.main_grad


def test_per_group_c_is_the_worst_group_against_its_own_sampling_noise():
    """With parameter groups (Adam normalises each parameter), c is the worst group's c
    rescaled by the sampling noise: never below GACT's whole-gradient c, equal to the
    arithmetic on the measured pieces, and the sampling noise splits over the groups."""
    from llm_act.measurement.fidelity import group_name
    from llm_act.measurement.sensitivity import worst_group

    model, controller, fwd = _gpt()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [group_name(n) for n, _ in named]
    sites = ["ln1.input", "mlp.fc2_input"]
    s = measure_sensitivity(controller, fwd, [p for _, p in named], sites=sites, groups=groups, seed=3)
    whole = measure_sensitivity(controller, fwd, [p for _, p in named], sites=sites, seed=3)
    assert s.c_whole == pytest.approx(whole.c) and s.sampling_noise == pytest.approx(whole.sampling_noise)
    assert sum(s.sampling_by_group.values()) == pytest.approx(s.sampling_noise)
    assert set(s.sampling_by_group) == set(groups)
    for site in sites:
        assert s.c[site] >= s.c_whole[site] > 0
    # a norm's weight sees ln1.input's noise against its own small sampling noise
    assert s.c["ln1.input"] > 2 * s.c_whole["ln1.input"], (s.c, s.c_whole)
    assert worst_group({"a": 1.0, "b": 2.0}, {"a": 0.5, "b": 4.0, "c": 0.0}, 1.0, 0.1) == 2.0
    assert worst_group({"a": 1.0, "z": 9.0}, {"a": 10.0}, 1.0, 0.5) == 0.5  # no sampling noise: left out
    with pytest.raises(ValueError, match="groups"):
        measure_sensitivity(controller, fwd, [p for _, p in named], sites=sites, groups=groups[:-1])
