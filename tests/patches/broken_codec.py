"""Deliberately broken codecs, so a test of a lossy path can show that its bound fails when a
codec is wrong (issue 13 part 6, issue 28 item 5). Four kinds (`KINDS`) of sabotage, each the
failure a real bug would produce:

- "zeros": decode returns zeros (shape, dtype and device of the original); any codec;
- "round_down": stochastic rounding that always rounds down (its uniform draws are all 0):
  the error is as large as healthy rounding's but biased, so a one-draw norm bound cannot
  see it -- only an average over draws (or over training steps) can; stochastic codecs
  (`codec.stochastic`), on the CPU reference path (the Triton kernels draw their own bits);
- "constant_derivative": a few-bit codec decodes one constant (the mean of its real decode,
  the best constant in L2 and so the hardest to catch) instead of q(x) ~ f'(x); FewBit;
- "drop_outliers": outlier_int4 keeps no outlier channel exactly (its slots set to 0): the
  outliers are quantized with their group's inliers, whose step they blow up; only data with
  outlier channels shows it; OutlierInt4.

Only the data path is broken: `expected_error`, `nbytes_for` and the random streams of a
broken codec are the healthy codec's (a bound predicted from the codec stays honest).

Every codec a plan uses (and every one the fidelity report builds) comes from `Controller.new_codec`, on the megatron-core layers and on
the generic (Hugging Face / DeepSpeed) hooks alike; `install` wraps it, so the models must be
patched (`apply` / `initialize`) after it. Mask sites are not covered: "regen" rebuilds the
mask from the RNG without calling decode.

- In-process: `with broken("mlp.fc2_input", layer=1, kind="round_down"): ...`
- Spawned gloo ranks: call `install(site, layer, kind)` at the top of the worker.
- Subprocesses (the DeepSpeed launcher, `llm-act train`): `env_for_subprocess(env, folder,
  site, layer, kind)` puts a `sitecustomize.py` on PYTHONPATH that installs it in every Python
  process started.
- Every codec object, however built (`make_codec` in a unit test included): `with
  everywhere(kind): ...`, or for a whole pytest run `LLM_ACT_TEST_SABOTAGE=<kind> pytest -p
  tests.patches.broken_codec ...` (how each cell of the sabotage table is checked by running
  the ordinary tests with the sabotage on).

`check_gradients` is the bound the lossy-path tests hold their gradients to, and that their
broken-codec companions must fail.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from tests.rel_error import rel_error

ENV_SITE, ENV_LAYER = "LLM_ACT_TEST_BROKEN_SITE", "LLM_ACT_TEST_BROKEN_LAYER"
ENV_KIND = "LLM_ACT_TEST_BROKEN_KIND"
#: a kind here breaks every codec object of the process (`everywhere`)
ENV_EVERYWHERE = "LLM_ACT_TEST_SABOTAGE"
#: `site` value that breaks every site
ALL = "*"
ZEROS, ROUND_DOWN, CONSTANT_DERIVATIVE, DROP_OUTLIERS = (
    "zeros", "round_down", "constant_derivative", "drop_outliers")
KINDS = (ZEROS, ROUND_DOWN, CONSTANT_DERIVATIVE, DROP_OUTLIERS)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown sabotage {kind!r}; one of {', '.join(KINDS)}")
    return kind


def applies(codec, kind: str) -> bool:
    """Whether `kind` can break `codec` (the others are left healthy)."""
    from llm_act.codecs.fewbit import FewBit
    from llm_act.codecs.outlier import OutlierInt4

    _check_kind(kind)
    if kind == ZEROS:
        return True
    if kind == ROUND_DOWN:
        return bool(getattr(codec, "stochastic", False)) and not getattr(codec, "lossless", False)
    if kind == CONSTANT_DERIVATIVE:
        return isinstance(codec, FewBit)
    return isinstance(codec, OutlierInt4)


@contextlib.contextmanager
def _rand_gives_zeros() -> Iterator[None]:
    """torch.rand returns zeros: the codecs' stochastic rounding floor(v + u) rounds down."""
    real = torch.rand

    def zeros(*size, generator=None, **kw):
        return torch.zeros(*size, **kw)

    torch.rand = zeros
    try:
        yield
    finally:
        torch.rand = real


def _encode(codec, kind: str, encode, x: torch.Tensor):
    if kind == ROUND_DOWN:
        with _rand_gives_zeros():
            return encode(x)
    if kind == DROP_OUTLIERS:  # no slot: the outlier channels join their groups' INT4 codes
        frac = codec.max_outlier_frac
        codec.max_outlier_frac = 0.0
        try:
            return encode(x)
        finally:
            codec.max_outlier_frac = frac
    return encode(x)


