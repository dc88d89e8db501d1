"""The planner's MILP against exhaustive enumeration, its edges (min budget, least
variance), its speed on GPT-sized problems, and the JSON plan format."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import time

import numpy as np
import pytest

from llm_act.planner import (
    BlockProfile,
    CodecOption,
    InfeasibleBudget,
    InfeasibleVariance,
    SiteProfile,
    SolverError,
    evaluate_plan,
    load_plan_json,
    milp,
    milp_model,
    plan_json,
    solve_plan,
)
from llm_act.planner.analytic import block_profile
from llm_act.planner.model_shape import ModelShape
from llm_act.sites import SITES

# ---- a GPT block profile, from the library's analytic profile -------------------------------
def gpt_block(h=1024, s=1024, b=8, a=16, ffn=None, elem=2, unfused=False, dropout=True,
              count=1, inflight=1) -> BlockProfile:
    """The sites of llm_act.sites for one GPT block (MHA, GELU MLP)."""
    shape = ModelShape(1, h, a, s, b, ffn_hidden_size=ffn, dtype={2: "bf16", 4: "fp32"}[elem],
                       dropout=0.1 if dropout else 0.0, attention="stock" if unfused else "auto")
    return block_profile(shape, count=count, inflight=inflight)


# ---- an independent evaluator and exhaustive search ----------------------------------------
def _options(site):
    """(name, stored bytes, ms, noise, keeps the value) per option of a site."""
    out = [("keep", site.nbytes, 0.0, 0.0, True)]
    for c in site.codecs:
        out.append((c.name, c.nbytes, c.encode_ms + c.decode_ms, site.sensitivity * c.variance,
                    not c.name.startswith("fewbit")))
    if site.forward_ms is not None and math.isfinite(site.forward_ms) and site.name != "ln1.input":
        out.append(("recompute", 0, site.forward_ms, 0.0, True))
    return out


def _block_figures(sites, names):
    """(stored, transient, ms, noise) of one block copy, or None if the choice is invalid."""
    opts = {s.name: {o[0]: o for o in _options(s)} for s in sites}
    for s in sites:
        if names[s.name] == "recompute" and not all(opts[d][names[d]][4] for d in s.inputs):
            return None
    picked = [opts[s.name][names[s.name]] for s in sites]
    # backward transient: every recomputed tensor, plus the largest set decoded at once (the
    # attention's q, k, v and output together; any other site alone)
    rec = sum(s.nbytes for s in sites if names[s.name] == "recompute")
    decoded = {}
    for s in sites:
        if names[s.name] not in ("keep", "recompute"):
            key = "attention" if s.name in ("attn.q", "attn.k", "attn.v", "attn.out") else s.name
            decoded[key] = decoded.get(key, 0) + s.nbytes
    transient = rec + max(decoded.values(), default=0)
    return (sum(o[1] for o in picked), transient, sum(o[2] for o in picked), sum(o[3] for o in picked))


def figures(blocks, choice):
    """(activation bytes, ms, noise) of a per-block choice under the brief's cost model."""
    stored, peak, ms, noise = 0, 0, 0.0, 0.0
    for blk, names in zip(blocks, choice):
        f = _block_figures(blk.sites, names)
        assert f is not None, f"invalid choice {names}"
        stored += blk.count * blk.inflight * f[0]
        peak = max(peak, f[1])
        ms += blk.count * f[2]
        noise += blk.count * f[3]
    return stored + peak, ms, noise


def enumerate_plans(blocks):
    """Every valid plan in which equal blocks choose alike: arrays mem, ms, noise."""
    groups: dict = {}
    for blk in blocks:
        g = groups.setdefault((blk.sites, blk.inflight), [0])
        g[0] += blk.count
    per_group = []
    for (sites, inflight), (count,) in groups.items():
        rows = []
        for combo in itertools.product(*[[o[0] for o in _options(s)] for s in sites]):
            f = _block_figures(sites, dict(zip([s.name for s in sites], combo)))
            if f is not None:
                rows.append((count * inflight * f[0], f[1], count * f[2], count * f[3]))
        per_group.append(np.array(rows, dtype=np.float64))
    stored = peak = ms = noise = np.zeros(1)
    for arr in per_group:
        stored = (stored[:, None] + arr[None, :, 0]).ravel()
        peak = np.maximum(peak[:, None], arr[None, :, 1]).ravel()
        ms = (ms[:, None] + arr[None, :, 2]).ravel()
        noise = (noise[:, None] + arr[None, :, 3]).ravel()
    return stored + peak, ms, noise


