"""The wheel a user gets holds every module of the source tree.

An editable install maps the source folders, so it hides a package missing from the wheel
(`llm_act.attention` and `llm_act.bench` once were). This builds the wheel from the tree,
installs it into a folder outside the tree and imports every module from there."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (setup.py's PACKAGE_DIRS)
FOLDERS = {"llm_act": "llm_act", "kernels": "llm_act.kernels", "patches": "llm_act.patches"}


def source_modules() -> list[str]:
    """Every importable module of the source tree, by its installed name."""
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append(".".join([package, *parts]))
    return out


def test_the_wheel_installs_every_module_of_the_tree(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, cwd=tmp_path, timeout=300)
    (wheel,) = wheels.glob("llm_act-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = source_modules()
    assert len(modules) > 50  # the walk found the tree
    missing = [m for m in modules
               if m.replace(".", "/") + ".py" not in names and m.replace(".", "/") + "/__init__.py" not in names]
    assert not missing, f"the wheel lacks {missing}"

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                    str(site), str(wheel)], check=True, timeout=300)
    script = (
        "import importlib, sys\n"
        f"site = {str(site)!r}\n"
        "bad = []\n"
        f"for name in {modules!r}:\n"
        "    mod = importlib.import_module(name)\n"
        "    if not (mod.__file__ or '').startswith(site):\n"
        "        bad.append((name, mod.__file__))\n"
        "assert not bad, bad\n"
        "print(len(sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, timeout=600,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
