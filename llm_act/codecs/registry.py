"""Codec names used by plans, flags and JSON, and the factory behind them."""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from llm_act.codecs.base import Codec
from llm_act.codecs.bitmask import BitMask
from llm_act.codecs.dual import DualPrecision
from llm_act.codecs.fewbit import FewBit
from llm_act.codecs.fp8 import FP8
from llm_act.codecs.int_quant import IntQuant
from llm_act.codecs.outlier import OutlierInt4
from llm_act.codecs.regen import RegenMask
from llm_act import sites
from llm_act.sites import CHECKPOINT_SITE, MASK_SITES, MLP_ACT_INPUT, MODEL_SITES, check_site

#: Choices that are not codecs.
KEEP, RECOMPUTE = "keep", "recompute"
NON_CODECS = (KEEP, RECOMPUTE)


def _intquant(**kw) -> Callable[..., Codec]:
    def make(seed: int = 1234, **_ignored) -> Codec:
        return IntQuant(seed=seed, **kw)

    return make


def _outlier(seed: int = 1234, **_ignored) -> Codec:
    return OutlierInt4(seed=seed)


def _dual(seed: int = 1234, **_ignored) -> Codec:
    return DualPrecision(seed=seed)


def _fp8(fmt: str) -> Callable[..., Codec]:
    def make(seed: int = 1234, **_ignored) -> Codec:
        return FP8(fmt=fmt, seed=seed)

    return make


def _fewbit(bits: int) -> Callable[..., Codec]:
    def make(seed: int = 1234, activation: str = "gelu", **_ignored) -> Codec:
        return FewBit(activation, bits, seed=seed)

    return make


def _bitmask(seed: int = 1234, **_ignored) -> Codec:
    return BitMask(seed=seed)


def _regen(seed: int = 1234, **_ignored) -> Codec:
    return RegenMask(seed=seed)


_FACTORIES: dict[str, Callable[..., Codec]] = {
    "int1": _intquant(bits=1),
    "int2": _intquant(bits=2),
    "int4": _intquant(bits=4),
    "int8": _intquant(bits=8),
    "int4_sym": _intquant(bits=4, symmetric=True, stochastic=False),
    "int8_sym": _intquant(bits=8, symmetric=True, stochastic=False),
    "int4_asym": _intquant(bits=4, symmetric=False, stochastic=False),
    "int4_channel": _intquant(bits=4, symmetric=True, stochastic=False, axis=-1),
    "outlier_int4": _outlier,
    "dual2": _dual,
    "fp8_e4m3": _fp8("e4m3"),
    "fp8_e5m2": _fp8("e5m2"),
    "fewbit1": _fewbit(1),
    "fewbit2": _fewbit(2),
    "fewbit3": _fewbit(3),
    "fewbit4": _fewbit(4),
    "bitmask": _bitmask,
    "regen": _regen,
}

CODEC_NAMES: tuple[str, ...] = tuple(_FACTORIES)
MASK_CODECS = frozenset({"bitmask", "regen"})
FEWBIT_CODECS = frozenset({"fewbit1", "fewbit2", "fewbit3", "fewbit4"})
#: every name a plan may hold for a site
CHOICE_NAMES: tuple[str, ...] = NON_CODECS + CODEC_NAMES
#: codecs whose decoded tensor is unbiased: stochastic rounding, or exact (the masks).
#: The rest (nearest rounding, fp8 casts, few-bit tables) err the same way on every token,
#: so their error adds up coherently in a weight gradient (issue 28)
UNBIASED_CODECS = frozenset({"int1", "int2", "int4", "int8", "outlier_int4", "dual2"}) | MASK_CODECS

#: bits per value each value codec stores (its code; scales, outlier slots and side lists
#: aside). Not listed: the few-bit derivative tables and the masks, which store no value.
VALUE_BITS = {"int1": 1, "int2": 2, "dual2": 2, "int4": 4, "int4_sym": 4, "int4_asym": 4,
              "int4_channel": 4, "outlier_int4": 4, "int8": 8, "int8_sym": 8, "fp8_e4m3": 8, "fp8_e5m2": 8}


def has_bits(name: str, min_bits: int) -> bool:
    """Whether `name` stores at least `min_bits` bits per value (`ActConfig.min_bits`): every
    choice that stores no value code (keep, recompute, the few-bit tables, the masks) has."""
    return VALUE_BITS.get(name, min_bits) >= min_bits


