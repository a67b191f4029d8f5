import pytest

from gpupipe.common.durations import format_iso_ms, parse_duration_ms, parse_iso_ms
from gpupipe.common.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1s", 1000),
        ("500ms", 500),
        ("5m", 300_000),
        ("1h30m", 5_400_000),
        ("2.5s", 2500),
        ("90", 90_000),
        ("1d", 86_400_000),
        (" 10s ", 10_000),
    ],
)
def test_parse_duration(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "1x", "s", "1s2", "-1s", "1 s", "ms"])
def test_bad_duration(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_duration_ms(text)


def test_iso_roundtrip() -> None:
    ms = parse_iso_ms("2026-11-30T01:02:03Z")
    assert ms == 1796000523000
    assert format_iso_ms(ms) == "2026-11-30T01:02:03Z"
    assert parse_iso_ms("2026-11-30T01:02:03") == ms
    assert parse_iso_ms("2026-11-30T02:02:03+01:00") == ms
    with pytest.raises(ConfigError):
        parse_iso_ms("yesterday")
