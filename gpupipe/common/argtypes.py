"""argparse `type=` converters shared by every command, so a bad value reads the same everywhere.

A converter may carry `show`, the inverse for `--help`: the CLI states every default once, from the
flag's own `default=`, and a millisecond default reads better as `10s` than as `10000`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gpupipe.common.durations import (
    format_duration_ms,
    format_iso_ms,
    parse_duration_ms,
    parse_iso_ms,
    parse_positive_duration_ms,
)
from gpupipe.common.errors import ConfigError

T = TypeVar("T")


class ArgType(Generic[T]):
    """A `type=` converter (ConfigError becomes argparse's one-line error) and how to show a value."""

    def __init__(self, parse: Callable[[str], T], show: Callable[[Any], str] | None = None) -> None:
        self._parse = parse
        self.show = show
        self.__name__ = parse.__name__  # argparse names the type in some messages

    def __call__(self, text: str) -> T:
        try:
            return self._parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


duration_ms = ArgType(parse_duration_ms, show=format_duration_ms)
"""A duration such as 500ms, 1s, 5m, 1h30m (0 allowed) in integer milliseconds."""

positive_duration_ms = ArgType(parse_positive_duration_ms, show=format_duration_ms)
"""Like duration_ms, but zero is refused."""

iso_time_ms = ArgType(parse_iso_ms, show=format_iso_ms)
"""An ISO-8601 time (naive means UTC) as epoch milliseconds."""


def field_default(config: type, name: str) -> Any:
    """The default of the dataclass `config`'s field `name`.

    A flag that sets a config field takes its default= from here, so the value is written once, where
    the config (and any caller that builds one without flags) sees it too.
    """
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{config.__name__}.{name} has no plain default")
            return f.default
    raise TypeError(f"{config.__name__} has no field {name!r}")


def field_default_ms(config: type, name: str) -> int:
    """:func:`field_default` of a seconds field (``*_s``) in the milliseconds a duration flag holds."""
    return round(field_default(config, name) * 1000)


def keyword_default(callable_: Callable[..., Any], name: str) -> Any:
    """The default of keyword parameter `name` of a class or function, for the same reason as
    :func:`field_default`: a flag that feeds that parameter must not restate it."""
    default = inspect.signature(callable_).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{callable_.__qualname__}({name}=) has no default")
    return default
