"""The tables of docs/benchmarks.md that are rendered from a bench's saved JSON.

Why: a table typed or pasted by hand drifts from the run it claims (issue 44, item 5). A
marked table is the renderer's output on the JSON it names, nothing else:

    <!-- table: planner_solve from planner_2026-12-06.json -->
    | layers | MILP variables | ...
    <!-- /table -->

The JSON path is relative to the page's folder. `refresh` writes every marked table again
from its JSON (`llm-act bench planner|peak --save-json` calls it for the file it saved);
`stale` lists the marked tables that differ from their rendering, which the test suite
requires to be none, so a hand edit of a marked table fails there.

    python -m llm_act.bench.doc_tables docs/benchmarks.md   # render every marked table again
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Callable, Optional

from llm_act.bench import hf_convergence, hf_peak, overhead as O, peak, planner as P
from llm_act.bench.record import provenance_line

#: kind -> the renderer of that table from the saved result
KINDS: dict[str, Callable[[dict], str]] = {
    "provenance": provenance_line,
    "planner_solve": lambda r: P.solve_table(r["solve"]),
    "planner_distinct": lambda r: P.distinct_table(r["distinct"]),
    "planner_jittered": lambda r: P.jittered_table(r["jittered"]),
    "planner_repeat": lambda r: P.reproducibility_line(r["repeat"]),
    "planner_compare": lambda r: P.compare_table(r["compare"]),
    "planner_overhead": lambda r: O.table(r["overhead"]),
    "peak": peak.table,
    "hf_peak": hf_peak.table,
    "hf_sites": hf_peak.sites_table,
    "hf_peak_depth": hf_peak.depth_table,
    "hf_convergence": hf_convergence.table,
}
MARKED = re.compile(r"^<!-- table: (?P<kind>\w+) from (?P<source>\S+) -->\n(?P<body>.*?)^<!-- /table -->$",
                    re.M | re.S)


def render(kind: str, result: dict) -> str:
    """The markdown of table `kind` from a saved bench result."""
    if kind not in KINDS:
        raise ValueError(f"table kind {kind!r}: not one of {', '.join(KINDS)}")
    return KINDS[kind](result)


def _load(folder: str, source: str, cache: dict) -> dict:
    path = os.path.normpath(os.path.join(folder, source))
    if path not in cache:
        with open(path) as f:
            cache[path] = json.load(f)
    return cache[path]


def _rendered(page: str, only: Optional[str] = None):
    """(match, its rendering) for every marked table of `page`'s text (`only`: those whose
    JSON is that path)."""
    with open(page) as f:
        text = f.read()
    folder, cache, out = os.path.dirname(os.path.abspath(page)), {}, []
    for m in MARKED.finditer(text):
        if only and os.path.normpath(os.path.join(folder, m["source"])) != os.path.abspath(only):
            continue
        out.append((m, render(m["kind"], _load(folder, m["source"], cache))))
    return text, out


def stale(page: str) -> list[str]:
    """'kind from source' of each marked table whose text is not its rendering."""
    _, found = _rendered(page)
    return [f"{m['kind']} from {m['source']}" for m, body in found if m["body"].rstrip("\n") != body]


def refresh(page: str, source: Optional[str] = None) -> list[str]:
    """Render the marked tables of `page` again (`source`: only those from that JSON);
    returns their kinds."""
    text, found = _rendered(page, source)
    for m, body in reversed(found):
        text = text[:m.start("body")] + body + "\n" + text[m.end("body"):]
    with open(page, "w") as f:
        f.write(text)
    return [m["kind"] for m, _ in found]


if __name__ == "__main__":
    for name in sys.argv[1:] or [os.path.join("docs", "benchmarks.md")]:
        print(f"{name}: rendered {', '.join(refresh(name)) or 'no marked table'}")
