"""The package list, derived from the tree so that a new subpackage can never be left out of
the wheel (an editable install hides a missing one; `tests/test_wheel.py` builds the wheel and
imports every module). `kernels/` and `patches/` install under the `llm_act` namespace: PyPI
already has packages named `kernels` and `launch`. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

#: top-level folder -> the package it installs as
PACKAGE_DIRS = {"llm_act": "llm_act", "llm_act.kernels": "kernels", "llm_act.patches": "patches"}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIRS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(where=folder)
                  if f"{name}.{sub}" not in PACKAGE_DIRS]
    return sorted(found)


setup(packages=packages(), package_dir={k: v for k, v in PACKAGE_DIRS.items() if k != v})
