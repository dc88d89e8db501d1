"""Issue 42's convergence bench pieces (`llm_act.bench.convergence`): the Llama-style bench
model and its flags, the default plan (one flag) as the named verdict plan of the fp32
low-floor setting, the final validation loss on the whole validation split, and the plan
changes per 100 iterations after warm-up. Short: a tiny model trains a few steps at most."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from llm_act.bench import convergence as C
from llm_act.bench.convergence_pilot import parser as pilot_parser


def test_the_llama_model_passes_every_llama_flag():
    m = C.LLAMA_MODEL
    assert m.llama_style
    a = C.train_args(300, 1234, False, model=m, setting=C.LOW_FLOOR)
    assert a.swiglu and a.normalization == "RMSNorm" and a.disable_bias_linear
    assert a.group_query_attention and a.num_query_groups == m.shape.num_query_groups < m.shape.num_attention_heads
    assert a.untie_embeddings_and_output_weights and a.position_embedding_type == "rope"
    assert a.hidden_dropout == 0.0 and a.attention_dropout == 0.0 and not a.bf16
    assert a.ffn_hidden_size == m.shape.ffn_hidden_size and a.vocab_size == 256
    assert "Llama-style" in m.describe("fp32") and "SwiGLU" in m.describe("fp32")
    rec = C.model_record(m)
    assert rec["style"] == "llama" and rec["query_groups"] == m.shape.num_query_groups and rec["tied"] is False


def test_the_gpt_models_keep_their_flags():
    """The GPT-style models parse as before issue 42: LayerNorm, GeLU, biases, dropout 0.1."""
    for m in (C.QUICK_MODEL, C.MID_MODEL):
        a = C.train_args(300, 1234, False, model=m, setting=C.LOW_FLOOR)
        assert not m.llama_style and not a.swiglu and a.normalization == "LayerNorm"
        assert not a.disable_bias_linear and not a.group_query_attention and a.ffn_hidden_size is None
        assert not a.untie_embeddings_and_output_weights and a.hidden_dropout == 0.1
        assert a.eval_iters == C.CURVE_EVAL_ITERS and "style" not in C.model_record(m)


def test_the_default_plan_is_one_flag_and_the_named_verdict():
    from llm_act.config import ActConfig

    assert C.VERDICT_PLAN == C.DEFAULT and C.LOW_FLOOR.plans[0] == C.STOCK_ULP
    assert set(C.LOW_FLOOR.plans) == {C.STOCK_ULP, C.DEFAULT, "compress", C.AUTO_TARGET, C.INT2_EVERYWHERE}
    assert {m.name for m in C.LOW_FLOOR.models} == {"quick", "mid", "llama"} and len(C.LOW_FLOOR.seeds) == 10
    flags = C._flags(C.DEFAULT, None, C.LLAMA_MODEL, "/nonexistent")
    assert flags == ("--act-compress",)
    args = C.train_args(300, 1234, False, extra=flags, model=C.LLAMA_MODEL, setting=C.LOW_FLOOR)
    assert args.act_config == ActConfig()  # nothing set: plan "auto", the default budget
    # results saved before issue 42 keep their verdict plan; those saved before issue 28
    # named none, and theirs was "auto 0.15"
    assert C.verdict_plan({}) == C.AUTO_TARGET == "auto 0.15"
    assert C.verdict_plan({"verdict_plan": C.DEFAULT}) == C.DEFAULT


def test_whole_split_batches_cover_every_target_once():
    tokens = np.arange(50) % 256
    batches = C.whole_split_batches(tokens, seq_length=8, micro_batch_size=3)
    # 49 targets: 7 windows of 8 (the last with 1), in 3 micro-batches of 3 rows (2 rows padding)
    assert len(batches) == 3 and all(b.tokens.shape == (3, 8) for b in batches)
    mask = torch.cat([b.loss_mask for b in batches]).bool()
    labels = torch.cat([b.labels for b in batches])[mask]
    inputs = torch.cat([b.tokens for b in batches])[mask]
    assert int(mask.sum()) == 49
    assert labels.tolist() == tokens[1:].tolist() and inputs.tolist() == tokens[:-1].tolist()
    assert batches[0].position_ids[0].tolist() == list(range(8))
    assert C.whole_split_batches(np.arange(1), 8, 2) == []
    exact = C.whole_split_batches(np.arange(17), 8, 2)  # 16 targets: two full windows, no padding
    assert len(exact) == 1 and bool(exact[0].loss_mask.all())


def test_churn_counts_changes_after_warm_up_per_100_iterations():
    assert C.warmup_iters(300) == 30 and C.warmup_iters(8) == 1
    c = C.churn([1, 2, 4, 30, 31, 200, 299], 300)
    assert c == {"warmup": 30, "after": 3, "per_100": pytest.approx(300 / 270)}
    assert C.churn([], 300)["per_100"] == 0.0
    assert C.run_churn({"valid": [1.0]}, 300) == {}  # stock: no controller, nothing to count


def _result(per_plan: dict, full: bool = True, changes=None) -> dict:
    """One model, two seeds: stock's curve ends at 2.0 and its whole split at 2.2; a plan's
    whole-split loss is 2.2 * (1 + gap), its curve's end 2.0 (the gap the curve would show: 0)."""
    seeds = [0, 1]
    runs = {}
    for s in seeds:
        runs[f"stock seed {s}"] = {"valid": [3.0, 2.0], "block_bytes": 1000, "measuring": None,
                                   **({"valid_full": 2.2} if full else {})}
    for plan, gaps in per_plan.items():
        for s, g in zip(seeds, gaps):
            runs[f"{plan} seed {s}"] = {"valid": [3.0, 2.0], "block_bytes": 80, "measuring": 0.2,
                                        "plan_changes": list((changes or {}).get(plan, [1])),
                                        **({"valid_full": 2.2 * (1 + g)} if full else {})}
    return {"steps": 300, "seeds": seeds, "plans": list(per_plan), "verdict_plan": C.DEFAULT,
            **({"evaluation": "whole validation split"} if full else {}),
            "models": {"llama": {"runs": runs}}}


