"""tools/house_counts.py (issue 44's before/after counter) on a small tree made here: it finds an
import circle only through a TYPE_CHECKING import, an underscore name used across files, a
getattr on a layer, a producer call outside the layer modules, a test helper defined twice, and
the suite time of a pytest log."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "house_counts", Path(__file__).resolve().parents[1] / "tools" / "house_counts.py")
house_counts = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(house_counts)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_counts_of_a_small_tree(tmp_path):
    _write(tmp_path, {
        "llm_act/__init__.py": "",
        "llm_act/a.py": "from llm_act.b import _hidden\nfrom typing import TYPE_CHECKING\n",
        "llm_act/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llm_act import a\n"
                        "_hidden = 1\ndef f(layer):\n    return getattr(layer, 'mlp', None)\n"
                        "def g(block):\n    return block.linear_fc1(1)\n",
        "tests/test_x.py": "def _gpt():\n    pass\n",
        "tests/test_y.py": "def _gpt():\n    pass\n",
        "launch/run.py": "", "tools/t.py": "",
        "log.txt": "== 3 passed in 12.50s ==\n",
    })
    c = house_counts.counts(tmp_path, tmp_path / "log.txt")
    assert c["import_circles"] == []
    assert c["import_circles_with_type_only"] == [["llm_act.a", "llm_act.b"]]
    assert c["underscore_names_across_files"] == 1
    assert c["getattr_hasattr_on_layers"] == 1
    assert c["producer_restatements"] == 1
    assert (c["test_helper_names_copied"], c["test_helper_copies"]) == (1, 1)
    assert c["top_level_modules"] == 3 and c["suite_seconds"] == 12.5
    assert "| import circles, type-only imports included | 1 (2 modules) |" in house_counts.table(c)


def test_the_package_has_no_import_circle_and_restates_no_producer():
    """Issue 44: no import circle in the package, `if TYPE_CHECKING:` imports included (the
    adapter's jobs see the controller as a `PlanOwner` and the adapter as their own Protocol),
    and no module outside the layers calls a layer's producers (`LayerBinder.producer`)."""
    c = house_counts.counts(Path(__file__).resolve().parents[1])
    assert c["import_circles_with_type_only"] == [] and c["import_circles"] == []
    assert c["producer_restatements"] == 0
