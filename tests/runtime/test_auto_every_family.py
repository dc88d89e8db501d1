"""Plan "auto" on every layer family we support, driven through every site's measurements
(issue 41: a coherence round offered `fewbit3` to a SwiGLU MLP and ended the run).

Tracking runs at every iteration (`adapt_interval_max=1`) with a gradient-fidelity report at
every iteration, with biased codecs charged their coherence (`biased_codecs="charge"`: the mode
whose coherence rounds crashed; the default, "exclude", runs none, and a test below drives it
too), at a loose budget (sites kept: the rounds fall back to each site's default
codec, which is where the crash came from) and at the default budget, until every sensitive
site's c and a biased codec's coherence are measured. Then, for each family:

- the run reached its end and skipped no measurement (`Adapter.round`);
- every codec a coherence round measured, every option of the measured profile, and every
  choice of the plan in force are ones the layer accepts: the schema's rule
  (`llm_act.codecs.registry.refusal`) for the family's MLP kind, stated here by the test;
- the rule agrees with the layers themselves (in-process families): each codec binds and
  trains at every site the rule accepts it at, and a plan the rule refuses is refused by
  `set_plan` in one line before anything changes.

A new site or codec that some family cannot take fails this file. Families: GeLU, SwiGLU with
GQA and RMSNorm, qk-layernorm, MoE with SwiGLU experts, the DeepSpeed door's megatron-core GPT
(in process), TP=2 with sequence parallelism and PP=2 (`launch/pretrain_gpt.py` on two gloo
ranks, checked from the checkpoint they save).
"""
from __future__ import annotations

import glob
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

from llm_act import ActConfig
from llm_act.codecs.registry import CODEC_NAMES, MASK_CODECS, accepts, check_choice, refusal
from llm_act.measurement.measured_profile import MeasuredProfile
from llm_act.sites import MASK_SITES, MLP_ACT_INPUT
from tests import testing as T
from tests import gpt_runs as R
from tests.patches.megatron.moe_runs import build_moe
from tests.test_budget_doors import _engine, pp2_run

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

LOOSE = 10**9
#: the mode that measures coherences (the default, "exclude", runs no coherence round)
CHARGE = dict(biased_codecs="charge")
#: iterations of the rotation before the rounds still missing are forced (it reaches every
#: site in about 2 x the sensitive site types where the plan settles; under the default budget
#: a plan that moves re-measures coherences first, and a fixed count would be flaky)
NATURAL_STEPS = 30

SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
LLAMA = dict(SWIGLU, num_query_groups=2, normalization="RMSNorm", add_bias_linear=False)

#: family -> (builder, the MLP kind the rule is asked with)
FAMILIES = {
    "gelu": (lambda: R.build(dropout=0.0), "fewbit"),
    "swiglu-gqa-rmsnorm": (lambda: R.build(dropout=0.0, spec=T.local_layer_spec(normalization="RMSNorm"),
                                           **LLAMA), "value"),
    "qk-layernorm": (lambda: R.build(dropout=0.0, spec=T.local_layer_spec(qk_layernorm=True),
                                     qk_layernorm=True), "fewbit"),
    "moe-swiglu": (build_moe, "value"),
}


def _sensitive(sites) -> set[str]:
    return {site for site in sites if site not in MASK_SITES}


def missing(state: dict, sensitive: set[str], coherence: bool = True) -> list[str]:
    """What the run has not measured yet (empty: every round type reached every site)."""
    a = state["adapt"]
    c_measured = {site for m in a["c_recent"] for site in m}
    out = [f"c of {s}" for s in sorted(sensitive - c_measured)]
    if coherence:
        out += [f"coherence of {s}" for s in sorted(sensitive - set(a["coherence_codecs"]))]
    out += ["a fidelity report"] if not a["fidelity"] else []
    return out


def check_state(state: dict, kind: str, sensitive: set[str], coherence: bool = True) -> None:
    """Everything "auto" measured, offered and chose is what a layer of MLP kind `kind`
    accepts, and no measurement was skipped."""
    a = state["adapt"]
    assert a["skipped"] == 0, a
    for site, name in a["coherence_codecs"].items():
        assert accepts(site, name, kind), (site, name, refusal(site, name, kind))
    profile = MeasuredProfile.from_dict(a["profile"])
    for (layer, site), st in profile.sites.items():
        refused = {n: refusal(site, n, kind) for n in st.options if not accepts(site, n, kind)}
        assert not refused, (layer, site, refused)
    held = {(str(layer), site) for layer, site in profile.sites}  # a plan names every schema site
    for plan in (state["plan"], state["pending"] or {}):
        for layer, choice in plan.items():
            for site, name in choice.items():
                assert (layer, site) not in held or accepts(site, name, kind), (layer, site, name)
    assert not missing(state, sensitive, coherence), missing(state, sensitive, coherence)


