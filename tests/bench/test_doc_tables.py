"""docs/benchmarks.md's marked tables are their renderer's output on the committed JSON
(`llm_act.bench.doc_tables`), so a table edited by hand, or a JSON replaced without
rendering the page again, fails here (issue 44, item 5)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llm_act.bench import doc_tables

PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
#: the tables the planner and peak benches own on the page
OWNED = {"planner_solve", "planner_distinct", "planner_jittered", "planner_repeat", "planner_compare",
         "planner_overhead", "peak"}


def _kinds(page: Path) -> set[str]:
    return {m["kind"] for m in doc_tables.MARKED.finditer(page.read_text())}


def test_the_planner_and_peak_tables_are_rendered_from_their_json():
    assert OWNED <= _kinds(PAGE)
    assert doc_tables.stale(str(PAGE)) == []


@pytest.fixture
def page_copy(tmp_path):
    """docs/benchmarks.md and the JSON its marked tables name, copied to a folder of their own."""
    shutil.copy(PAGE, tmp_path / PAGE.name)
    for m in doc_tables.MARKED.finditer(PAGE.read_text()):
        shutil.copy(PAGE.parent / m["source"], tmp_path / m["source"])
    return tmp_path / PAGE.name


def test_a_hand_edit_fails_and_refresh_renders_it_again(page_copy):
    text = page_copy.read_text()
    m = next(m for m in doc_tables.MARKED.finditer(text) if m["kind"] == "peak")
    edited = m["body"].replace("| keep |", "| keep (edited) |", 1)
    assert edited != m["body"]
    page_copy.write_text(text[:m.start("body")] + edited + text[m.end("body"):])
    assert doc_tables.stale(str(page_copy)) == [f"peak from {m['source']}"]
    assert "peak" in doc_tables.refresh(str(page_copy))
    assert page_copy.read_text() == text and doc_tables.stale(str(page_copy)) == []


def test_refresh_of_one_source_leaves_the_others(page_copy):
    text = page_copy.read_text()
    sources = {m["source"] for m in doc_tables.MARKED.finditer(text)}
    peak_json = next(s for s in sources if s.startswith("peak_"))
    assert set(doc_tables.refresh(str(page_copy), source=str(page_copy.parent / peak_json))) == {"provenance", "peak"}
    assert page_copy.read_text() == text


def test_save_json_writes_the_result_and_renders_its_tables(page_copy):
    """`--save-json`: the file, then the page's tables marked as rendered from it."""
    import json

    from llm_act.bench.report import saved

    text = page_copy.read_text()
    peak_json = next(m["source"] for m in doc_tables.MARKED.finditer(text) if m["kind"] == "peak")
    result = json.loads((page_copy.parent / peak_json).read_text())
    result["rows"][0]["measured"] += 8
    saved(result, str(page_copy.parent / peak_json), str(page_copy.parent), log=lambda m: None)
    assert json.loads((page_copy.parent / peak_json).read_text()) == result
    assert doc_tables.stale(str(page_copy)) == [] and page_copy.read_text() != text
    assert f"| {result['rows'][0]['measured']} |" in page_copy.read_text()


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="table kind 'nope'"):
        doc_tables.render("nope", {})