def test_verdicts_read_the_whole_split_and_tables_report_plan_changes():
    res = _result({C.DEFAULT: [0.01, 0.02], "compress": [0.0, 0.001]},
                  changes={C.DEFAULT: [1, 2, 4, 100, 150, 160, 170]})
    p = C.summary(res)["llama"]["plans"][C.DEFAULT]
    assert p["per_seed"] == pytest.approx({0: 0.01, 1: 0.02})  # not the curve's 0
    assert p["changes_per_100"] == pytest.approx(400 / 270) == p["changes_per_100_max"]
    assert C.summary(res)["llama"]["plans"]["compress"]["changes_per_100"] == pytest.approx(0.0)
    table = C.table(res)
    assert "plan changes per 100 it. after warm-up" in table and "GACT" not in table
    row = next(r for r in table.splitlines() if "**default** (verdict)" in r)
    assert "1.5 (max 1.5)" in row
    runs = C.runs_table(res)
    assert "| 2.2220 | +1.00% |" in runs and "| 4 (1.5) |" in runs
    text = "\n".join(C.sentences(res))
    assert "changed 1.5 times per 100 iterations after warm-up" in text
    assert "positive control (INT2 everywhere) was not run here" in text
    assert "above stock and" not in text  # no GACT part in a target GACT was not run for
    # a result saved before issue 42 (no whole-split loss) is read on its curve's end
    old = _result({C.DEFAULT: [0.01, 0.02]}, full=False)
    assert C.summary(old)["llama"]["plans"][C.DEFAULT]["per_seed"] == pytest.approx({0: 0.0, 1: 0.0})
    assert C.evaluation(old) == "the same 4 held-out batches"


def test_the_pilot_command_parses():
    a = pilot_parser().parse_args(["--models", "llama", "--plans", C.DEFAULT, "compress", C.STOCK_ULP,
                                   "--seeds", "1234-1238", "--save-json", "x.json"])
    assert a.models == ["llama"] and a.seeds == (1234, 1235, 1236, 1237, 1238) and a.threads == 1
    with pytest.raises(SystemExit):
        pilot_parser().parse_args(["--models", "gpt9", "--save-json", "x.json"])


def test_the_pilot_runs_the_bf16_confirmation_by_its_setting():
    """`--setting bf16`: the low floor's plans, models and seeds in bf16, with a control of its
    own (one bf16 ulp); without it the pilot runs the low floor."""
    a = pilot_parser().parse_args(["--setting", "bf16", "--save-json", "x.json"])
    assert C.SETTINGS[a.setting] is C.BF16 and a.plans is None and a.models is None
    assert C.BF16.bf16 and C.BF16.control == C.STOCK_ULP and C.DEFAULT in C.BF16.plans
    assert C.BF16.models == C.LOW_FLOOR.models and C.BF16.seeds == C.LOW_FLOOR.seeds
    assert C.SETTINGS[pilot_parser().parse_args(["--save-json", "x.json"]).setting] is C.LOW_FLOOR


