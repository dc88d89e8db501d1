"""A deliberately broken codec at one site: its decode returns zeros (shape, dtype and device
of the original), so a test of a lossy path can show that its bound fails when a codec is
wrong (issue 13 part 6).

Every codec a plan uses (and every one the fidelity report builds) comes from `Controller.new_codec`, on the megatron-core layers and on
the generic (Hugging Face / DeepSpeed) hooks alike; `install` wraps it, so the models must be
patched (`apply` / `initialize`) after it. Mask sites are not covered: "regen" rebuilds the
mask from the RNG without calling decode.

- In-process: `with broken("mlp.fc2_input", layer=1): ...`
- Spawned gloo ranks: call `install(site, layer)` at the top of the worker.
- Subprocesses (the DeepSpeed launcher): `env_for_subprocess(env, folder, site, layer)` puts a
  `sitecustomize.py` on PYTHONPATH that installs it in every Python process started.

`check_gradients` is the bound the lossy-path tests hold their gradients to, and that their
broken-codec companions must fail.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

ENV_SITE, ENV_LAYER = "LLM_ACT_TEST_BROKEN_SITE", "LLM_ACT_TEST_BROKEN_LAYER"
#: `site` value that breaks every site
ALL = "*"


def _zeros(enc) -> torch.Tensor:
    return torch.zeros(enc.shape, dtype=enc.dtype, device=enc.device)


def break_codec(codec):
    """Make this codec instance decode to zeros (encode, sizes and random streams unchanged)."""
    codec.decode = _zeros
    return codec


def install(site: str = ALL, layer: Optional[int] = None) -> Callable[[], None]:
    """Break every codec built from now on for `site` (ALL: every site) at `layer` (None: every
    layer). Returns the function that undoes it."""
    from llm_act.runtime.controller import Controller

    original = Controller.new_codec

    def new_codec(self, at_layer, at_site, name, seed):
        codec = original(self, at_layer, at_site, name, seed)
        if site in (ALL, at_site) and layer in (None, at_layer):
            break_codec(codec)
        return codec

    Controller.new_codec = new_codec

    def undo() -> None:
        Controller.new_codec = original

    return undo


@contextlib.contextmanager
def broken(site: str = ALL, layer: Optional[int] = None) -> Iterator[None]:
    """`install` for the duration of a `with` block."""
    undo = install(site, layer)
    try:
        yield
    finally:
        undo()


def install_from_env() -> None:
    """`install` as the environment says (what the generated sitecustomize calls)."""
    site = os.environ.get(ENV_SITE)
    if site:
        layer = os.environ.get(ENV_LAYER, "")
        install(site, int(layer) if layer else None)


def env_for_subprocess(env: dict, folder: Path, site: str = ALL,
                       layer: Optional[int] = None) -> dict:
    """A copy of `env` whose Python processes (launcher ranks included) run with the broken
    codec; `folder` receives the sitecustomize.py."""
    root = Path(__file__).resolve().parents[2]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "from tests.patches.broken_codec import install_from_env\ninstall_from_env()\n")
    out = dict(env)
    out[ENV_SITE] = site
    out[ENV_LAYER] = "" if layer is None else str(layer)
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder), str(root), env.get("PYTHONPATH", "")) if p)
    return out


def rel_error(grads, ref) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters of `ref` together (float64)."""
    num = sum(float((grads[n].double() - ref[n].double()).pow(2).sum()) for n in ref)
    den = sum(float(ref[n].double().pow(2).sum()) for n in ref)
    return (num / den) ** 0.5


def param_errors(grads, ref) -> dict[str, float]:
    """{name: relative error of that parameter's gradient}, for parameters with a gradient."""
    return {n: rel_error({n: grads[n]}, {n: ref[n]}) for n in ref if float(ref[n].norm()) > 0}


def check_gradients(grads, ref, total: float, each: float) -> None:
    """The gradient bound of a lossy run: relative error <= `total` over all parameters
    together and <= `each` for every parameter. A site whose codec is broken shows in its own
    parameters (a norm weight's gradient is small in the total) long before it shows in the
    total."""
    err = rel_error(grads, ref)
    assert err <= total, f"relative gradient error {err:.4f} > {total}"
    name, worst = max(param_errors(grads, ref).items(), key=lambda kv: kv[1])
    assert worst <= each, f"gradient of {name}: relative error {worst:.4f} > {each}"
