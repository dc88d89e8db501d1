"""Docs claim only what was recorded (issue 44, item 5; design, fourth round).

Every sentence of README.md and docs/*.md that states a figure of speed, loss or memory
either points to the run that measured it or says it is a prediction. This test reads the
pages and flags each sentence with such a figure that does neither, so a figure pasted from
memory, or from a run nobody kept, fails here.

The rule, precisely:

- **What is read.** README.md and docs/*.md: prose, list items, headings and table rows.
  Fenced code blocks are skipped (commands and raw output, not claims); inline code spans are
  never read for figures (flags, budgets given as input, code), only for citations.
- **A figure** is a number, or a range like ``0.54-0.90``, with a unit of speed, loss or
  memory right after it: ``%``; ``x`` or ``×`` (a ratio, attached: ``0.3x``); a time
  (``ms``, ``µs``, ``s``, ``min``, ``minutes``, ``hours``); a rate (``tokens/s``, ``it/s``);
  memory (``B`` after a space, ``KB``, ``KiB``, ``MB``, ``MiB``, ``GB``, ``GiB``, ``TB``,
  ``bytes``, ``B/sbh``, ``bits per element``); a loss (``nats/byte``); or a share of a
  baseline (``0.083 of stock``, ``of full recompute``, ``of the copy bandwidth``). ``1.3B``
  (a parameter count) is not a figure; neither is a bare number.
- **A citation** names a record: a JSON under docs/ (``docs/x.json``, or a dated
  ``name_YYYY-MM-DD.json``), docs/gpu_runs_<date>.md (raw output), docs/megatron_lm.md or
  docs/benchmarks.md (pages whose own sections carry their provenance, tested here too); a
  command in a code span (``llm-act ...``, ``pytest ...``, ``python ...``, ``bash ...``,
  environment assignments before it allowed); or a test file ``tests/...py``, which
  asserts the figure on every run. A cited file must exist.
- **A prediction** says so: "predict" (predicts, predicted, prediction) or "target".
- **Scope.** A sentence passes when it cites or predicts itself, or when something above it
  speaks for it:
  - its paragraph's (or list item's) first sentence, which gives the paragraph's record;
  - for a table, or a list item, the paragraph just before it that introduces it (ends with
    ':');
  - its section's provenance line: the first paragraph under a heading, set in italics
    (``*Machine: ... Command: `...`*``, as `llm-act bench` writes it), that cites; or a
    heading that cites. It covers everything under that heading until the next heading of
    the same or a higher level. A page's opening paragraph under its title is no provenance
    line: it speaks for no section;
  - a table between ``<!-- table: KIND from FILE.json -->`` and ``<!-- /table -->``: it is
    rendered from that JSON (`tests/bench/test_doc_tables.py` holds it to that).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_NUMBER = r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?\d[\d,]*(?:\.\d+)?)?"
_UNIT = (r"(?:%|×|x(?![\w])"
         r"|\s?(?:ms|µs|us|s|sec|min|minutes?|hours?|tokens/s|it/s|KB|KiB|kB|MB|MiB|GB|GiB|TB"
         r"|B/sbh|bits per element|nats/byte)(?![\w=/])"
         r"|[\s-]bytes?(?![\w=/])|\sB(?![\w=/])"
         r"|\sof\s(?:stock|full recompute|megatron full|the copy bandwidth)\b)")
FIGURE = re.compile(_NUMBER + _UNIT)
RECORD = re.compile(r"docs/[\w.-]+\.json|\b[\w-]+_\d{4}-\d\d-\d\d\w*\.json"
                    r"|(?:docs/)?(?:gpu_runs_[\d-]+|megatron_lm|benchmarks)\.md"
                    r"|tests/[\w/]+\.py")
COMMAND = re.compile(r"`(?:[A-Z_]+=\S+\s+)*(?:llm-act|pytest|python|bash)\s[^`]*`")
PREDICTION = re.compile(r"\bpredict(?:s|ed|ion|ions)?\b|\btargets?\b", re.I)
CODE_SPAN = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
MARKER = re.compile(r"^<!-- table: \w+ from (\S+) -->$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(\"“])")


@dataclass
class Claim:
    path: str
    line: int
    sentence: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.sentence}"


def cites(text: str) -> bool:
    """A recorded file, a command or a test file named in `text`."""
    return bool(RECORD.search(text) or COMMAND.search(text))


def covered(text: str) -> bool:
    return cites(text) or bool(PREDICTION.search(text))


def has_figure(text: str) -> bool:
    return bool(FIGURE.search(CODE_SPAN.sub(" ", text)))


def sentences(block: str) -> list[str]:
    """A paragraph's sentences (a table's rows, one each)."""
    if block.lstrip().startswith("|"):
        return [row for row in block.splitlines() if row.strip()]
    return [s for s in _SENTENCE_END.split(" ".join(block.split())) if s]


def lead(block: str, parts: list[str]) -> str:
    """What speaks for a whole paragraph: all of it when it is a provenance line (set in
    italics, as `llm-act bench` writes ``*Machine: ... Command: `...`*``), else its first
    sentence."""
    b = block.strip()
    if b.startswith("*") and not b.startswith("**") and b.rstrip(".").endswith("*"):
        return block
    return parts[0] if parts else ""


def _blocks(text: str):
    """(first line number, heading level or 0, text, the JSON of the marked table it is in or
    None) for each heading, paragraph, list item and table of a page, code fences dropped."""
    lines = text.splitlines()
    out, buf, start, fence, marker = [], [], 0, False, None

    def flush():
        nonlocal buf
        if buf:
            out.append((start, 0, "\n".join(buf), marker))
        buf = []
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            flush()
            fence = not fence
            continue
        if fence:
            continue
        m = MARKER.search(line)
        if m:
            flush()
            marker = m.group(1)
            continue
        if line.strip() == "<!-- /table -->":
            flush()
            marker = None
            continue
        if HEADING.match(line):
            flush()
            out.append((i, len(HEADING.match(line).group(1)), line, None))
            continue
        is_row = line.lstrip().startswith("|")
        if not line.strip() or ITEM.match(line) or (buf and is_row != buf[-1].lstrip().startswith("|")):
            flush()
        if line.strip():
            if not buf:
                start = i
            buf.append(line)
    flush()
    return out


def uncovered(text: str, path: str = "<text>") -> list[Claim]:
    """The sentences of `text` (a markdown page) with a figure and neither a citation nor a
    prediction in their own scope (the module's rule)."""
    flagged: list[Claim] = []
    sections: list[list] = []  # [level, covered by its heading or first paragraph]
    fresh = False  # the next block is the first of its section
    caption = ""   # the paragraph before a table or list, when it introduces one
    for line, level, block, marker in _blocks(text):
        if level:
            while sections and sections[-1][0] >= level:
                sections.pop()
            if has_figure(block) and not covered(block) and not any(c for _, c in sections):
                flagged.append(Claim(path, line, block))
            sections.append([level, cites(block)])
            fresh = True
            continue
        table, item = block.lstrip().startswith("|"), bool(ITEM.match(block))
        parts = sentences(block)
        head = "" if table else lead(block, parts)
        if fresh and sections[-1:] and sections[-1][0] > 1 and head is block and cites(head):
            sections[-1][1] = True
        fresh = False
        introduced = (table or item) and covered(caption)
        scope = any(c for _, c in sections) or bool(marker) or introduced or covered(head)
        if block.rstrip().endswith(":"):
            caption = block
        elif not item:
            caption = ""  # a list's items share the paragraph that introduces the list
        if scope:
            continue
        for k, s in enumerate(parts):
            if has_figure(s) and not covered(s):
                flagged.append(Claim(path, line + (k if table else 0), s))
    return flagged


def test_every_figure_in_the_docs_cites_a_record_or_says_it_is_a_prediction():
    flagged = [c for page in PAGES for c in uncovered(page.read_text(), str(page.relative_to(ROOT)))]
    assert not flagged, ("sentences with a figure of speed, loss or memory that cite no record "
                         "(file and command) and say no prediction:\n" + "\n".join(map(str, flagged)))


def test_every_cited_record_exists():
    """A citation names a file that is there (a record cannot be invented by naming it)."""
    missing = set()
    for page in PAGES:
        text = "\n".join(block for _, _, block, _ in _blocks(page.read_text()))  # code fences: output
        for name in RECORD.findall(text):
            where = ROOT / name if "/" in name else ROOT / "docs" / name
            if not where.exists():
                missing.add(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)


@pytest.mark.parametrize("text", [
    "compress runs at 0.4x of stock.",
    "The codecs reach 5-19% of the copy bandwidth.",
    "A step takes 861 ms and stores 12.5 MiB.",
    "## A section\n\nIt ran at 0.95x stock.\n\n### Below\n\nStill 3 GiB.",
    "It ran well. It took 3 s. Its record is docs/gpu.json.",  # a later sentence speaks for itself only
    "# Page title\n\n*Command: `llm-act bench all`.*\n\nIt took 3 s.",  # a title's opening is no section line
    "Plain paragraph.\n\n- one item at 0.5x\n- another at 3 s",
    "Prose naming `<!-- table: peak from peak_2026-12-06.json -->` in a code span.\n\n| a | 3 ms |",
])
def test_an_uncited_figure_is_flagged(text):
    assert uncovered(text)


@pytest.mark.parametrize("text", [
    "compress runs at 0.4x of stock (`llm-act bench gpu`, docs/gpu.json).",
    "The planner predicts 0.4x of stock.",
    "Target: within 3%.",
    "## 3. Planner\n\n*Machine: CPU. Command: `llm-act bench planner`.*\n\nIt took 0.1 s.\n\n"
    "### Below\n\n| a | 3 ms |",
    "A paragraph that names its record (docs/overhead_2026-12-02.json).\nIt took 1.40% of the run.",
    "Raw output: docs/gpu_runs_2026-11-26.md. Throughput was 0.3x stock.",
    "Layers 24, hidden 256, heads 8, 300 steps, budget `60GB`, a 1.3B model.",
    "From the run in docs/gpu_runs_2026-11-26.md:\n\n- one item at 0.5x\n- another at 3 s",
    "<!-- table: peak from peak_2026-12-06.json -->\n| a | 3 ms |\n<!-- /table -->",
])
def test_a_cited_figure_or_a_prediction_passes(text):
    assert not uncovered(text)


def test_a_section_line_covers_only_its_own_section():
    text = ("## 1. Cited\n\n*Command: `llm-act bench memory`.*\n\n### 1.1\n\n0.5x.\n\n"
            "## 2. Other\n\nIt took 3 s.")
    assert [c.sentence for c in uncovered(text)] == ["It took 3 s."]