def test_the_pilot_refuses_a_json_of_another_setting(tmp_path):
    """A --save-json holding another setting's (or step count's) runs is refused in one line,
    untouched: `run` would start afresh and save over it."""
    from llm_act.bench.convergence_pilot import main

    out = tmp_path / "fp32.json"
    held = json.dumps({"setting": "fp32", "steps": 300, "models": {"quick": {"runs": {"stock seed 1": {}}}}})
    out.write_text(held)
    for argv in (["--setting", "bf16"], ["--steps", "30"]):
        with pytest.raises(SystemExit, match=r"holds runs of setting 'fp32' at 300 steps.*another --save-json"):
            main([*argv, "--models", "quick", "--seeds", "1", "--save-json", str(out)])
        assert out.read_text() == held


def test_the_bf16_control_moves_the_master_weights_too():
    """In bf16 the optimizer steps fp32 masters and copies them back into the parameters:
    the one-ulp control moves both, so its start survives the first step (moving only the
    parameters trained stock again, bit for bit)."""
    pytest.importorskip("megatron.core")
    from llm_act.train import parallel
    from llm_act.train.data import embedded_corpus
    from llm_act.train.loop import quiet_megatron_warnings
    from llm_act.train.trainer import Trainer

    quiet_megatron_warnings()
    model, data = C.llama("tiny", 2, 32, 4, 2, 64, 16, 2), embedded_corpus()
    args = C.train_args(4, 7, False, model=model, setting=C.BF16)
    parallel.init(args)
    try:
        stock, moved = Trainer(args, data), Trainer(C.train_args(4, 7, False, model=model, setting=C.BF16), data)
        C.perturb_one_ulp(moved, 7)
        before = [p.detach().clone() for c in stock.chunks for p in c.parameters()]
        after = [p.detach().clone() for c in moved.chunks for p in c.parameters()]
        assert all(p.dtype == torch.bfloat16 for p in before)
        for p, q in zip(before, after):  # every value one bf16 ulp away
            assert bool((q != p).all()) and torch.equal(torch.nextafter(p, q), q)
        assert all(torch.equal(m, p.float()) for p, m in zip(moved.optimizer.params, moved.optimizer.masters))
        stock.train_step()
        moved.train_step()
        trained = zip((p for c in stock.chunks for p in c.parameters()), (p for c in moved.chunks for p in c.parameters()))
        assert not all(torch.equal(p, q) for p, q in trained)
    finally:
        parallel.destroy_parallel()


@pytest.fixture(scope="module")
def tiny_llama_run():
    """A tiny Llama-style GPT, 4 steps of the default plan (fp32), process group up."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("pulp")
    from llm_act.train import parallel
    from llm_act.train.data import embedded_corpus
    from llm_act.train.loop import quiet_megatron_warnings
    from llm_act.train.trainer import Trainer

    quiet_megatron_warnings()
    model = C.llama("tiny", 2, 32, 4, 2, 64, 16, 2)
    data = embedded_corpus()
    parallel.init(C.train_args(4, 7, False, model=model, setting=C.LOW_FLOOR))
    try:
        run = C.train_one(model, C.DEFAULT, 7, 4, data, setting=C.LOW_FLOOR)
        trainer = Trainer(C.train_args(4, 7, False, model=model, setting=C.LOW_FLOOR), data)
        a = trainer.args
        head = data.valid[:a.eval_iters * a.global_batch_size * a.seq_length + 1]
        yield {"run": run, "trainer": trainer, "model": model, "head": head, "data": data,
               "evaluate": trainer.evaluate(), "whole_head": C.evaluate_whole(trainer, head)}
    finally:
        parallel.destroy_parallel()


def test_the_whole_split_evaluation_agrees_with_the_trainers(tiny_llama_run):
    """On the trainer's own eval batches (the first eval_iters global batches of the split)
    `evaluate_whole` gives the trainer's `evaluate`, and it counts every target."""
    loss, n = tiny_llama_run["whole_head"]
    assert n == len(tiny_llama_run["head"]) - 1
    assert loss == pytest.approx(tiny_llama_run["evaluate"], rel=1e-5)


def test_the_tiny_llama_trains_with_the_default_plan(tiny_llama_run):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    run, trainer = tiny_llama_run["run"], tiny_llama_run["trainer"]
    layers = [m for c in trainer.chunks for m in c.modules() if isinstance(m, TransformerLayer)]
    names = {type(m).__name__ for layer in layers for m in layer.modules()}
    assert any("RMSNorm" in n for n in names) and not any(n == "LayerNorm" for n in names)
    assert all(layer.mlp.config.gated_linear_unit and not layer.config.add_bias_linear for layer in layers)
    assert layers[0].config.num_query_groups == 2
    assert not trainer.chunks[0].share_embeddings_and_output_weights
    assert math.isfinite(run["valid_full"]) and run["valid_tokens"] == len(tiny_llama_run["data"].valid) - 1
    assert run["plan_changes"][:1] == [1] and run["history"][0]["reason"] == "first plan"
    assert run["churn"] == C.churn(run["plan_changes"], 4) and "plan" in run and run["cpu_s"] > 0