def _decode(kind: str, decode, enc) -> torch.Tensor:
    if kind == ZEROS:
        return torch.zeros(enc.shape, dtype=enc.dtype, device=enc.device)
    out = decode(enc)
    if kind == CONSTANT_DERIVATIVE:
        finite = out[torch.isfinite(out)].double()
        mean = float(finite.mean()) if finite.numel() else 0.0
        return torch.full_like(out, mean)
    return out


def break_codec(codec, kind: str = ZEROS):
    """Break this codec instance as `kind` says (a codec `kind` does not apply to is returned
    unchanged: `applies`); sizes, error model and random streams stay the healthy ones."""
    if not applies(codec, kind):
        return codec
    encode, decode = codec.encode, codec.decode
    codec.encode = lambda x: _encode(codec, kind, encode, x)
    codec.decode = lambda enc: _decode(kind, decode, enc)
    codec.sabotage = kind
    return codec


def install(site: str = ALL, layer: Optional[int] = None, kind: str = ZEROS) -> Callable[[], None]:
    """Break (as `kind`) every codec built from now on for `site` (ALL: every site) at `layer`
    (None: every layer). Returns the function that undoes it; `install.count` (on it) says
    how many codecs were broken, so a test can check that its sabotage met a codec."""
    from llm_act.runtime.controller import Controller

    _check_kind(kind)
    original = Controller.new_codec
    broken_count = [0]

    def new_codec(self, at_layer, at_site, name, seed):
        codec = original(self, at_layer, at_site, name, seed)
        if site in (ALL, at_site) and layer in (None, at_layer) and applies(codec, kind):
            break_codec(codec, kind)
            broken_count[0] += 1
        return codec

    Controller.new_codec = new_codec

    def undo() -> None:
        Controller.new_codec = original

    undo.count = lambda: broken_count[0]
    return undo


@contextlib.contextmanager
def broken(site: str = ALL, layer: Optional[int] = None, kind: str = ZEROS) -> Iterator[Callable[[], int]]:
    """`install` for the duration of a `with` block; yields the count of broken codecs."""
    undo = install(site, layer, kind)
    try:
        yield undo.count
    finally:
        undo()


def _library_codec(codec) -> bool:
    """A codec of the library (`llm_act.codecs`), not a test's instrument built on `Codec`
    (the Gaussian channel that carries a predicted error, a table twin): breaking those would
    break the reference a test holds the codec to."""
    return type(codec).__module__.startswith("llm_act.codecs.")


def install_everywhere(kind: str) -> Callable[[], None]:
    """Break (as `kind`) every library codec object of the process, however it was built (the
    codec unit tests call `make_codec` directly), by wrapping `Codec.encode` / `decode` and
    the codecs that override them. Returns the undo."""
    from llm_act.codecs import base
    from llm_act.codecs.regen import RegenMask

    _check_kind(kind)
    saved = []
    for cls in (base.Codec, RegenMask):
        enc0, dec0 = cls.__dict__["encode"], cls.__dict__["decode"]
        saved.append((cls, enc0, dec0))

        def encode(self, x, _enc=enc0):
            if _library_codec(self) and applies(self, kind):
                return _encode(self, kind, lambda t: _enc(self, t), x)
            return _enc(self, x)

        def decode(self, enc, _dec=dec0):
            if _library_codec(self) and applies(self, kind):
                return _decode(kind, lambda e: _dec(self, e), enc)
            return _dec(self, enc)

        cls.encode, cls.decode = encode, decode

    def undo() -> None:
        for cls, enc0, dec0 in saved:
            cls.encode, cls.decode = enc0, dec0

    return undo


@contextlib.contextmanager
def everywhere(kind: str) -> Iterator[None]:
    """`install_everywhere` for the duration of a `with` block."""
    undo = install_everywhere(kind)
    try:
        yield
    finally:
        undo()


def install_from_env() -> None:
    """`install` / `install_everywhere` as the environment says (what the generated
    sitecustomize and the pytest plugin call)."""
    kind = os.environ.get(ENV_EVERYWHERE)
    if kind:
        install_everywhere(kind)
    site = os.environ.get(ENV_SITE)
    if site:
        layer = os.environ.get(ENV_LAYER, "")
        install(site, int(layer) if layer else None, os.environ.get(ENV_KIND) or ZEROS)


def pytest_configure(config) -> None:
    """As a plugin (`pytest -p tests.patches.broken_codec`): the environment's sabotage for
    the whole run, so the ordinary tests can be seen failing with it."""
    install_from_env()


def env_for_subprocess(env: dict, folder: Path, site: str = ALL,
                       layer: Optional[int] = None, kind: str = ZEROS) -> dict:
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
    out[ENV_KIND] = _check_kind(kind)
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(folder), str(root), env.get("PYTHONPATH", "")) if p)
    return out


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
