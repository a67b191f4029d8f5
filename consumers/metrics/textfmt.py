"""Text-format primitives: label and HELP escaping, dcgm-exporter's value text (pure)."""

from __future__ import annotations

from typing import Any

from gpupipe_consumers.metrics.fields import Kind

_INT, _ROUND, _PERCENT, _MIB, _FLOAT, _BOOL = (
    int(k) for k in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT, Kind.BOOL)
)
_HERTZ, _JOULES, _KIB = (int(k) for k in (Kind.HERTZ, Kind.JOULES, Kind.KIB))
_INF = float("inf")


class InvalidValue(ValueError):
    """A value that cannot be exposed; ``reason`` is nan | inf | negative | invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def escape_label_value(value: object) -> str:
    """Label value escaping of the text format: backslash, double quote, line feed."""
    s = str(value)
    if "\\" in s or '"' in s or "\n" in s:
        s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return s


def attr_text(attrs: tuple[tuple[str, str], ...]) -> str:
    """``,k="v"`` for each (already sorted) label pair."""
    return "".join(f',{k}="{escape_label_value(v)}"' for k, v in attrs)


def escape_help(text: str) -> str:
    """HELP escaping of the text format: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(kind: int, value: Any, signed: bool = False, upper: float | None = None) -> str:
    """One value as dcgm-exporter prints it; raises :class:`InvalidValue` instead of printing junk.
    ``upper``: the reading's bound (:func:`gpupipe_schemas.validate.reading_max`); above it (or below its
    negative, for a signed reading) is ``out-of-range``.

    The reference (slow) path: :meth:`Renderer.render` has an inlined fast path that must agree.
    """
    if isinstance(value, bool):
        value = int(value)
    elif not isinstance(value, int | float):
        raise InvalidValue("invalid")
    if isinstance(value, float):
        if value != value:
            raise InvalidValue("nan")
        if value in (_INF, -_INF):
            raise InvalidValue("inf")
    if value < 0 and not signed:
        raise InvalidValue("negative")
    if upper is not None and not -upper <= value <= upper:
        raise InvalidValue("out-of-range")
    if kind == _FLOAT:
        return f"{value:f}"
    if kind == _PERCENT:
        return str(round(value * 100))
    if kind == _MIB:
        return str(int(value) >> 20)
    if kind == _HERTZ:
        return str(round(value) * 1_000_000)
    if kind == _JOULES:
        return str(round(value) // 1000)
    if kind == _KIB:
        return str(round(value) * 1024)
    return str(round(value))  # INT, ROUND, BOOL (an int stays as it is; a float is rounded)
