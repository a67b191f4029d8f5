"""argparse `type=` converters shared by every command, so a bad value reads the same everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from gpupipe.durations import parse_duration_ms, parse_iso_ms, parse_positive_duration_ms
from gpupipe.errors import ConfigError

T = TypeVar("T")


def _argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


duration_ms = _argtype(parse_duration_ms)
"""A duration such as 500ms, 1s, 5m, 1h30m (0 allowed) in integer milliseconds."""

positive_duration_ms = _argtype(parse_positive_duration_ms)
"""Like duration_ms, but zero is refused."""

iso_time_ms = _argtype(parse_iso_ms)
"""An ISO-8601 time (naive means UTC) as epoch milliseconds."""
