"""The NVIDIA driver's load line in the kernel log: the recovery evidence the node agent publishes.

Real lines only (``tests/fixtures/kmsg/driver_load_real.txt``, ``fallen_off_bus_real.txt`` and
``non_xid_real.txt``, sources named there).
"""

from __future__ import annotations

from gpupipe_producer.xid.kmsg_parse import (
    DriverLoaded,
    FallenOffBus,
    KmsgParser,
    parse_driver_load,
    parse_line,
)
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "kmsg"


def _lines(name: str) -> list[str]:
    text = (FIXTURES / name).read_text(encoding="utf-8")
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


# (driver_version, kernel_time_s, wall_time, text) of each line of driver_load_real.txt, in order
EXPECTED = [
    (
        "535.183.01",
        None,
        "Sun Jul 28 09:15:27 2024",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024",
    ),
    (
        "570.158.01",
        1843.439669,
        None,
        "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  "
        "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025",
    ),
    (
        "610.57.04",
        None,
        "sep 03 13:25:15",
        "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  610.57.04  Release Build  (notroot@)  "
        "Fri Aug 28 12:12:04 UTC 2026",
    ),
    (
        "346.47",
        None,
        "May 15 19:23:08",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  346.47  Thu Feb 19 18:56:03 PST 2015",
    ),
]


def test_every_real_driver_load_line_parses():
    lines = _lines("driver_load_real.txt")
    assert len(lines) == len(EXPECTED)
    for line, (version, kt, wall, text) in zip(lines, EXPECTED, strict=True):
        ev = parse_driver_load(line)
        assert ev == DriverLoaded(
            driver_version=version, text=text, kernel_time_s=kt, wall_time=wall, raw=line
        ), line
        assert parse_line(line) is None  # not an Xid: `gpupipe xid parse` keeps reporting Xids only


def test_the_streaming_parser_reports_them_only_when_asked():
    lines = _lines("driver_load_real.txt")
    on, off = KmsgParser(driver_loads=True), KmsgParser()
    got = [ev for ln in lines for ev in on.feed(ln)] + on.flush()
    assert [ev.driver_version for ev in got if isinstance(ev, DriverLoaded)] == [e[0] for e in EXPECTED]
    assert len(got) == len(lines)
    assert [ev for ln in lines for ev in off.feed(ln)] + off.flush() == []


def test_kmsg_record_form_keeps_the_kernel_time():
    record = (
        "6,1512,1843439669,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release"
    )
    ev = parse_driver_load(record)
    assert ev is not None and ev.driver_version == "570.158.01" and ev.kernel_time_s == 1843.439669


def test_gpu_fell_off_the_bus_then_the_driver_loaded_again():
    """NVSentinel#155: the report, the failed probe, the load line: both events, in order."""
    parser = KmsgParser(driver_loads=True)
    lines = _lines("fallen_off_bus_real.txt")
    got = [ev for ln in lines for ev in parser.feed(ln)] + parser.flush()
    assert [type(ev) for ev in got] == [FallenOffBus, DriverLoaded]
    assert got[0].pci_bus_id == "0000:b3:00.0" and got[1].driver_version == "570.158.01"


def test_other_real_non_xid_lines_stay_silent():
    """Of the real non-Xid lines only the three driver load lines are reported."""
    parser = KmsgParser(driver_loads=True)
    got = [ev for ln in _lines("non_xid_real.txt") for ev in parser.feed(ln)] + parser.flush()
    assert [ev.driver_version for ev in got] == ["535.183.01", "610.57.04", "570.158.01"]
    assert all(isinstance(ev, DriverLoaded) for ev in got)


def test_lookalikes_are_not_driver_loads():
    for line in (
        "NVRM: loading NVIDIA UNIX",  # truncated
        "nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  535.183.01",
        # /proc/driver/nvidia/version, not the kernel log
        "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.173.02  Release Build",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module",  # no version
    ):
        assert parse_driver_load(line) is None, line
