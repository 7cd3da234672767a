"""argparse types for the numbers our CLIs take, shared by ``megha`` and ``megha-loadgen``.

Each one converts the text and checks its range, so a bad value stops at parsing with one
line naming the option (``argument --hosts: must be >= 0, got -3``) and exit code 2, not a
traceback from deep inside a run. Floats must be finite: ``nan`` and ``inf`` are refused.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = [
    "ENV_NAME",
    "bounded",
    "env_pair",
    "fraction",
    "non_negative_float",
    "non_negative_int",
    "number_list",
    "port",
    "positive_float",
    "positive_int",
]


def bounded(
    convert: Callable[[str], int | float],
    name: str,
    low: float,
    *,
    low_open: bool = False,
    high: float = math.inf,
    high_open: bool = False,
) -> Callable[[str], int | float]:
    """A type that ``convert``s the text and keeps it within ``low``..``high``, both
    bounds included unless ``low_open`` / ``high_open``; ``name`` is what argparse calls
    the type."""
    above = f"> {_show(low)}" if low_open else f">= {_show(low)}"
    below = f"< {_show(high)}" if high_open else f"<= {_show(high)}"
    expected = above if high == math.inf else f"{above} and {below}"
    kind = "an integer" if convert is int else "a number"

    def parse(text: str) -> int | float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    parse.__name__ = name
    return parse


def number_list(item: Callable[[str], int | float]) -> Callable[[str], tuple]:
    """A type for comma-separated numbers, each parsed and checked by ``item``."""

    def parse(text: str) -> tuple:
        values = tuple(item(part) for part in text.split(",") if part.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        return values

    parse.__name__ = f"{item.__name__}_list"
    return parse


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a variable name, as shells take it


def env_pair(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` for an environment variable (the value may be empty)."""
    name, equals, value = text.partition("=")
    if not equals or not ENV_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE (NAME: letters, digits, _), got {text!r}"
        )
    return name, value


def _show(bound: float) -> str:
    """A bound as people write it: 64, 100000, 0.5."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


positive_int = bounded(int, "positive_int", 0, low_open=True)
non_negative_int = bounded(int, "non_negative_int", 0)
positive_float = bounded(float, "positive_float", 0, low_open=True)
non_negative_float = bounded(float, "non_negative_float", 0)
fraction = bounded(float, "fraction", 0, low_open=True, high=1, high_open=True)
port = bounded(int, "port", 1, high=65535)
port_or_off = bounded(int, "port (0: off)", 0, high=65535)
