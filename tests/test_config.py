"""ActConfig: every field, parsing of sizes, and errors that name the bad key."""
import json

import pytest

from llm_act import ActConfig
from llm_act.config import parse_bytes

BRIEF_FIELDS = {
    "enabled": True,
    "plan": "auto",
    "budget": None,
    "codecs": {},
    "attention": "auto",
    "adapt": True,
    "adapt_interval_max": 1024,
    "sensitivity": True,
    "variance_budget": None,
    "seed": 1234,
    "noise_fraction": 0.25,
    "biased_codecs": "exclude",
    "min_bits": 4,
    "fidelity_every": 250,
    "output_loss": "stock",
    "output_chunk_tokens": 1024,
}


def test_fields_and_defaults_are_the_briefs():
    cfg = ActConfig()
    assert ActConfig.field_names() == tuple(BRIEF_FIELDS)
    assert cfg.to_dict() == BRIEF_FIELDS


@pytest.mark.parametrize(
    "text,expected",
    [("60GB", 60 * 10**9), ("60GiB", 60 * 2**30), ("1.5 MiB", int(1.5 * 2**20)), (4096, 4096),
     ("123", 123), ("2e3KB", 2 * 10**6)],
)
def test_budget_sizes(text, expected):
    assert parse_bytes(text) == expected
    assert ActConfig(budget=text).budget == expected


def test_from_dict_round_trips_through_json():
    d = {"enabled": True, "plan": "compress", "budget": "8GiB", "codecs": {"attn.q": "int8"},
         "attention": "sdpa", "adapt": False, "adapt_interval_max": 64, "sensitivity": False,
         "variance_budget": 0.5, "seed": 7}
    cfg = ActConfig.from_dict(json.loads(json.dumps(d)))
    assert cfg.budget == 8 * 2**30 and cfg.codecs == {"attn.q": "int8"}
    assert ActConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "bad,key",
    [
        ({"budgett": "1GB"}, "budgett"),
        ({"budget": "lots"}, "budget"),
        ({"budget": -5}, "budget"),
        ({"budget": True}, "budget"),
        ({"plan": "fastest"}, "plan"),
        ({"attention": "flash3"}, "attention"),
        ({"codecs": {"attn.qq": "int4"}}, "attn.qq"),
        ({"codecs": {"attn.q": "int3"}}, "int3"),
        ({"codecs": {"attn.q": "regen"}}, "regen"),
        ({"codecs": {"attn.q": "fewbit2"}}, "fewbit2"),
        ({"codecs": {"mlp.hidden_dropout_mask": "int4"}}, "mlp.hidden_dropout_mask"),
        ({"codecs": {"ln1.input": "recompute"}}, "ln1.input"),
        ({"codecs": ["attn.q"]}, "codecs"),
        ({"adapt_interval_max": 0}, "adapt_interval_max"),
        ({"variance_budget": -1.0}, "variance_budget"),
        ({"seed": "x"}, "seed"),
        ({"enabled": "yes"}, "enabled"),
        ({"min_bits": 0}, "min_bits"),
        ({"min_bits": 9}, "min_bits"),
        ({"min_bits": 2.5}, "min_bits"),
        ({"min_bits": True}, "min_bits"),
    ],
)
def test_bad_values_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        ActConfig.from_dict(bad)


def test_plan_path(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"version": 1, "blocks": []}))
    assert ActConfig(plan=str(p)).plan == str(p)