def test_the_pilot_goes_on_with_more_plans_in_the_same_json(tmp_path, capsys):
    """`convergence_pilot` saves after every run; run again with more plans on the same JSON,
    it trains only what is missing and keeps both commands."""
    pytest.importorskip("megatron.core")
    from llm_act.bench.convergence_pilot import main

    out = str(tmp_path / "part.json")
    base = ["--models", "quick", "--seeds", "1234", "--steps", "3", "--save-json", out]
    assert main(["--plans", C.STOCK_ULP, *base]) == 0
    with open(out) as f:
        first = json.load(f)
    assert main(["--plans", C.STOCK_ULP, "compress", *base]) == 0
    with open(out) as f:
        again = json.load(f)
    runs = again["models"]["quick"]["runs"]
    assert set(runs) == {"stock seed 1234", "stock, 1 ulp seed 1234", "compress seed 1234"}
    assert runs["stock seed 1234"] == first["models"]["quick"]["runs"]["stock seed 1234"]  # not retrained
    assert len(again["commands"]) == 2 and again["complete"] and again["plans"] == [C.STOCK_ULP, "compress"]
    assert "| quick | compress |" in capsys.readouterr().out


def test_the_default_plan_at_another_noise_fraction_is_one_more_flag():
    """Issue 42's calibration of the default noise budget: "default, noise X" is the default
    plan with --act-compress-noise-fraction X, adaptive like it; a bad X is refused by name."""
    from llm_act.config import ActConfig

    plan = C.DEFAULT_AT_NOISE + "0.05"
    flags = C._flags(plan, None, C.LLAMA_MODEL, "/nonexistent")
    assert flags == ("--act-compress", "--act-compress-noise-fraction", "0.05") and C._adaptive(plan)
    args = C.train_args(300, 1234, False, extra=flags, model=C.LLAMA_MODEL, setting=C.LOW_FLOOR)
    assert args.act_config == ActConfig(noise_fraction=0.05)
    assert C.noise_fraction_of(C.DEFAULT) is None and C.noise_fraction_of("compress") is None
    for bad in ("abc", "0", "-1"):
        with pytest.raises(ValueError, match="expected 'default, noise X' with a fraction X > 0"):
            C.noise_fraction_of(C.DEFAULT_AT_NOISE + bad)
    assert pilot_parser().parse_args(["--plans", plan, "compress", "--save-json", "x"]).plans == [plan, "compress"]
    with pytest.raises(SystemExit):
        pilot_parser().parse_args(["--plans", C.DEFAULT_AT_NOISE + "abc", "--save-json", "x"])


def test_the_default_plan_with_biased_codecs_said_explicitly():
    """Issue 42's test of the biased codecs: "default, unbiased" and "default, charged" are the
    default plan with --act-compress-biased-codecs exclude / charge, adaptive like it, and the
    pilot takes them; "default" itself excludes them (the default since issue 42's second
    part), and "auto X" keeps charging them as when its records were made."""
    from llm_act.config import ActConfig

    assert ActConfig().biased_codecs == "exclude"
    for plan, mode in ((C.DEFAULT_UNBIASED, "exclude"), (C.DEFAULT_CHARGED, "charge")):
        flags = C._flags(plan, None, C.LLAMA_MODEL, "/nonexistent")
        assert flags == ("--act-compress", "--act-compress-biased-codecs", mode)
        assert C._adaptive(plan)
        args = C.train_args(300, 1234, False, extra=flags, model=C.LLAMA_MODEL, setting=C.LOW_FLOOR)
        assert args.act_config == ActConfig(biased_codecs=mode)
        assert pilot_parser().parse_args(["--plans", plan, "--save-json", "x"]).plans == [plan]
    assert C._flags(C.AUTO_TARGET, 1000, C.LLAMA_MODEL, "/nonexistent")[-2:] == ("--act-compress-biased-codecs",
                                                                                 "charge")
    assert C._flags(C.AUTO_TARGET + " unbiased", 1000, C.LLAMA_MODEL, "/nonexistent")[-1] == "exclude"
    with pytest.raises(SystemExit):
        pilot_parser().parse_args(["--plans", "default, biased", "--save-json", "x"])
