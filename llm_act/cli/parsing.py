"""What the subcommands share in parsing: positive-number argument types and the one-line
user error (`fail`)."""
from __future__ import annotations

import argparse
from typing import Callable, NoReturn


def positive(kind: Callable[[str], float], text: str) -> Callable[[str], float]:
    """An argparse type: `kind` above zero (a zero or negative shape ends in a traceback
    deep inside megatron-core otherwise)."""
    def parse(value: str) -> float:
        try:
            x = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {text}, got {value!r}") from None
        if not x > 0:
            raise argparse.ArgumentTypeError(f"expected {text}, got {value!r}")
        return x
    return parse


def fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A user error found after parsing: one line and exit code 2 (argparse's `error` would
    print the whole usage, dozens of lines for `train`, above it)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


POSITIVE_INT = positive(int, "a positive integer")
POSITIVE_FLOAT = positive(float, "a positive number")