def _train(model, controller, steps_done: int, opt, engine=None) -> None:
    ids, pos, labels = R.batch(seed=steps_done)
    if engine is not None:
        engine.backward(engine(ids, pos, None, labels=labels).float().mean())
        engine.step()
        return
    model(ids, pos, None, labels=labels).float().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _drive(model, controller, kind, engine=None) -> None:
    """Train with tracking at every iteration: the rotation first (`NATURAL_STEPS`), then one
    round of each kind still missing, forced (`next_round` told which), so that every round
    type reaches every site whatever plans the measured times led to; each forced round's
    biased codec is the one `Measurements.charged_codecs` picks, as the rotation would."""
    from llm_act.measurement.sensitivity import sensitive_sites
    from llm_act.runtime import measuring

    opt = None if engine is not None else torch.optim.AdamW(model.parameters(), lr=1e-3)
    a = controller.adapter
    sensitive = set(sensitive_sites(controller))
    steps = 0
    for steps in range(1, NATURAL_STEPS + 1):
        _train(model, controller, steps, opt, engine)
        if not missing(controller.state_dict(), sensitive):
            break
    tapped, probed = a.measured.split_sites()
    try:
        for site in sorted(sensitive):
            state = controller.state_dict()["adapt"]
            rounds = []
            if site not in {s for m in state["c_recent"] for s in m}:
                rounds.append((measuring.SIGNED, [site] if site in probed else [], {}))
            if site not in state["coherence_codecs"]:
                codec = a.measured.charged_codecs([site])
                rounds.append((measuring.PLAIN, [] if site in tapped else [site], codec))
            for forced in rounds:
                a.measured.next_round = lambda *_args, _r=forced, **_kw: _r  # this instance's
                steps += 1
                _train(model, controller, steps, opt, engine)
    finally:
        a.measured.__dict__.pop("next_round", None)  # the class's again
    assert controller.iteration == steps
    check_state(controller.state_dict(), kind, sensitive)


