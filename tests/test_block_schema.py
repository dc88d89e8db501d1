"""The block schema (`llm_act.sites.BLOCK`): declared once, and every consumer derives from it.

- Production code spells site names in at most three files.
- The schema is well formed, and its derived tables say what the declarations say.
- A site declared in the schema alone is picked up by the ledger, the layer swap, the
  controller, measurement, recomputation and the analytic model, on a real megatron-core
  GPT (`tests/schema_extra_site_run.py`, in a fresh process).
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from llm_act import sites as S

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCTION = ("llm_act", "launch")
NAMES = set(S.SITES) | set(S.COUNTED_SITES) | set(S.OUTER_SITES) | {S.LOSS_LOGSUMEXP}
PREFIXES = tuple(dict.fromkeys(name.split(".")[0] + "." for name in NAMES))


def spelled_site_names(path: pathlib.Path) -> int:
    """String literals equal to a site name, and f-strings that start like one."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
            count += 1
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith(PREFIXES):
                count += 1
    return count


def test_at_most_three_production_files_spell_site_names():
    files = {str(p.relative_to(ROOT)): n for d in PRODUCTION for p in (ROOT / d).rglob("*.py")
             if (n := spelled_site_names(p))}
    assert "llm_act/sites.py" in files  # the counter sees the schema itself
    assert len(files) <= 3, f"site names spelled outside the schema: {files}"


