"""Megatron-LM's door: `--act-compress` flags for `extra_args_provider`, and the ActConfig.

Megatron-LM's `pretrain_gpt.py` calls `parser = extra_args_provider(parser)`, so
`add_arguments` adds the flags to the parser it is given and returns it. Every
`ActConfig` field except `enabled` gets a flag `--act-compress-<field-with-dashes>`;
`--act-compress` itself turns compression on. Each value is checked by `ActConfig` inside
argparse's `type=` function, so a bad value is an argparse error naming the flag (exit
code 2 with the usage line), as for any of Megatron-LM's own flags. The flags default to
None ("not given"): `config_from_args` fills in `ActConfig`'s defaults.

A Megatron-LM user (tag core_v0.16.1) adds, as the README's recipe shows:

    # pretrain_gpt.py
    import llm_act.cpu
    from llm_act.patches.megatron import add_arguments
    llm_act.cpu.install(megatron_lm=True)  # CPU only; a no-op on a GPU
    pretrain(..., extra_args_provider=add_arguments, ...)
    # model_provider.py, on the model the builder returns:
    act_config = config_from_args(args)
    if act_config is not None:
        model.act_controller = apply(model, act_config)
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Optional

from llm_act.config import ActConfig

_PREFIX = "act_compress_"


def _checked(field: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type=` function: convert the text, then let ActConfig judge the value."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
            ActConfig(**{field: value})
        except (ValueError, TypeError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    parse.__name__ = field  # argparse names the type in some messages
    return parse


def parse_codecs(text: str) -> dict[str, str]:
    """'site=codec,site=codec' or a JSON object -> {site: codec}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"codecs: not valid JSON ({err.msg}): {text!r}") from None
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise ValueError(f"codecs: expected a JSON object {{site: codec name}}, got {text!r}")
        return value
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        site, eq, name = item.partition("=")
        if not eq or not site.strip() or not name.strip():
            raise ValueError(f"codecs: expected site=codec (comma separated) or JSON, got {item!r}")
        out[site.strip()] = name.strip()
    return out


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _optional_float(text: str) -> Optional[float]:
    return None if text.strip().lower() == "none" else _float(text)


def _budget(text: str) -> Any:
    return int(text) if text.isdigit() else text


#: field -> (type converter or None for the boolean pair, help)
_FLAGS: dict[str, tuple[Optional[Callable[[str], Any]], str]] = {
    "plan": (str, '"auto" (planner), "keep" (stock), "compress" (default codecs), '
                  '"recompute" (full), "selective" (core attention), or a JSON plan path'),
    "budget": (_budget, "activation memory budget, bytes or a size such as 60GB / 60GiB"),
    "codecs": (parse_codecs, "per-site overrides: site=codec,site=codec or a JSON object"),
    "attention": (str, "auto | stock | sdpa | chunked"),
    "adapt": (None, "re-plan during training at exponentially growing intervals"),
    "adapt_interval_max": (_int, "longest interval (iterations) between re-planning points"),
    "sensitivity": (None, "measure per-site gradient sensitivity (GACT)"),
    "variance_budget": (_float, "upper bound on the summed gradient noise"),
    "noise_fraction": (_optional_float, "auto's noise budget as a fraction of the measured "
                                        "mini-batch sampling noise ('none': no noise budget)"),
    "biased_codecs": (str, "under a noise budget, auto 'exclude's biased codecs (nearest rounding, fp8, "
                           "few-bit; the default) or 'charge's them their measured coherent error"),
    "min_bits": (_int, "the fewest bits per value a codec auto chooses may store (1: every codec; "
                       "default 4)"),
    "fidelity_every": (_int, "report the gradient fidelity every N iterations (0: on request only)"),
    "seed": (_int, "seed of the codecs' private stochastic-rounding generator"),
    "output_loss": (str, "the output layer and its loss: 'stock' (megatron's; keeps the fp32 "
                         "[tokens, vocab/tp] logits for backward), 'chunked' (the same loss chunk by "
                         "chunk, never the full logits; one more logits GEMM in backward), or 'auto' "
                         "(the planner chooses under plan 'auto', 'stock' under a fixed plan); default 'stock'"),
    "output_chunk_tokens": (_int, "tokens per chunk of the chunked output loss (default 1024)"),
}


def _flag(field: str) -> str:
    return "--act-compress-" + field.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--act-compress` and `--act-compress-*` to `parser` (in a group) and return it."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"parser: expected an argparse.ArgumentParser, got {type(parser).__name__}")
    missing = set(ActConfig.field_names()) - {"enabled"} - set(_FLAGS)
    if missing:  # a new ActConfig field must get a flag here
        raise RuntimeError(f"add_arguments: no flag for ActConfig field(s) {sorted(missing)}")
    group = parser.add_argument_group("activation compression (llm_act)")
    group.add_argument("--act-compress", action="store_true", default=False,
                       help="keep, compress or recompute saved activations per block (llm_act)")
    for field, (convert, text) in _FLAGS.items():
        dest = _PREFIX + field
        if convert is None:
            group.add_argument(_flag(field), dest=dest, action=argparse.BooleanOptionalAction,
                               default=None, help=f"{text} (default: on)")
        else:
            group.add_argument(_flag(field), dest=dest, type=_checked(field, convert),
                               default=None, metavar=field.upper(), help=text)
    return parser


def config_from_args(args: argparse.Namespace) -> Optional[ActConfig]:
    """The `ActConfig` the parsed flags ask for, or None without `--act-compress`.

    Raises ValueError naming the flag when an `--act-compress-*` flag is given without
    `--act-compress` (it would otherwise be silently ignored) or when the combination of
    values is invalid.
    """
    given = {
        field: getattr(args, _PREFIX + field)
        for field in _FLAGS
        if getattr(args, _PREFIX + field, None) is not None
    }
    if not getattr(args, "act_compress", False):
        if given:
            flags = ", ".join(_flag(f) for f in given)
            raise ValueError(f"{flags}: given without --act-compress (add --act-compress to turn it on)")
        return None
    try:
        return ActConfig(enabled=True, **given)
    except ValueError as err:
        raise ValueError(f"--act-compress: {err}") from None
