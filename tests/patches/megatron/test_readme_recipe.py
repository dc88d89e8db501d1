"""The README's Megatron-LM recipe and the one the slow run applies (`megatron_lm_recipe.EDITS`,
both layouts: 0.16's `model_provider.py`, 0.19's `pre_wrap_hooks`) say the same thing: every
line the recipe adds to a checkout is in the README's Megatron-LM section (comments aside), so
the text users copy is the text tested against Megatron-LM."""
from __future__ import annotations

import re
from pathlib import Path

from tests.patches.megatron import megatron_lm_recipe as recipe

README = Path(__file__).resolve().parents[3] / "README.md"


def _code(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("#")[0]).strip().rstrip(",")


def _section(text: str) -> str:
    start = text.index("### Megatron-LM")
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else None]


def _added_lines() -> list[str]:
    return [_code(line) for choices in recipe.EDITS for _, old, new in choices
            for line in new.splitlines() if line not in old.splitlines() and _code(line)]


def missing_lines(readme_text: str) -> list[str]:
    """The recipe's added lines that the README's Megatron-LM section does not hold (as a line,
    or inside one: `pretrain(..., extra_args_provider=add_arguments, ...)`)."""
    section = [_code(line) for line in _section(readme_text).splitlines()]
    return [line for line in _added_lines() if not any(line in other for other in section)]


def test_every_line_the_recipe_adds_is_in_the_readme():
    assert len(_added_lines()) >= 12
    assert missing_lines(README.read_text()) == []


def test_a_readme_without_the_0_19_hook_is_caught():
    text = README.read_text().replace("model_cfg.pre_wrap_hooks.append(act_compress)", "")
    assert missing_lines(text) == ["model_cfg.pre_wrap_hooks.append(act_compress)"]