def _rule_matches_the_layers(model, controller, kind) -> None:
    """Each codec binds and trains wherever the rule accepts it; a refused one is refused by
    `set_plan` before anything changes."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for name in CODEC_NAMES:
        plan = {layer: {site: name for site in controller.sites(layer) if accepts(site, name, kind)
                        and (site in MASK_SITES) == (name in MASK_CODECS)}
                for layer in controller.layers}
        controller.set_plan(plan)
        _train(model, controller, 0, opt)
        _train(model, controller, 1, opt)  # the plan switched at the boundary: it trains
        assert all(controller.plan[layer][s] == n for layer, c in plan.items() for s, n in c.items()), name
    for layer in controller.layers:
        for site in controller.sites(layer):
            for name in CODEC_NAMES:
                try:
                    check_choice(site, name)
                except ValueError:
                    continue
                if accepts(site, name, kind):
                    continue
                before = controller.plan
                with pytest.raises(ValueError, match=f"plan for layer {layer}: codec '{name}'") as err:
                    controller.set_plan({layer: {site: name}})
                assert "\n" not in str(err.value) and controller.plan == before


@pytest.mark.usefixtures("megatron_one_rank")
@pytest.mark.parametrize("budget", [LOOSE, None], ids=["loose", "default"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_auto_measures_every_site_of_every_family_and_offers_only_what_the_layer_takes(family, budget):
    from llm_act.patches.megatron import apply

    build, kind = FAMILIES[family]
    model = build()
    controller = apply(model, ActConfig(plan="auto", budget=budget, adapt_interval_max=1, fidelity_every=1,
                                        **CHARGE))
    _drive(model, controller, kind)
    if budget is None:
        _rule_matches_the_layers(model, apply(build(), ActConfig(plan="keep")), kind)


@pytest.mark.usefixtures("megatron_one_rank")
def test_the_default_auto_on_swiglu_measures_every_site_and_runs_no_coherence_round():
    """`--act-compress` alone (biased codecs excluded): every sensitive site's c is measured,
    no coherence round runs, and everything offered and chosen is what the gated MLP takes."""
    from llm_act.measurement.sensitivity import sensitive_sites
    from llm_act.patches.megatron import apply

    build, kind = FAMILIES["swiglu-gqa-rmsnorm"]
    model = build()
    controller = apply(model, ActConfig(plan="auto", adapt_interval_max=1, fidelity_every=1))
    assert controller.config.biased_codecs == "exclude"
    sensitive = set(sensitive_sites(controller))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, NATURAL_STEPS + 1):
        _train(model, controller, step, opt)
        if not missing(controller.state_dict(), sensitive, coherence=False):
            break
    state = controller.state_dict()
    assert state["adapt"]["coherence_codecs"] == {}
    check_state(state, kind, sensitive, coherence=False)


@pytest.mark.usefixtures("megatron_one_rank")
def test_the_deepspeed_doors_megatron_gpt_measures_every_site():
    engine = _engine(R.build(dropout=0.0, spec=T.local_layer_spec(normalization="RMSNorm"), **LLAMA),
                     {"plan": "auto", "budget": LOOSE, "adapt_interval_max": 1, "fidelity_every": 1, **CHARGE})
    _drive(engine.module, engine.act_controller, "value", engine=engine)


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [("--pipeline-model-parallel-size", "2"),
                                      ("--tensor-model-parallel-size", "2", "--sequence-parallel")],
                         ids=["pp2", "tp2-sp"])
def test_two_rank_swiglu_runs_measure_every_site_to_their_end(tmp_path, parallel):
    """A Llama-style GPT through `pretrain_gpt.py` on two ranks, tracking at every iteration:
    both ranks run to their last iteration, skip nothing, and every rank's saved controller
    state holds only what the gated MLP accepts."""
    steps = 30
    proc = pp2_run(tmp_path, ["--train-iters", str(steps), "--swiglu", "--ffn-hidden-size", "96",
                              "--normalization", "RMSNorm", "--disable-bias-linear", "--group-query-attention",
                              "--num-query-groups", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
                              "--act-compress-budget", str(LOOSE), "--act-compress-adapt-interval-max", "1",
                              "--act-compress-fidelity-every", "1", "--act-compress-biased-codecs", "charge",
                              "--save", str(tmp_path / "ckpt")],
                   timeout=400, env={"LLM_ACT_COLLECTIVE_TIMEOUT": "120"}, parallel=parallel)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"re-planning: {steps} tracking points" in proc.stdout, proc.stdout[-3000:]
    assert "skipped" not in proc.stdout + proc.stderr
    files = sorted(glob.glob(os.path.join(tmp_path, "ckpt", f"iter_{steps:07d}", "*", "model_optim_rng.pt")))
    assert len(files) == 2, files
    for path in files:
        state = torch.load(path, weights_only=False)["act_controller"]
        profile = MeasuredProfile.from_dict(state["adapt"]["profile"])
        sites = {site for _, site in profile.sites}
        assert MLP_ACT_INPUT in sites
        check_state(state, "value", _sensitive(sites))


@pytest.mark.usefixtures("megatron_one_rank")
def test_a_plan_leaving_whole_block_recompute_binds_on_a_layer_without_every_site():
    """What "auto" does when a MoE layer (no qk-layernorm, no dense MLP) leaves whole-block
    recompute: the new per-site choice covers the layer's sites and the plan in force keeps
    "recompute" at the schema sites the layer does not have. The binder counts only the
    sites the layer has (it refused the q/k-norm inputs it lacks, and the tracking point
    failed)."""
    from llm_act.patches.megatron import apply
    from llm_act.plan import recompute_layer

    model = build_moe()
    controller = apply(model, ActConfig(plan="recompute"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train(model, controller, 0, opt)
    # the layer's value sites encoded; its masks, probabilities and routing kept (as "auto"'s
    # `unmeasured` does); the schema sites it lacks left as the whole-block plan named them
    kept = MASK_SITES | {"attn.softmax", "moe.routing"}
    mixed = {layer: {**recompute_layer(), **{s: "keep" if s in kept else "int8" for s in controller.sites(layer)}}
             for layer in controller.layers}
    assert all(mixed[layer]["attn.q_norm_input"] == "recompute" for layer in mixed)
    controller.set_plan(mixed)
    for step in (1, 2):
        _train(model, controller, step, opt)
    assert all(controller.plan[layer]["attn.qkv_input"] == "int8" for layer in mixed)