def test_the_counter_sees_literals_and_f_strings(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('a = "mlp.fc1_input"\nb = f"attn.{a}"\nc = "mlp"\n')
    assert spelled_site_names(probe) == 2


def test_a_site_outside_the_schemas_vocabulary_is_refused_where_it_is_declared():
    import dataclasses
    from typing import get_args

    site = S.SITE_OF["ln1.input"]
    assert site.holder in get_args(S.Holder) and site.stage in get_args(S.Stage)
    for field, wrong in (("holder", "layernorm"), ("layout", "rows"), ("stage", "forward"), ("scope", "block"),
                         ("family", "norm"), ("needs", ("dropout", "qk_norm")), ("dtype", "bf16")):
        with pytest.raises(ValueError, match=f"site 'ln1.input': .*'{wrong if field != 'needs' else 'qk_norm'}' is not"):
            dataclasses.replace(site, **{field: wrong})
    with pytest.raises(ValueError, match="tag 'before' is not"):
        dataclasses.replace(site, tags=(S.Tag("before", "input_layernorm"),))


def test_the_schema_is_well_formed():
    dims = S.BlockDims(s=8, sl=4, b=2, h=16, a=4, g=2, d=4, f1=64, f2=32, rows=12, moe_f1=8, moe_f2=4)
    holders = {"norm", "column", "row", "bda", "mlp", "core_attention", "moe", "attention"}
    for site in S.BLOCK:
        assert site.holder in holders, site
        assert site.layout in {"replicated", "heads", "hidden", "ffn", "experts"}, site
        assert site.dtype in {"activation", "mask", "float32"}, site
        # a block's stages; the site after the blocks is consumed before any block backpropagates
        assert site.stage in {name for name, _ in S.BACKWARD_STAGES} | {"final"}, site
        assert site.scope in {"layer", "model"} and (site.scope == "model") == (site.stage == "final"), site
        assert site.scope == "layer" or (not site.recomputed_from and not site.alone
                                         and "last" in site.needs), site
        assert site.tags and all(t.how in {"input", "output", "owns", "after"} for t in site.tags), site
        assert all(isinstance(n, int) and n > 0 for n in site.dims(dims)), site
        assert set(site.recomputed_from + site.rebuild_reads) <= set(S.SITES), site
        assert not site.made_by or len(site.recomputed_from) == 1, site
        assert not site.alone or site.recomputed_from, site
        assert set(site.needs) <= {"dropout", "unfused_attention", "qk_layernorm", "dense", "moe", "last"}
    assert S.CHECKPOINT_SITE not in S.RECOMPUTABLE and not S.SITE_OF[S.CHECKPOINT_SITE].recomputed_from
    # one owner per ledger role, one site per input position
    owned = [t.slot for s in S.BLOCK for t in s.tags if t.how == "owns"]
    assert len(owned) == len(set(owned))
    inputs = [(t.slot, t.arg) for s in S.BLOCK for t in s.tags if t.how == "input"]
    assert len(inputs) == len(set(inputs))


def test_the_derived_tables_follow_the_declarations():
    assert S.SITES == tuple(s.name for s in S.BLOCK)
    assert S.DEFAULT_CODECS == {s.name: s.codec for s in S.BLOCK}
    assert S.MASK_SITES == {S.ATTN_DROPOUT_MASK, S.ATTN_HIDDEN_DROPOUT_MASK, S.MLP_HIDDEN_DROPOUT_MASK}
    assert S.QKV_SITES == (S.ATTN_Q, S.ATTN_K, S.ATTN_V)
    assert S.PRODUCER_INPUTS[S.ATTN_OUT] == S.QKV_SITES
    assert S.RECOMPUTABLE == {S.ATTN_QKV_INPUT, S.LN2_INPUT, S.MLP_FC1_INPUT, S.MLP_ACT_INPUT,
                              S.MLP_FC2_INPUT}
    assert [name for name, _ in S.BACKWARD_STAGES] == ["mlp", "attention"]
    assert S.DECODE_GROUPS == (frozenset({S.ATTN_Q, S.ATTN_K, S.ATTN_V, S.ATTN_OUT}),)
    assert S.present(S.ATTN_SOFTMAX, dropout=False, unfused_attention=True, qk_layernorm=False, moe=False)
    assert not S.present(S.ATTN_DROPOUT_MASK, dropout=False, unfused_attention=True, qk_layernorm=False,
                         moe=False)
    assert not S.present(S.MLP_FC1_INPUT, dropout=False, unfused_attention=False, qk_layernorm=False,
                         moe=True)
    # the one planned site after the blocks: the final norm's input, carried by the last layer
    assert S.MODEL_SITES == (S.FINAL_NORM_INPUT,)
    assert S.DEFAULT_CODECS[S.FINAL_NORM_INPUT] == S.DEFAULT_CODECS[S.LN1_INPUT] == S.DEFAULT_CODECS[S.LN2_INPUT]
    assert S.TP_LAYOUT[S.FINAL_NORM_INPUT] == "replicated" and S.FINAL_NORM_INPUT not in S.RECOMPUTABLE
    features = dict(dropout=True, unfused_attention=False, qk_layernorm=False, moe=False)
    assert S.present(S.FINAL_NORM_INPUT, last=True, **features)
    assert not S.present(S.FINAL_NORM_INPUT, **features)


def test_a_site_is_declared_once():
    with pytest.raises(ValueError, match="declared already"):
        S.declare(S.SITE_OF[S.ATTN_OUT])
    assert S.SITES.count(S.ATTN_OUT) == 1


@pytest.fixture(scope="module")
def extra_site():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "tests.schema_extra_site_run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_an_extra_site_reaches_the_ledger_and_the_layers(extra_site):
    got = extra_site
    expected = {"0": got["analytic_expected"], "1": got["analytic_expected"]}
    # stock megatron-core saves the extra norm's input: the ledger books it at the new site
    assert {k: v >= got["analytic_expected"] for k, v in got["stock_ledger"].items()} == \
        {k: True for k in expected}
    # the swap converted the slot, the controller drives the site, keep is still stock
    assert all("attn.cross_norm_input" in layer for layer in got["controller_sites"])
    assert got["keep_identical"]
    assert got["keep_ledger"] == got["stock_ledger"] and got["keep_total"] == got["stock_total"]
    # its default codec (int8) stores a quarter of fp32, and full recompute stores nothing
    assert all(got["compress_ledger"][k] < v / 2 for k, v in got["keep_ledger"].items())
    assert got["compress_finite"] and got["compress_grad_rel_error"] < 0.5
    assert not any(got["recompute_ledger"].values())
    assert got["recompute_finite"] and got["recompute_grad_rel_error"] < 1e-5


def test_an_extra_site_reaches_measurement_and_the_analytic_model(extra_site):
    got = extra_site
    assert sorted(got["measured"]) == ["0", "1"]
    assert all(v == got["keep_ledger"][k] for k, v in got["measured"].items())
    assert got["analytic"] == got["analytic_expected"]