def random_blocks(rng: random.Random):
    pool = ["int4", "int8", "fewbit2", "fp8_e4m3"]
    blocks = []
    for _ in range(rng.randint(2, 3)):
        sites = []
        for i in range(rng.randint(2, 4)):
            name = "ln1.input" if i == 0 and rng.random() < 0.3 else f"s{i}"
            nbytes = rng.randint(100, 5000)
            fwd = None if rng.random() < 0.15 else rng.uniform(0.1, 3.0)
            inputs = tuple(sorted(rng.sample([s.name for s in sites], rng.randint(0, len(sites)))))
            codecs = tuple(
                CodecOption(c, rng.randint(1, nbytes - 1), rng.uniform(0, 0.5), rng.uniform(0, 0.5),
                            rng.uniform(0.0, 1.0))
                for c in rng.sample(pool, rng.randint(1, 2))
            )
            sites.append(SiteProfile(name, nbytes, fwd, inputs, codecs, rng.uniform(0.0, 2.0)))
        blocks.append(BlockProfile(tuple(sites), rng.randint(1, 4), rng.randint(1, 3)))
    if rng.random() < 0.5:  # a repeated block shares variables with the first one
        blocks.append(BlockProfile(blocks[0].sites, rng.randint(1, 3), blocks[0].inflight))
    return blocks


def _instances(n, seed):
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        blocks = random_blocks(rng)
        size = 1
        for blk in {(b.sites, b.inflight): b for b in blocks}.values():
            size *= math.prod(len(_options(s)) for s in blk.sites)
        if size <= 60_000:
            out.append((blocks, rng))
    return out


def _close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


# ---- optimality ---------------------------------------------------------------------------
def test_time_objective_matches_enumeration():
    checked = 0
    for blocks, rng in _instances(25, seed=1):
        mem, ms, noise = enumerate_plans(blocks)
        lo, hi = int(mem.min()), int(mem.max())
        for frac in (0.0, 0.3, 0.7, 1.0):
            budget = lo + int(frac * (hi - lo))
            static = rng.randint(0, 1000)
            vb = None
            if rng.random() < 0.4:
                fits = mem <= budget
                vb = float(np.quantile(noise[fits], 0.5))
            plan = solve_plan(blocks, budget + static, static_bytes=static, variance_budget=vb)
            ok = (mem <= budget) & (noise <= (vb if vb is not None else np.inf) * (1 + 1e-6))
            best = ms[ok].min()
            got_mem, got_ms, got_noise = figures(blocks, plan.choice)
            assert _close(plan.overhead_ms, best), (plan.overhead_ms, best)
            assert _close(got_ms, plan.overhead_ms) and got_mem == plan.activation_bytes
            assert got_mem <= budget
            if vb is not None:
                assert got_noise <= vb * (1 + 1e-6)
            checked += 1
    assert checked == 100


def test_variance_objective_matches_enumeration():
    for blocks, _ in _instances(15, seed=2):
        mem, ms, noise = enumerate_plans(blocks)
        lo, hi = int(mem.min()), int(mem.max())
        for frac in (0.0, 0.2, 0.6):
            budget = lo + int(frac * (hi - lo))
            plan = solve_plan(blocks, budget, objective="variance")
            got_mem, _, got_noise = figures(blocks, plan.choice)
            assert got_mem <= budget
            assert _close(got_noise, noise[mem <= budget].min())
            assert _close(plan.variance, got_noise)


def test_equal_blocks_share_variables_and_choices():
    rng = random.Random(5)
    a, b = random_blocks(rng)[:2]
    many = solve_plan([a, a, b, a], 10**9)
    assert many.choice[0] == many.choice[1] == many.choice[3]
    one = solve_plan([BlockProfile(a.sites, 3, a.inflight), b], 10**9)
    assert many.num_variables == one.num_variables
    # a different inflight count is a different problem
    other = solve_plan([a, BlockProfile(a.sites, 1, a.inflight + 1), b], 10**9)
    assert other.num_variables > one.num_variables