def unbiased_at(name: str, site: str) -> bool:
    """Whether codec `name` at `site` leaves the gradient unbiased: an exact mask codec, or an
    unbiased rounding (`UNBIASED_CODECS`) where the backward is linear in the stored tensor
    (`sites.LINEAR_BACKWARD`). Plan "auto" charges every other lossy choice its measured
    coherence (`measured_profile.charged_error`); `biased_codecs="exclude"` leaves out the
    biased roundings only (`UNBIASED_CODECS`: at a norm's input nothing else would fit)."""
    if name in MASK_CODECS:
        return True
    return name in UNBIASED_CODECS and site in sites.LINEAR_BACKWARD


def make_codec(name: str, *, seed: int = 1234, activation: str = "gelu") -> Codec:
    """Build the codec registered as `name` (`activation` selects the few-bit derivative)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown codec {name!r}; known codecs: {', '.join(CODEC_NAMES)}"
        ) from None
    codec = factory(seed=seed, activation=activation)
    codec.name = name
    return codec


def check_choice(site: str, name: str) -> str:
    """Validate that `name` ("keep", "recompute" or a codec) may be chosen at `site`."""
    check_site(site)
    if name not in CHOICE_NAMES:
        raise ValueError(
            f"unknown choice {name!r} for site {site!r}; "
            f"choose one of: {', '.join(CHOICE_NAMES)}"
        )
    if name in MASK_CODECS and site not in MASK_SITES:
        raise ValueError(f"codec {name!r} applies only to dropout-mask sites, not {site!r}")
    if site in MASK_SITES and name not in MASK_CODECS and name not in NON_CODECS:
        raise ValueError(
            f"site {site!r} holds a dropout mask: choose keep, recompute, bitmask or regen, "
            f"not {name!r}"
        )
    if name in FEWBIT_CODECS and site != MLP_ACT_INPUT:
        raise ValueError(f"codec {name!r} applies only to 'mlp.act_input', not {site!r}")
    if name == RECOMPUTE and site == CHECKPOINT_SITE:
        raise ValueError(
            "'ln1.input' is the block's checkpoint: keep or compress it, it cannot be recomputed"
        )
    if name == RECOMPUTE and site in MODEL_SITES:
        raise ValueError(
            f"{site!r} lies after the last block (its output): keep or compress it, it cannot be "
            "recomputed"
        )
    return name


#: What an MLP's activation lets backward keep at `mlp.act_input` (`LayerBinder.mlp_kind`):
#: its derivative depends on its input alone, so a few-bit table of f' may stand for x
MLP_FEWBIT = "fewbit"
#: ReLU: the activation's backward needs only a 1-bit mask of x
MLP_MASK = "mask"
#: gated (SwiGLU, GeGLU) and other units: backward needs x itself, so a value codec only
MLP_VALUE = "value"


def refusal(site: str, name: str, mlp_kind: Optional[str]) -> Optional[str]:
    """Why a layer whose MLP is of `mlp_kind` (`MLP_FEWBIT`, `MLP_MASK`, `MLP_VALUE`, or None
    where the layer's MLP is not known: a generic block) cannot take choice `name` at
    `site`; None where it can. The one rule every caller asks (`accepts`): the plan, the
    profile's options, the sensitivity and coherence probes, the fidelity reports and the
    layers' own `set_act_codec`."""
    try:
        check_choice(site, name)
    except ValueError as err:
        return str(err)
    if name in FEWBIT_CODECS and mlp_kind != MLP_FEWBIT:
        unit = {MLP_MASK: "a ReLU MLP (its backward keeps a 1-bit mask)",
                MLP_VALUE: "a gated or non-pointwise MLP (SwiGLU, GeGLU, squared ReLU: backward needs x itself)",
                None: "a block whose MLP llm_act does not know"}.get(mlp_kind, f"an MLP of kind {mlp_kind!r}")
        return (f"codec {name!r}: few-bit codecs need a pointwise activation whose derivative depends "
                f"on x only; this layer has {unit}: choose a value codec such as 'outlier_int4' at "
                f"{site!r}")
    return None


def accepts(site: str, name: str, mlp_kind: Optional[str]) -> bool:
    """Whether a layer whose MLP is of `mlp_kind` can take choice `name` at `site` (`refusal`)."""
    return refusal(site, name, mlp_kind) is None


def check_choices(choice: Mapping[str, str], where: str) -> None:
    """Validate a {site: choice name} mapping (one block of a plan, or per-site overrides);
    errors name `where` and the bad entry."""
    if not isinstance(choice, Mapping):
        raise ValueError(f"{where}: expected a mapping site -> choice name, got {choice!r}")
    for site, name in choice.items():
        if not isinstance(name, str):
            raise ValueError(f"{where}[{site!r}]: expected a choice name, got {name!r}")
        try:
            check_choice(site, name)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
