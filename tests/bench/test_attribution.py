"""Issue 42 item 2's attribution runs (`llm_act.bench.attribution`): the variants are what
their names say, and `convergence.run` trains a fixed per-site plan through `choices` (the
run stores less than stock and never re-plans). Short: a tiny Llama-style model, 3 steps."""
from __future__ import annotations

import json

import pytest

from llm_act.bench import attribution as A
from llm_act.bench import convergence as C
from llm_act.sites import SITES


def test_the_groups_cover_the_llama_blocks_value_sites_once():
    grouped = [s for sites in A.GROUPS.values() for s in sites]
    assert len(grouped) == len(set(grouped)) and set(grouped) <= set(SITES)
    compress = A.compress_choice()
    assert compress["mlp.act_input"] != "fewbit3"  # the gated MLP refuses few-bit codecs


def test_each_variant_is_what_its_name_says():
    table, compress = A.variants(), A.compress_choice()
    for group, sites in A.GROUPS.items():
        for codec in (A.SR_CODEC, A.BIASED_CODEC):
            assert table[f"only {group} {codec}"] == {s: codec for s in sites}
        but = table[f"compress but {group}"]
        assert not set(but) & set(sites) and all(but[s] == compress[s] for s in but)
        assert set(but) | set(sites) >= set(compress) - set(sites)
    assert table["compress"] == compress
    assert table["only qkv int2"] == {s: "int2" for s in A.GROUPS["qkv"]}
    assert table["only qk int2"] == {"attn.q": "int2", "attn.k": "int2"} and table["only v int2"] == {"attn.v": "int2"}


def test_unknown_variant_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        A.main(["--plans", "only nothing int4", "--save-json", str(tmp_path / "x.json")])
    assert "unknown variant(s) ['only nothing int4']" in str(exc.value)


def test_a_fixed_choice_trains_as_a_fixed_plan(tmp_path):
    pytest.importorskip("megatron.core")
    model = C.llama("tiny", 2, 32, 4, 2, 64, 16, 2)
    plans = ("only qkv int2", "only fc2 int4")
    result = C.run(steps=3, seeds=(7,), plans=plans, models=(model,), setting=C.LOW_FLOOR, choices=A.variants())
    runs = result["models"]["tiny"]["runs"]
    stock = runs["stock seed 7"]["block_bytes"]
    for plan in plans:
        r = runs[f"{plan} seed 7"]
        assert r["plan_changes"] == [] and 0 < r["block_bytes"] < stock, (plan, r["block_bytes"], stock)
    json.dumps(result)  # what --save-json writes


def test_gap_curve_averages_paired_gaps_per_window():
    stock = [2.0] * 6
    result = {"seeds": [1, 2, 3], "plans": ["p"], "models": {"m": {"runs": {
        **{f"stock seed {s}": {"train": stock} for s in (1, 2, 3)},
        "p seed 1": {"train": [2.0, 2.0, 2.0, 2.2, 2.2, 2.2]},  # +10% in the second half
        "p seed 2": {"train": [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]},
        # seed 3 has no run of p: left out, not counted as 0
    }}}}
    curve = A.gap_curve(result, "m", "p", window=3)
    assert [(a, b) for a, b, _ in curve] == [(1, 3), (4, 6)]
    assert curve[0][2] == pytest.approx(0.0) and curve[1][2] == pytest.approx(0.05)
    table = A.curve_table(result, "m", ["p"], window=3)
    assert "| p | +0.00% | +5.00% |" in table
