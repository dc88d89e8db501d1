"""Codecs for saved activations (ActNN, Adacc, DIVISION, Few-Bit Backward, FP8, masks).

`make_codec(name)` builds one by its registry name; the classes are importable here:
`IntQuant`, `OutlierInt4`, `DualPrecision`, `BitMask`, `RegenMask`, `FP8`, `FewBit`,
and `llm_act.codecs.fewbit.fit_derivative`.
"""
from __future__ import annotations

import importlib

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.registry import (
    CHOICE_NAMES,
    CODEC_NAMES,
    KEEP,
    RECOMPUTE,
    check_choice,
    make_codec,
)

_LAZY = {
    "IntQuant": "llm_act.codecs.int_quant",
    "OutlierInt4": "llm_act.codecs.outlier",
    "DualPrecision": "llm_act.codecs.dual",
    "BitMask": "llm_act.codecs.bitmask",
    "RegenMask": "llm_act.codecs.regen",
    "FP8": "llm_act.codecs.fp8",
    "FewBit": "llm_act.codecs.fewbit",
}

__all__ = [
    "Codec",
    "Encoded",
    "CODEC_NAMES",
    "CHOICE_NAMES",
    "KEEP",
    "RECOMPUTE",
    "check_choice",
    "make_codec",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "fewbit":
        return importlib.import_module("llm_act.codecs.fewbit")
    raise AttributeError(f"module 'llm_act.codecs' has no attribute {name!r}")
