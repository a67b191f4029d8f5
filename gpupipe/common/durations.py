"""Human durations on the command line ("1s", "500ms", "1h30m", "5m") as integer milliseconds.

Integer milliseconds everywhere: window arithmetic and event timestamps must not
drift the way float seconds do over hours of simulated time.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from gpupipe.common.errors import ConfigError

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration_ms(text: str) -> int:
    """Parse '1s', '250ms', '1h30m', '2.5s' or a bare number of seconds into milliseconds."""
    s = text.strip().lower()
    if not s:
        raise ConfigError("empty duration")
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        return round(float(s) * 1000)
    pos, total = 0, 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS_MS[m.group(2)]
        pos = m.end()
    if pos != len(s) or pos == 0:
        raise ConfigError(f"bad duration {text!r}: use e.g. 500ms, 1s, 5m, 1h30m")
    return round(total)


def format_duration_ms(ms: int) -> str:
    """The exact, shortest unit-by-unit form of `ms` ('1h30m', '10s', '500ms', '0'), so `--help` can
    show a millisecond default as people type it and :func:`parse_duration_ms` reads it back unchanged."""
    if ms == 0:
        return "0"
    sign, rest, parts = ("-" if ms < 0 else ""), abs(int(ms)), []
    for unit in ("d", "h", "m", "s", "ms"):
        count, rest = divmod(rest, _UNITS_MS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return sign + "".join(parts)


def parse_positive_duration_ms(text: str) -> int:
    ms = parse_duration_ms(text)
    if ms <= 0:
        raise ConfigError(f"duration {text!r} must be greater than zero")
    return ms


def parse_iso_ms(text: str) -> int:
    """ISO-8601 time ('2026-11-30T00:00:00Z', naive = UTC) to epoch milliseconds."""
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(s)
    except ValueError as exc:
        raise ConfigError(f"bad time {text!r}: use ISO-8601, e.g. 2026-11-30T00:00:00Z") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def format_iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat().replace("+00:00", "Z")
