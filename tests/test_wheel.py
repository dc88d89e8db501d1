"""The wheel a user gets holds every module of the source tree.

An editable install imports from the source tree, so it hides a package missing from the
wheel (`llm_act.attention` and `llm_act.bench` once were). This builds the wheel from the tree,
installs it into a folder outside the tree and imports every module from there."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: packages whose import reaches megatron-core, DeepSpeed and transformers: the wheel must carry
#: them (and `tests.frameworks` runs this file in the Python 3.12 venv for them)
INTEGRATION = ("llm_act.patches", "llm_act.train", "llm_act.cpu")

def source_modules() -> list[str]:
    """Every importable module of the source tree (one root, `llm_act/`: its import path is its
    file path)."""
    out = []
    for path in sorted((ROOT / "llm_act").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out.append(".".join(p for p in rel.parts if p != "__init__"))
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
    assert all(m in modules for m in INTEGRATION)
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