def test_recompute_chain_charges_each_producer_once():
    x = SiteProfile("x", 1000, 1.0)
    y = SiteProfile("y", 1000, 2.0, inputs=("x",))
    z = SiteProfile("z", 1000, 4.0, inputs=("y",))
    plan = solve_plan([BlockProfile((x, y, z), count=5)], 3000)  # the transient alone
    assert plan.choice[0] == {"x": "recompute", "y": "recompute", "z": "recompute"}
    assert plan.overhead_ms == pytest.approx(5 * 7.0)
    assert plan.activation_bytes == plan.peak_bytes == 3000
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan([BlockProfile((x, y, z), count=5)], 2999)
    assert err.value.min_budget_bytes == 3000


def test_recompute_cannot_read_a_few_bit_code():
    # y is cheapest to recompute, x cheapest as fewbit2, but fewbit2 holds f'(x), not x
    x = SiteProfile("x", 1000, 50.0, codecs=(CodecOption("fewbit2", 100, 0.1, 0.1),
                                             CodecOption("int8", 500, 1.0, 1.0)))
    y = SiteProfile("y", 1000, 0.5, inputs=("x",), codecs=(CodecOption("int8", 500, 3.0, 3.0),))
    plan = solve_plan([BlockProfile((x, y), count=4)], 4 * 600 + 2000)
    assert plan.choice[0] == {"x": "int8", "y": "recompute"}
    assert plan.overhead_ms == pytest.approx(4 * 2.5)
    with pytest.raises(ValueError, match="does not keep the value"):
        evaluate_plan([BlockProfile((x, y))], [{"x": "fewbit2", "y": "recompute"}])


def test_sites_that_cannot_be_recomputed():
    sites = (
        SiteProfile("ln1.input", 1000, 0.001),
        SiteProfile("a", 1000, None),
        SiteProfile("b", 1000, math.inf),
        SiteProfile("c", 1000, 1.0),
    )
    plan = solve_plan([BlockProfile(sites, count=2)], 2 * 3000 + 1000)
    assert plan.choice[0] == {"ln1.input": "keep", "a": "keep", "b": "keep", "c": "recompute"}
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan([BlockProfile(sites, count=2)], 10_000, static_bytes=5_000)
    assert err.value.min_budget_bytes == 5_000 + 2 * 3000 + 1000


# ---- budgets ------------------------------------------------------------------------------
def test_loose_budget_keeps_everything():
    blk = gpt_block(h=256, s=128, b=2, a=4, count=24, inflight=2)
    full = 24 * 2 * sum(s.nbytes for s in blk.sites)
    plan = solve_plan([blk], full + 10**6, static_bytes=10**6)
    assert all(v == "keep" for v in plan.choice[0].values())
    assert plan.overhead_ms == 0.0 and plan.variance == 0.0
    assert plan.activation_bytes == full and plan.peak_bytes == 0


def test_cost_does_not_grow_with_the_budget():
    blk = gpt_block(h=512, s=512, b=4, a=8, count=24)
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan([blk], 0)
    lo = err.value.min_budget_bytes
    hi = 24 * sum(s.nbytes for s in blk.sites)
    costs = []
    for budget in np.linspace(lo, hi, 20).astype(int):
        plan = solve_plan([blk], int(budget))
        assert plan.activation_bytes <= budget
        costs.append(plan.overhead_ms)
    assert all(b <= a + 1e-9 for a, b in zip(costs, costs[1:])), costs
    assert costs[0] > 0 and costs[-1] == 0.0


@pytest.mark.parametrize("seed", [3, 4, 5, 6])
def test_min_budget_is_the_exact_edge(seed):
    rng = random.Random(seed)
    blocks = random_blocks(rng)
    static = rng.randint(0, 10**6)
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan(blocks, static + 1, static_bytes=static)
    edge = err.value.min_budget_bytes
    assert edge == int(enumerate_plans(blocks)[0].min()) + static
    assert "GiB" in str(err.value) and str(edge) in str(err.value)
    assert solve_plan(blocks, edge, static_bytes=static).activation_bytes == edge - static
    with pytest.raises(InfeasibleBudget):
        solve_plan(blocks, edge - 1, static_bytes=static)


