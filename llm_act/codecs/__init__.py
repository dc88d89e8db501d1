"""Codecs for saved activations (ActNN, Adacc, DIVISION, Few-Bit Backward, FP8, masks).

`make_codec(name)` builds one by its registry name; the classes are importable here:
`IntQuant`, `OutlierInt4`, `DualPrecision`, `BitMask`, `RegenMask`, `FP8`, `FewBit`,
and `llm_act.codecs.fewbit.fit_derivative`. One module per codec, named like its kernels in
`llm_act.kernels` (`<stem>_ref.py`, `<stem>_triton.py`) and its tests (`test_<stem>.py`).
"""
from __future__ import annotations

from llm_act.codecs import fewbit
from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.bitmask import BitMask
from llm_act.codecs.dual import DualPrecision
from llm_act.codecs.fewbit import FewBit
from llm_act.codecs.fp8 import FP8
from llm_act.codecs.int_quant import IntQuant
from llm_act.codecs.outlier import OutlierInt4
from llm_act.codecs.regen import RegenMask
from llm_act.codecs.registry import CHOICE_NAMES, CODEC_NAMES, KEEP, RECOMPUTE, check_choice, make_codec

__all__ = [
    "BitMask", "CHOICE_NAMES", "CODEC_NAMES", "Codec", "DualPrecision", "Encoded", "FP8", "FewBit",
    "IntQuant", "KEEP", "OutlierInt4", "RECOMPUTE", "RegenMask", "check_choice", "fewbit", "make_codec",
]
