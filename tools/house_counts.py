"""Counts of the house (issue 44's before/after table), from the source alone.

    python tools/house_counts.py [--root .] [--suite-log FILE] [--json OUT]

Prints one markdown table:
- files and lines per folder (the package's subpackages, the test folders, launch/, tools/);
- the package's top-level modules;
- import circles among the project's modules (strongly connected components of the import
  graph, imports under `if TYPE_CHECKING:` included, and counted separately);
- underscore names that cross files (`from m import _x`, `m._x` on an imported project module);
- `getattr` / `hasattr` on layers (first argument named like a module: layer, module, mlp,
  attention, attn, block, submodule, chunk, model);
- places outside the layer modules that restate a producer (call a layer's own linears or
  core attention: `.linear_qkv(`, `.linear_proj(`, `.linear_fc1(`, `.linear_fc2(`,
  `.core_attention(`, `.activation_func(`);
- helper copies in tests (a function name defined at module level in two or more test files);
- the suite's time, read from a pytest log (`--suite-log`: its last "in N.NNs" line).

The import names follow the folders: `llm_act/x/y.py` is `llm_act.x.y`, and where the
package still maps folders outside `llm_act/` (setup.py's PACKAGE_DIRS before issue 44) they are
read from setup.py, so the same script counts both layouts."""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LAYER_WORDS = re.compile(r"(layer|module|mlp|attention|attn|block|submodule|chunk|model)", re.I)
PRODUCER_CALLS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "core_attention", "activation_func")
#: the files that define the layers, where calling a producer is the layer's own forward
LAYER_FILES = re.compile(r"(patches/megatron/(attention|mlp|moe|moe_functions|linear|recompute_producers|"
                         r"recompute_region|recompute_codec)\.py|patches/deepspeed/(hf_decoder|generic|"
                         r"megatron_recompute)\.py|generic/)")


def package_dirs(root: Path) -> dict[str, str]:
    """Import prefix -> folder (setup.py's PACKAGE_DIRS where it has one)."""
    setup = root / "setup.py"
    if setup.exists():
        m = re.search(r"PACKAGE_DIRS\s*=\s*(\{[^}]*\})", setup.read_text())
        if m:
            return ast.literal_eval(m.group(1))
    return {"llm_act": "llm_act"}


def modules(root: Path) -> dict[str, Path]:
    """Import name -> file of every module of the package."""
    out = {}
    for prefix, folder in sorted(package_dirs(root).items(), key=lambda kv: len(kv[0])):
        base = root / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = path
    return out


def _resolve(name: str, module: str, level: int, is_package: bool) -> str:
    if level == 0:
        return name
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(mods: dict[str, Path]) -> tuple[dict, dict, list]:
    """(edges, type-only edges, cross-file underscore uses) among the project's modules."""
    edges, typed, underscore = defaultdict(set), defaultdict(set), []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking(node):
                guarded.update(id(n) for b in node.body for n in ast.walk(b))
        aliases = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    targets.append(a.name)
                    if a.name in mods:
                        aliases[a.asname or a.name] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", name, node.level, is_pkg)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        targets.append(full)
                        aliases[a.asname or a.name] = full
                    else:
                        targets.append(base)
                        if a.name.startswith("_") and not a.name.startswith("__") and base in mods \
                                and base != name:
                            underscore.append((name, f"{base}.{a.name}"))
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    (typed if id(node) in guarded else edges)[name].add(t)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and aliases[node.value.id] != name):
                underscore.append((name, f"{aliases[node.value.id]}.{node.attr}"))
    return edges, typed, underscore


def circles(edges: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def layer_reflection(mods: dict[str, Path]) -> int:
    n = 0
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and LAYER_WORDS.search(ast.unparse(node.args[0]))):
                n += 1
    return n


def producer_restatements(root: Path, mods: dict[str, Path]) -> int:
    n = 0
    for path in mods.values():
        rel = path.relative_to(root).as_posix()
        if LAYER_FILES.search(rel):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in PRODUCER_CALLS):
                n += 1
    return n


def helper_copies(root: Path) -> tuple[int, int]:
    """(names defined at module level in two or more test files, their copies beyond the first)."""
    where = defaultdict(set)
    for path in (root / "tests").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("test"):
                where[node.name].add(path)
    copied = {k: v for k, v in where.items() if len(v) > 1}
    return len(copied), sum(len(v) - 1 for v in copied.values())


def folder_lines(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    folders = [root / f for f in sorted(set(package_dirs(root).values()))]
    for base in folders:
        for sub in [base, *sorted(p for p in base.iterdir() if p.is_dir() and p.name != "__pycache__")]:
            files = list(sub.glob("*.py")) if sub == base else list(sub.rglob("*.py"))
            if files:
                key = sub.relative_to(root).as_posix() + ("/ (top level)" if sub == base else "/")
                out[key] = (len(files), sum(len(f.read_text().splitlines()) for f in files))
    for name in ("tests", "launch", "tools"):
        files = list((root / name).rglob("*.py"))
        out[name + "/"] = (len(files), sum(len(f.read_text().splitlines()) for f in files))
    return out


def suite_seconds(log: Path | None) -> float | None:
    if log is None:
        return None
    found = re.findall(r" in ([0-9.]+)s", log.read_text(errors="replace"))
    return float(found[-1]) if found else None


def counts(root: Path, suite_log: Path | None = None) -> dict:
    mods = modules(root)
    edges, typed, underscore = imports(mods)
    both = defaultdict(set)
    for src in (edges, typed):
        for k, v in src.items():
            both[k] |= v
    top = [m for m, p in mods.items() if m.count(".") == 1 and p.parent == root / "llm_act"
           and p.name != "__init__.py"]
    return {
        "folders": folder_lines(root),
        "top_level_modules": len(top) + 1,  # __init__.py included
        "import_circles": circles(edges),
        "import_circles_with_type_only": circles(both),
        "underscore_names_across_files": len(set(underscore)),
        "getattr_hasattr_on_layers": layer_reflection(mods),
        "producer_restatements": producer_restatements(root, mods),
        "test_helper_names_copied": helper_copies(root)[0],
        "test_helper_copies": helper_copies(root)[1],
        "suite_seconds": suite_seconds(suite_log),
    }


def table(c: dict) -> str:
    suite = "not given" if c["suite_seconds"] is None else f"{c['suite_seconds']:.0f} s"
    rows = [f"| {k} | {n} files, {lines} lines |" for k, (n, lines) in c["folders"].items()]
    rows += [
        f"| top-level modules of llm_act (`__init__.py` included) | {c['top_level_modules']} |",
        f"| import circles | {len(c['import_circles'])} ({sum(map(len, c['import_circles']))} modules) |",
        f"| import circles, type-only imports included | {len(c['import_circles_with_type_only'])} "
        f"({sum(map(len, c['import_circles_with_type_only']))} modules) |",
        f"| underscore names used across files | {c['underscore_names_across_files']} |",
        f"| getattr/hasattr on layers | {c['getattr_hasattr_on_layers']} |",
        f"| calls of a layer's producers outside the layer modules | {c['producer_restatements']} |",
        f"| test helper names defined in 2+ test files (copies) | {c['test_helper_names_copied']} "
        f"({c['test_helper_copies']}) |",
        f"| suite time | {suite} |",
    ]
    return "| what | count |\n|---|---|\n" + "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--suite-log", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the counts here")
    args = p.parse_args(argv)
    c = counts(args.root, args.suite_log)
    print(table(c))
    if args.json:
        args.json.write_text(json.dumps(c, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
