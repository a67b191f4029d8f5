"""The FOCUS export knows whether a billing period is closed: an invoice cut before chargeback
wrote past the month's end plus the invoice lag is refused (one line, exit 2) or, with
``--provisional``, marked so; every record is then in exactly one final export. Billing periods
and day/month periods follow ``--timezone``. The CLI runs with the topic reader stubbed."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from gpupipe.commands import cli
from gpupipe.domain.prices import PriceTable
from gpupipe_consumers.chargeback.records import WINDOW, GpuTimeAggregate, to_record
from gpupipe_consumers.chargeback.windows import record_id
from gpupipe_consumers.report import command
from gpupipe_consumers.report.chargeback_report import build_report

H = 3_600_000
PRICES = PriceTable(exact={"nvidia h200": 4.0})


def ms(*a: int, tz=UTC) -> int:
    return int(datetime(*a, tzinfo=tz).timestamp() * 1000)


def rec(ws: int, window_ms: int = H) -> dict:
    agg = GpuTimeAggregate()
    agg.allocated_s, agg.samples = window_ms / 1000.0, 1
    key = (ws, "ml", "n1", "NVIDIA H200")
    r = to_record(
        key,
        agg,
        kind=WINDOW,
        window_ms=window_ms,
        prices=PRICES,
        partition=0,
        instance_id="t",
        emitted_at_ms=ws + window_ms + 300_000,
    )
    r["record_id"] = record_id(WINDOW, 0, key, "0")
    return r


# The last two windows of October, each written 5 minutes after it ends (the grace period).
OCT_22, OCT_23 = ms(2026, 10, 31, 22), ms(2026, 10, 31, 23)
WRITTEN = [(rec(OCT_22), OCT_22 + H + 300_000), (rec(OCT_23), OCT_23 + H + 300_000)]


def report(monkeypatch, capsys, topic: list[tuple[dict, int]], *args: str) -> tuple[int, str, str]:
    def records(*_a, **_k) -> Iterator[tuple[dict, int]]:
        yield from ((dict(r), ts) for r, ts in topic)

    monkeypatch.setattr(command, "wait_for_broker", lambda *a, **k: None)
    monkeypatch.setattr(command, "codec_from_url", lambda *a, **k: None)
    monkeypatch.setattr(command, "iter_chargeback_records", records)
    rc = cli.main(["report", "chargeback", "--bootstrap-servers", "127.0.0.1:9", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def gpu_lines(out: str) -> list[dict[str, str]]:
    return [ln for ln in csv.DictReader(io.StringIO(out)) if ln["ConsumedUnit"] == "GPU-Hours"]


OCTOBER = ("--format", "focus", "--from", "2026-10-01", "--to", "2026-11-01")
NOVEMBER = ("--format", "focus", "--from", "2026-11-01", "--to", "2026-12-01")


def test_an_invoice_cut_before_the_month_is_closed_is_refused(monkeypatch, capsys) -> None:
    """The invoice job at 00:01 on 1 November saw only the 22:00 window; the 23:00 one, written at
    00:05, was in no final export: October's was cut without it, and November's bills it to October."""
    early = [w for w in WRITTEN if w[1] < ms(2026, 11, 1, 0, 1)]
    rc, out, err = report(monkeypatch, capsys, early, *OCTOBER)
    assert rc == 2 and out == ""
    assert (
        len(err.strip().splitlines()) == 1
        and "2026-10-01T00:00:00Z to 2026-11-01T00:00:00Z is not closed" in err
    )

    rc, out, err = report(monkeypatch, capsys, early, *OCTOBER, "--provisional")
    assert rc == 0 and "provisional export" in err
    lines = gpu_lines(out)
    assert [ln["ChargePeriodStart"] for ln in lines] == ["2026-10-31T22:00:00Z"]
    assert {ln["x_Provisional"] for ln in lines} == {"true"}

    # Once chargeback wrote past 2 November (the lag) plus the margin, October is final, whole.
    later = [*WRITTEN, (rec(ms(2026, 11, 2, 1)), ms(2026, 11, 2, 2, 5))]
    rc, out, err = report(monkeypatch, capsys, later, *OCTOBER)
    assert rc == 0, err
    lines = gpu_lines(out)
    assert [(ln["ChargePeriodStart"], ln["ChargeClass"]) for ln in lines] == [
        ("2026-10-31T22:00:00Z", ""),
        ("2026-10-31T23:00:00Z", ""),
    ]
    assert "x_Provisional" not in out.splitlines()[0]
    rc, out, err = report(monkeypatch, capsys, later, *NOVEMBER, "--provisional")
    assert all(ln["ChargePeriodStart"] >= "2026-11-01" for ln in gpu_lines(out))  # never billed twice


def test_billing_periods_in_a_time_zone(monkeypatch, capsys) -> None:
    """With --timezone Europe/Berlin, October runs from 30 September 22:00Z to 31 October 23:00Z
    (summer time ends on 25 October), and --from/--to without a zone are Berlin dates."""
    berlin = ZoneInfo("Europe/Berlin")
    windows = [ms(2026, 9, 30, 22), ms(2026, 10, 31, 22), ms(2026, 10, 31, 23)]
    topic = [(rec(ws), ws + H + 300_000) for ws in windows] + [(rec(ms(2026, 11, 5)), ms(2026, 11, 5, 1))]
    rc, out, err = report(monkeypatch, capsys, topic, *OCTOBER, "--timezone", "Europe/Berlin")
    assert rc == 0, err
    lines = gpu_lines(out)
    assert {(ln["BillingPeriodStart"], ln["BillingPeriodEnd"]) for ln in lines} == {
        ("2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z")
    }
    assert [ln["ChargePeriodStart"] for ln in lines] == ["2026-09-30T22:00:00Z", "2026-10-31T22:00:00Z"]
    rows = build_report([rec(w) for w in windows], period="day", tz=berlin)
    assert [(r.window_start_ms, r.window_end_ms) for r in rows] == [
        (ms(2026, 10, 1, tz=berlin), ms(2026, 10, 2, tz=berlin)),
        (ms(2026, 10, 31, tz=berlin), ms(2026, 11, 1, tz=berlin)),
        (ms(2026, 11, 1, tz=berlin), ms(2026, 11, 2, tz=berlin)),
    ]
    with pytest.raises(SystemExit) as e:
        report(monkeypatch, capsys, topic, "--timezone", "Mars/Olympus")
    assert e.value.code == 2 and "IANA time zone" in capsys.readouterr().err


def test_a_window_crossing_a_day_of_the_zone_is_refused(monkeypatch, capsys) -> None:
    """At UTC+05:30 an hourly window of 18:00Z is 23:30 to 00:30: in neither day whole."""
    topic = [(rec(ms(2026, 10, 10, 18)), ms(2026, 10, 10, 19, 5))]
    rc, out, err = report(monkeypatch, capsys, topic, "--period", "day", "--timezone", "Asia/Kolkata")
    assert rc == 2 and out == "" and "crosses a period boundary in Asia/Kolkata" in err
    rc, out, err = report(monkeypatch, capsys, topic, "--period", "day")
    assert rc == 0, err


def test_a_focus_export_refuses_a_window_across_the_zones_month_end(monkeypatch, capsys) -> None:
    """At UTC+05:30 the hourly window of 31 October 18:00Z is 23:30 to 00:30: half October's, half
    November's. The export is refused rather than billing it whole to either month."""
    topic = [
        (rec(ms(2026, 10, 31, 18)), ms(2026, 10, 31, 19, 5)),
        (rec(ms(2026, 11, 5)), ms(2026, 11, 5, 1, 5)),  # October is closed
    ]
    for month in (OCTOBER, NOVEMBER):
        rc, out, err = report(monkeypatch, capsys, topic, *month, "--timezone", "Asia/Kolkata")
        assert rc == 2 and out == "" and "crosses a period boundary in Asia/Kolkata" in err


def test_a_window_across_a_utc_month_end_is_refused_not_billed_as_a_correction(monkeypatch, capsys) -> None:
    """A 7-day window from 29 October (chargeback refuses --window 7d now; 0.1.0 wrote such records
    and the topic keeps 400 days): October's export left its 168 GPU-hours out and November's
    billed them all as a Correction whose charge period spans both months; the monthly table put
    them all in October."""
    week = 7 * 24 * H
    topic = [
        (rec(ms(2026, 10, 29), week), ms(2026, 11, 5, 0, 5)),
        (rec(ms(2026, 12, 5)), ms(2026, 12, 5, 1, 5)),  # October and November are closed
    ]
    for args in (OCTOBER, NOVEMBER, ("--period", "month"), ("--period", "day")):
        rc, out, err = report(monkeypatch, capsys, topic, *args)
        assert rc == 2 and out == "", (args, out[-300:])
        assert "the window 2026-10-29T00:00Z to 2026-11-05T00:00Z crosses a period boundary" in err, err
    rc, out, err = report(monkeypatch, capsys, topic, "--period", "all")
    assert rc == 0, err