def test_min_budget_edge_on_a_gpt_block():
    blocks = [gpt_block(count=24, inflight=1)]
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan(blocks, 2**30, static_bytes=2**30)
    edge = err.value.min_budget_bytes
    solve_plan(blocks, edge, static_bytes=2**30)
    with pytest.raises(InfeasibleBudget):
        solve_plan(blocks, edge - 1, static_bytes=2**30)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_variance_budget_edge(seed):
    rng = random.Random(seed)
    while True:
        blocks = random_blocks(rng)
        mem, _, noise = enumerate_plans(blocks)
        budget = int(mem.min()) + int(0.1 * (mem.max() - mem.min()))
        least = noise[mem <= budget].min()
        if least > 0:
            break
    with pytest.raises(InfeasibleVariance) as err:
        solve_plan(blocks, budget, variance_budget=0.0)
    assert _close(err.value.min_variance, least)
    plan = solve_plan(blocks, budget, variance_budget=err.value.min_variance)
    assert _close(plan.variance, least)
    with pytest.raises(InfeasibleVariance):
        solve_plan(blocks, budget, variance_budget=least * (1 - 1e-4))


# ---- speed --------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", [24, 48, 96, 128])
def test_single_stage_solves_fast(layers):
    blk = gpt_block()
    full = layers * sum(s.nbytes for s in blk.sites)
    separate = solve_plan([blk] * layers, full // 3)  # one entry per layer, shared variables
    merged = solve_plan([dataclasses.replace(blk, count=layers)], full // 3)
    print(f"\n{layers} layers: {separate.solve_seconds * 1e3:.1f} ms ({layers} entries), "
          f"{merged.solve_seconds * 1e3:.1f} ms (one entry), {merged.num_variables} variables")
    assert separate.num_variables == merged.num_variables
    assert separate.choice[0] == merged.choice[0] and separate.choice[-1] == merged.choice[0]
    assert separate.solve_seconds < 0.5 and merged.solve_seconds < 0.5


def test_pipeline_stages_plan_separately_and_fast():
    stages, layers = 4, 96
    per_stage = layers // stages
    budget = 12 * 2**30
    overheads = []
    for k in range(stages):
        blk = gpt_block(count=per_stage, inflight=stages - k)  # 1F1B: p - k in flight
        plan = solve_plan([blk], budget, static_bytes=2 * 2**30)
        print(f"\nstage {k}: inflight {stages - k}, {plan.solve_seconds * 1e3:.1f} ms, "
              f"{plan.activation_bytes / 2**30:.2f} GiB, +{plan.overhead_ms:.2f} ms")
        assert plan.solve_seconds < 0.5
        assert plan.activation_bytes <= budget - 2 * 2**30
        overheads.append(plan.overhead_ms)
    assert overheads == sorted(overheads, reverse=True) and overheads[0] > overheads[-1]


def test_distinct_layers_stop_at_the_time_limit_with_a_plan_no_worse_than_uniform():
    """Per-layer sensitivities make every layer its own block: proving optimality can take
    minutes, so the search stops at `time_limit` with a plan that still fits both budgets
    exactly and is never worse than the best uniform plan (every layer choosing alike)."""
    layers, rng = 24, random.Random(3)
    base = gpt_block(h=2048, s=2048, b=1, a=16)
    factors = [0.5 + rng.random() for _ in range(layers)]
    blocks = [base.scaled(f) for f in factors]
    assert [s.sensitivity for s in blocks[0].sites] == [s.sensitivity * factors[0] for s in base.sites]
    with pytest.raises(ValueError, match="factor"):
        base.scaled(-1.0)
    per_block = sum(s.nbytes for s in base.sites)
    budget = int(0.2 * layers * per_block) + per_block
    uniform_noise = solve_plan([BlockProfile(base.sites, count=layers)], budget).variance
    noise = uniform_noise * sum(factors) / layers * 0.8  # a binding noise budget
    uniform = solve_plan([BlockProfile(base.sites, count=layers).scaled(sum(factors) / layers)],
                         budget, variance_budget=noise)
    t0 = time.perf_counter()
    plan = solve_plan(blocks, budget, variance_budget=noise, time_limit=2.0, fast=False)  # the MILP path
    wall = time.perf_counter() - t0
    print(f"\n{layers} distinct layers: {wall:.2f} s, optimal={plan.optimal}, "
          f"{plan.overhead_ms:.3f} ms against {uniform.overhead_ms:.3f} ms uniform")
    assert wall < 2.0 + 15  # the limit, plus building the models and the uniform fallback
    got_mem, got_ms, got_noise = figures(blocks, plan.choice)
    assert got_mem == plan.activation_bytes <= budget
    assert got_noise <= noise * (1 + 1e-6)
    assert got_ms <= uniform.overhead_ms * (1 + 1e-9)
    assert isinstance(plan.optimal, bool)
    # the small instances above are solved to proven optimality
    small = solve_plan([gpt_block()], 10 * 2**30)
    assert small.optimal


# ---- JSON plans ---------------------------------------------------------------------------
def test_json_round_trip_merges_runs(tmp_path):
    a = gpt_block(h=256, s=128, b=2, a=4, count=6)
    b = gpt_block(h=256, s=128, b=2, a=4, count=2, inflight=3)
    full = sum(blk.count * blk.inflight * sum(s.nbytes for s in blk.sites) for blk in (a, b))
    plan = solve_plan([a, b, a], full // 3)
    data = json.loads(plan.to_json())
    assert data["version"] == 1
    spans = [run["layers"] for run in data["blocks"]]
    assert spans[0][0] == 0 and spans[-1][1] == 13
    assert all(p[1] + 1 == q[0] for p, q in zip(spans, spans[1:]))
    assert all(p["choice"] != q["choice"] for p, q in zip(data["blocks"], data["blocks"][1:]))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json(indent=2))
    per_layer = load_plan_json(path, 14)
    assert per_layer == dict(enumerate([plan.choice[0]] * 6 + [plan.choice[1]] * 2 + [plan.choice[2]] * 6))
    assert per_layer == plan.layer_plans()
    assert plan_json(per_layer) == plan.to_dict()
    shifted = plan.to_dict(first_layer=10)
    assert shifted["blocks"][0]["layers"][0] == 10
    with pytest.raises(ValueError, match="layers 0-9 of 24 have no plan"):
        load_plan_json(shifted, 24)
    loose = solve_plan([a, a], 10**12)
    assert loose.to_dict()["blocks"] == [{"layers": [0, 11], "choice": {s: "keep" for s in loose.choice[0]}}]


@pytest.mark.parametrize("blocks, match", [
    ([{"layers": [0, 3], "choice": {"attn.nope": "keep"}}], "unknown site 'attn.nope'"),
    ([{"layers": [0, 3], "choice": {"attn.q": "int3"}}], "unknown choice 'int3'"),
    ([{"layers": [0, 3], "choice": {"attn.q": "fewbit2"}}], "only to 'mlp.act_input'"),
    ([{"layers": [0, 3], "choice": {"ln1.input": "recompute"}}], "checkpoint"),
    ([{"layers": [0, 2], "choice": {}}, {"layers": [2, 3], "choice": {}}], "layer 2 is already"),
    ([{"layers": [0, 0], "choice": {}}, {"layers": [3, 3], "choice": {}}], "layers 1-2 of 4"),
    ([{"layers": [0, 4], "choice": {}}], r"last < 4"),
    ([{"layers": [0, 3]}], "keys 'layers' and 'choice'"),
])
def test_bad_json_plans_name_the_bad_part(blocks, match):
    with pytest.raises(ValueError, match=match):
        load_plan_json({"version": 1, "blocks": blocks}, 4)


def test_bad_json_plan_files(tmp_path):
    with pytest.raises(ValueError, match="version"):
        load_plan_json({"version": 2, "blocks": [{"layers": [0, 0], "choice": {}}]}, 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_plan_json(bad, 1)
    with pytest.raises(ValueError, match="cannot read"):
        load_plan_json(tmp_path / "missing.json", 1)
    ok = load_plan_json({"version": 1, "blocks": [{"layers": [0, 1], "choice": {"attn.q": "int8"}}]}, 2)
    assert ok == {0: {"attn.q": "int8"}, 1: {"attn.q": "int8"}}


def test_gpt_profile_uses_the_public_site_names():
    for blk in (gpt_block(count=8), gpt_block(unfused=True, count=8), gpt_block(dropout=False, count=8)):
        names = [s.name for s in blk.sites]
        assert set(names) <= set(SITES)
        plan = solve_plan([blk], 8 * sum(s.nbytes for s in blk.sites) // 2)
        assert set(plan.choice[0].values()) - {"keep"}
        per_layer = load_plan_json(plan.to_dict(), 8)  # every choice passes check_choice
        assert per_layer == dict.fromkeys(range(8), plan.choice[0])


# ---- profiles and arguments ----------------------------------------------------------------
def test_profiles_are_frozen_and_hashable():
    c = CodecOption("int8", 10, 0.1, 0.2)
    s1 = SiteProfile("a", 20, 1.0, ["b"], [c])
    s2 = SiteProfile("a", 20, 1.0, ("b",), (c,))
    assert s1 == s2 and hash(s1) == hash(s2) and isinstance(s1.codecs, tuple)
    blk = BlockProfile([s1, SiteProfile("b", 5, 0.1)])
    assert hash(blk) == hash(BlockProfile((s1, SiteProfile("b", 5, 0.1))))
    with pytest.raises(AttributeError):
        blk.count = 3


@pytest.mark.parametrize("make, err, match", [
    (lambda: CodecOption("keep", 1, 0, 0), ValueError, "not a codec"),
    (lambda: CodecOption("int8", -1, 0, 0), ValueError, "nbytes"),
    (lambda: CodecOption("int8", 1.5, 0, 0), ValueError, "integer byte count"),
    (lambda: CodecOption("int8", 1, float("nan"), 0), ValueError, "encode_ms"),
    (lambda: SiteProfile("a", 1, 1.0, ("a",)), ValueError, "itself"),
    (lambda: SiteProfile("a", 1, -1.0), ValueError, "forward_ms"),
    (lambda: SiteProfile("a", 1, 1.0, codecs=(CodecOption("x", 1, 0, 0),) * 2), ValueError, "twice"),
    (lambda: BlockProfile((SiteProfile("a", 1, 1.0, ("zz",)),)), ValueError, "'zz'"),
    (lambda: BlockProfile((SiteProfile("a", 1, 1.0, ("b",)), SiteProfile("b", 1, 1.0, ("a",)))),
     ValueError, "cycle"),
    (lambda: BlockProfile((SiteProfile("a", 1, 1.0),), count=0), ValueError, "count"),
    (lambda: BlockProfile((SiteProfile("a", 1, 1.0),), inflight=1.5), TypeError, "inflight"),
    (lambda: BlockProfile(("a",)), TypeError, "SiteProfile"),
])
def test_bad_profiles(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_bad_solve_arguments():
    blk = BlockProfile((SiteProfile("a", 10, 1.0),))
    with pytest.raises(ValueError, match="objective"):
        solve_plan([blk], 100, objective="memory")
    with pytest.raises(ValueError, match="variance_budget"):
        solve_plan([blk], 100, variance_budget=-1.0)
    with pytest.raises(ValueError, match="budget_bytes"):
        solve_plan([blk], -5)
    with pytest.raises(ValueError, match="blocks"):
        solve_plan([], 100)
    for bad in (0, -1.0, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="time_limit"):
            solve_plan([blk], 100, time_limit=bad)
    with pytest.raises(TypeError, match="BlockProfile"):
        solve_plan([blk.sites[0]], 100)
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan([blk], 100, static_bytes=200)  # static alone exceeds the budget
    assert err.value.min_budget_bytes == 200 + 10  # a single block: its transient stays


def test_evaluate_plan_agrees_with_the_independent_evaluator():
    rng = random.Random(11)
    for _ in range(10):
        blocks = random_blocks(rng)
        choice = []
        for blk in blocks:
            while True:
                names = {s.name: rng.choice(_options(s))[0] for s in blk.sites}
                if _block_figures(blk.sites, names) is not None:
                    break
            choice.append(names)
        plan = evaluate_plan(blocks, choice)
        mem, ms, noise = figures(blocks, choice)
        assert plan.activation_bytes == mem
        assert _close(plan.overhead_ms, ms) and _close(plan.variance, noise)


# ---- solver outcomes that decide nothing ---------------------------------------------------
def _first_calls_undecided(monkeypatch, n):
    """Make the first `n` solver calls end undecided ("error"), as HiGHS 1.16's presolve does
    on a budget a byte below its edge; later calls solve for real."""
    real, calls = milp_model._solve, []

    def solve(prob, deadline):
        calls.append(1)
        return "error" if len(calls) <= n else real(prob, deadline)

    monkeypatch.setattr(milp_model, "_solve", solve)
    return calls


def test_an_undecided_solve_below_the_edge_is_an_infeasible_budget(monkeypatch):
    blocks = [gpt_block(count=4)]
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan(blocks, 1, static_bytes=0)
    edge = err.value.min_budget_bytes
    _first_calls_undecided(monkeypatch, 1)
    with pytest.raises(InfeasibleBudget) as again:
        solve_plan(blocks, edge - 1)
    assert again.value.min_budget_bytes == edge


def test_an_undecided_solve_above_the_edge_is_a_solver_error(monkeypatch):
    blocks = [gpt_block(count=4)]
    with pytest.raises(InfeasibleBudget) as err:
        solve_plan(blocks, 1)
    edge = err.value.min_budget_bytes
    _first_calls_undecided(monkeypatch, 1)
    with pytest.raises(SolverError, match="without deciding") as failed:
        solve_plan(blocks, 2 * edge, variance_budget=1e9)
    assert isinstance(failed.value, RuntimeError) and not isinstance(failed.value, ValueError)


def test_a_solve_error_is_retried_without_presolve(monkeypatch):
    """The real retry path: HiGHS (or CBC) ending in a solve error on its first try is asked
    again without presolve, and that answer is used."""
    import pulp

    seen = []
    real = pulp.LpProblem.solve

    def solve(prob, solver=None, **kw):
        seen.append(dict(getattr(solver, "optionsDict", None) or {}))
        status = real(prob, solver, **kw)
        if len(seen) == 1:  # the first try "fails"
            prob.sol_status = pulp.LpSolutionNoSolutionFound
            return pulp.LpStatusNotSolved
        return status

    monkeypatch.setattr(pulp.LpProblem, "solve", solve)
    plan = solve_plan([gpt_block(count=2)], 10**12)
    assert plan.optimal and len(seen) == 2
    name = milp_model.solver_names()[0]
    base = milp_model._BASE_OPTIONS.get(name, {})
    assert seen[0] == base and seen[1] == {**base, **milp_model._RETRY_OPTIONS[name]}


def test_a_solver_that_crashes_is_a_try_that_decided_nothing(monkeypatch):
    """pulp's HiGHS reader raises IndexError on some infeasible models (seen with a noise
    budget no plan meets): that try is retried like a solve error; and where the main solve
    decides nothing under a noise budget that no plan within memory meets, that is named
    (InfeasibleVariance), not passed on as a solver error."""
    import pulp

    calls = []

    def crash(prob, solver=None, **kw):
        calls.append(1)
        raise IndexError("list index out of range")

    block = gpt_block(count=2)
    with pytest.raises(InfeasibleBudget) as edge:
        solve_plan([block], 1)
    budget = int(edge.value.min_budget_bytes * 1.05)  # tight: every plan that fits adds noise
    least = solve_plan([block], budget, objective="variance").variance
    assert least > 0
    with monkeypatch.context() as m:
        m.setattr(pulp.LpProblem, "solve", crash)
        with pytest.raises(SolverError):
            solve_plan([block], 10**12, fast=False)
    assert len(calls) >= 2  # the retry without presolve, and any next solver
    real = milp.full_search

    def search(classes, objective, mem_limit, var_limit, limit, *rest):
        if objective == "time":
            raise SolverError("the solver crashed")
        return real(classes, objective, mem_limit, var_limit, limit, *rest)

    monkeypatch.setattr(milp, "full_search", search)
    with pytest.raises(InfeasibleVariance) as caught:
        solve_plan([block], budget, variance_budget=least / 2, fast=False)
    assert caught.value.min_variance == pytest.approx(least)
    with pytest.raises(SolverError):  # a noise budget that some plan meets: the solver's fault
        solve_plan([block], budget, variance_budget=least * 2, fast=False)
