"""A pytest plugin that selects the tests which import megatron-core, DeepSpeed or Hugging Face
transformers: the part of the suite that `.ci/run` runs again in its Python 3.12 venv, where those
three resolve to their newest versions inside our bounds (megatron-core 0.19 there, 0.16 on 3.11).

    pytest -p tests.frameworks -m frameworks ...

It marks `frameworks` every test whose file reaches one of them, read from the source (no test is
imported to decide, and nothing has to be marked by hand, so a new test file is picked up the day
it is written). A file reaches a framework when, anywhere in it (function bodies included):
- it imports `megatron`, `deepspeed` or `transformers`, or asks `pytest.importorskip` for them;
- it imports our integration of them (`llm_act.patches`, the training loop `llm_act.train`, which
  builds megatron-core models, or `launch/`);
- it uses the `megatron_one_rank` fixture (tests/conftest.py), runs `llm-act train` or a
  `launch/` script, or runs code in a child process that imports any of the above;
- it names our integration package as a string (tests/test_wheel.py imports every module of the
  built wheel by name);
- or it imports (or runs with `-m`) a helper module of this tests package that does
  (transitively: e.g. tests/gpt_runs.py, tests/schema_extra_site_run.py).
`python -m tests.frameworks` lists the selected files.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("megatron", "deepspeed", "transformers")
#: our modules whose whole purpose is one of the frameworks
INTEGRATION = ("llm_act.patches", "llm_act.train", "launch")
#: in the source: the fixture, the CLI's training job, a launch/ script, code run in a child
_TEXT = re.compile(r"megatron_one_rank|llm-act\W+train|\blaunch[\"'/,\s]+\w+\.py"
                   r"|\b(import|from)\s+(megatron|deepspeed|transformers|llm_act\.(patches|train))\b")
#: a string naming a helper module of this package run in a child (`-m tests.x`)
_MODULE = re.compile(r"^tests(\.\w+)+$")


def _top(name: str) -> bool:
    return name.split(".")[0] in FRAMEWORKS or any(
        name == mod or name.startswith(mod + ".") for mod in INTEGRATION)


@functools.lru_cache(maxsize=None)
def _imports(path: Path) -> tuple[bool, tuple[Path, ...]]:
    """(whether the file reaches a framework itself, the helper files of `tests/` it imports)."""
    source = path.read_text()
    direct = bool(_TEXT.search(source))
    helpers = []
    for node in ast.walk(ast.parse(source, str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" \
                and node.args and isinstance(node.args[0], ast.Constant):
            names = [str(node.args[0].value)]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                _MODULE.match(node.value) or node.value in INTEGRATION):
            names = [node.value]  # a module run in a child, or our integration imported by name
        for name in names:
            direct = direct or _top(name)
            if name.split(".")[0] == "tests":
                file = ROOT.joinpath(*name.split(".")).with_suffix(".py")
                if file.is_file() and file != path:
                    helpers.append(file)
    return direct, tuple(helpers)


@functools.lru_cache(maxsize=None)
def reaches_framework(path: Path, _seen: frozenset = frozenset()) -> bool:
    """Whether the test file (or a tests/ helper it imports) reaches a framework."""
    direct, helpers = _imports(path)
    return direct or any(reaches_framework(h, _seen | {path}) for h in helpers if h not in _seen)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "frameworks: imports megatron-core, DeepSpeed or transformers (tests/frameworks.py)")


def pytest_collection_modifyitems(config, items):
    mark = pytest.mark.frameworks
    for item in items:
        if reaches_framework(Path(str(item.fspath)).resolve()):
            item.add_marker(mark)


if __name__ == "__main__":
    for file in sorted((ROOT / "tests").rglob("test_*.py")):
        if reaches_framework(file.resolve()):
            print(file.relative_to(ROOT))
