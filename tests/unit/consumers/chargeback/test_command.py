"""`gpupipe chargeback` and `gpupipe report chargeback` flags (no broker needed)."""

from __future__ import annotations

import pytest
import yaml

from gpupipe.commands.cli import apply_env_defaults, build_parser
from gpupipe_consumers.chargeback.command import EXAMPLE_PRICES, load_prices
from tests.paths import REPO

REPO = REPO
NOWHERE = ("--bootstrap-servers", "127.0.0.1:9")  # clients are built, never used


def test_built_in_prices_are_the_example_file() -> None:
    assert yaml.safe_load((REPO / "deploy/prices.example.yaml").read_text()) == EXAMPLE_PRICES
    table = load_prices(None)
    assert table.gpu_price("NVIDIA H200").per_gpu_hour == 4.10
    assert table.gpu_price("Acme X1").source == "default"


def test_chargeback_defaults_and_env() -> None:
    parser = build_parser()
    args = parser.parse_args(["chargeback"])
    assert (args.window, args.grace, args.commit_interval) == (3_600_000, 300_000, 1000)
    assert args.group_id is None and args.instance_id is None and args.static_membership
    assert args.start == "earliest" and args.max_clock_skew == 60_000 and args.prices is None
    args = parser.parse_args(["chargeback", "--window", "10m", "--grace", "0", "--max-clock-skew", "off"])
    assert (args.window, args.grace, args.max_clock_skew) == (600_000, 0, None)
    parser = build_parser()
    apply_env_defaults(parser, {"GPUPIPE_WINDOW": "15m", "GPUPIPE_INSTANCE_ID": "cb-0"})
    args = parser.parse_args(["chargeback"])
    assert args.window == 900_000 and args.instance_id == "cb-0"


def test_every_kafka_identity_carries_the_topic_prefix() -> None:
    """Environments sharing a cluster must never share a group or transactional id."""
    from gpupipe_consumers.chargeback.command import build_service

    args = build_parser().parse_args(
        ["chargeback", *NOWHERE, "--topic-prefix", "staging.", "--instance-id", "cb-0"]
    )
    svc = build_service(args, {})
    assert svc.cfg.group_id == "staging.gpupipe-chargeback"
    assert svc.cfg.transactional_id == "staging.gpupipe-chargeback.cb-0"
    args = build_parser().parse_args(
        ["chargeback", *NOWHERE, "--group-id", "g", "--transactional-id", "tx-1", "--instance-id", "cb-0"]
    )
    svc = build_service(args, {})
    assert (svc.cfg.group_id, svc.cfg.transactional_id) == ("g", "tx-1")


@pytest.mark.parametrize("bad", [["--window", "0"], ["--grace", "-1m"], ["--commit-records", "0"]])
def test_chargeback_rejects_bad_flags(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["chargeback", *bad])
    assert e.value.code == 2


def test_report_flags() -> None:
    args = build_parser().parse_args(
        ["report", "chargeback", "--from", "2026-11-01", "--to", "2026-12-01", "--by", "team,node"]
    )
    assert (args.start, args.end, args.by, args.format) == (
        "2026-11-01",
        "2026-12-01",
        ("team", "node"),
        "table",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "chargeback", "--by", "pod"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["report", "chargeback", "--format", "xml"])


@pytest.mark.parametrize("window", ["7d", "7h", "25m", "2d"])
def test_a_window_that_does_not_divide_a_day_is_refused_at_start(
    window: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Epoch-aligned windows that do not divide a day straddle month ends (a 7-day window from 29
    October to 5 November): their usage cannot be billed to either month whole, so they are refused
    with one line before anything is consumed."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["chargeback", "--window", window])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must divide a day" in err[0]


@pytest.mark.parametrize(
    ("window", "ms"), [("1m", 60_000), ("90m", 5_400_000), ("6h", 21_600_000), ("1d", 86_400_000)]
)
def test_windows_that_divide_a_day_are_accepted(window: str, ms: int) -> None:
    assert build_parser().parse_args(["chargeback", "--window", window]).window == ms
