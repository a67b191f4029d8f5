"""Tests for gpupipe_producer.xid.kmsg_reader: record decoding (pure), the kmsg read loop with a fake device,
files (plain and followed), pipes/FIFOs, and stop()."""

from __future__ import annotations

import errno
import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupipe_producer.xid.kmsg_parse import FallenOffBus, KernelXid, KmsgParser
from gpupipe_producer.xid.kmsg_reader import (
    KmsgReader,
    KmsgReaderStats,
    KmsgRecord,
    decode_kmsg_record,
    iter_kmsg_records,
    kmsg_record_lines,
    kmsg_records_to_lines,
)
from tests.paths import TESTS

FIXTURES = TESTS / "fixtures" / "kmsg"
XID_94 = (
    "NVRM: Xid (PCI:0000:00:08): 94, pid='<unknown>', name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No"
)


def _collect(reader: KmsgReader, timeout_s: float = 5.0) -> list[str]:
    """Run the reader in a thread; return its lines (the test fails if it does not end in time)."""
    out: list[str] = []
    t = threading.Thread(target=lambda: out.extend(reader), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "reader did not finish"
    return out


class _Background:
    """Iterate a reader in a thread, collecting lines, so a test can write and then stop it."""

    def __init__(self, reader: KmsgReader) -> None:
        self.reader = reader
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for line in self.reader:
                self.lines.append(line)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def wait_for(self, pred, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred(self.lines):
                return
            time.sleep(0.01)
        raise AssertionError(f"condition not met; lines={self.lines!r}")

    def stop(self) -> float:
        t0 = time.monotonic()
        self.reader.stop()
        self.thread.join(2)
        took = time.monotonic() - t0
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return took


# ------------------------------------------------------------------------------ record decoding


def test_decode_record_from_gpud_testdata() -> None:
    # first record of leptonai/gpud pkg/kmsg/testdata/kmsg.1.log
    rec = decode_kmsg_record(b"6,3964,206764307,-;nvidia-nvswitch2: open (major=510)\n")
    assert rec == KmsgRecord(
        priority=6, seq=3964, ts_usec=206764307, flags="-", message="nvidia-nvswitch2: open (major=510)"
    )
    assert (rec.facility, rec.level, rec.time_s) == (0, 6, 206.764307)


def test_decode_record_with_dictionary_escapes_and_caller() -> None:
    data = (
        b"3,881,1843308145,-,caller=T512;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: fallen off the bus"
        b" caf\\xc3\\xa9 \\x5c\n SUBSYSTEM=pci\n DEVICE=+pci:0000:b3:00.0\n"
    )
    rec = decode_kmsg_record(data)
    assert rec is not None
    assert rec.flags == "-"
    assert rec.message == "NVRM: The NVIDIA GPU 0000:b3:00.0\nNVRM: fallen off the bus caf\u00e9 \\"
    assert rec.fields == (("SUBSYSTEM", "pci"), ("DEVICE", "+pci:0000:b3:00.0"))
    assert (rec.facility, rec.level) == (0, 3)


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"6,1,2;no flags field", b"x,1,2,-;bad prio", b";", b"\xff\xfe\xfd", "6,1;x"],
)
def test_decode_malformed_records(data: bytes | str) -> None:
    assert decode_kmsg_record(data) is None


def test_decode_invalid_utf8_and_str_input() -> None:
    rec = decode_kmsg_record(b"4,5,6,c;caf\xff\n")
    assert rec is not None and rec.message == "caf\ufffd" and rec.flags == "c"
    assert decode_kmsg_record("12,1,0,-;user space line") == KmsgRecord(12, 1, 0, "-", "user space line")


def test_record_lines_like_dmesg() -> None:
    rec = KmsgRecord(4, 1, 5678901, "-", "first\nsecond\n")
    assert kmsg_record_lines(rec) == ["[    5.678901] first", "               second"]
    big = KmsgRecord(4, 1, 6781741548779, "-", XID_94)
    assert kmsg_record_lines(big) == ["[6781741.548779] " + XID_94]
    assert kmsg_record_lines(rec, continues_previous=True) == ["  first", "  second"]


def test_fragment_flags_become_continuations() -> None:
    recs = [
        KmsgRecord(4, 1, 1_000_000, "-", "[normal]"),
        KmsgRecord(
            4, 2, 2_000_000, "c", "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, Graphics Exception:"
        ),
        KmsgRecord(4, 3, 2_000_001, "c", "ESR 0x1=0x2"),
        KmsgRecord(4, 4, 2_000_002, "+", "more"),
        None,
        KmsgRecord(4, 5, 3_000_000, "-", "next"),
    ]
    lines = list(kmsg_records_to_lines(recs))
    assert lines == [
        "[    1.000000] [normal]",
        "[    2.000000] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, Graphics Exception:",
        "  ESR 0x1=0x2",
        "  more",
        "",
        "[    3.000000] next",
    ]
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert len(events) == 1 and isinstance(events[0], KernelXid)
    assert events[0].message == "Graphics Exception: ESR 0x1=0x2 more"
    assert events[0].kernel_time_s == 2.0


# ------------------------------------------------------------------------------ kmsg loop, fake device


def _fake_read(script: list[bytes | BaseException]):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def read(n: int) -> bytes:
        calls.append(n)
        item = script.pop(0) if script else BlockingIOError()
        if isinstance(item, BaseException):
            raise item
        return item

    return read, calls


def test_kmsg_loop_epipe_is_counted_and_skipped() -> None:
    read, _ = _fake_read(
        [
            b"6,10,1000,-;one\n",
            BrokenPipeError(errno.EPIPE, "overwritten"),
            b"6,42,2000,-;two\n",
            InterruptedError(),
            b"bogus\n",
            b"6,43,3000,-;three\n SUBSYSTEM=x\n",
        ]
    )
    stats = KmsgReaderStats()
    recs = list(iter_kmsg_records(read, lambda: True, follow=False, stats=stats))
    assert [r.message for r in recs if r] == ["one", "two", "three"]
    assert (stats.overrun, stats.malformed, stats.records) == (1, 1, 3)


def test_kmsg_loop_grows_buffer_on_einval() -> None:
    read, calls = _fake_read([OSError(errno.EINVAL, "too small"), b"6,1,1,-;x\n"])
    recs = list(iter_kmsg_records(read, lambda: True, follow=False, stats=KmsgReaderStats()))
    assert len(recs) == 1
    assert calls[1] == calls[0] * 4


def test_kmsg_loop_other_errors_propagate() -> None:
    read, _ = _fake_read([PermissionError(errno.EPERM, "no")])
    with pytest.raises(PermissionError):
        list(iter_kmsg_records(read, lambda: True, follow=False, stats=KmsgReaderStats()))


def test_kmsg_loop_follow_idles_then_stops() -> None:
    # wait(): True data is there, None an idle timeout, False stopped. An idle tick only after a
    # timeout: never between a wait that found a record and that record (it may continue an Xid).
    read, _ = _fake_read([b"6,1,1,-;x\n", BlockingIOError(), BlockingIOError(), b"6,2,2,-;y\n"])
    waits = iter([None, True, None, False])
    recs = list(iter_kmsg_records(read, lambda: next(waits), follow=True, stats=KmsgReaderStats(), idle=True))
    assert [r.message if r else None for r in recs] == ["x", None, "y", None]


def test_real_dev_kmsg_backlog_if_readable() -> None:
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    try:
        reader = KmsgReader("/dev/kmsg", follow=False, from_start=True)
        assert reader.mode() == "kmsg"
        lines = _collect(reader, timeout_s=20)
    except PermissionError:
        pytest.skip("/dev/kmsg not readable here")
    assert lines, "the kernel ring buffer is never empty after boot"
    assert all(line.startswith("[") or line.startswith(" ") for line in lines)
    assert reader.stats.records >= 1


def test_real_dev_kmsg_follow_stops_quickly() -> None:
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg not readable here")
    try:
        bg = _Background(KmsgReader("/dev/kmsg", follow=True, from_start=False, idle_ticks=True))
        bg.wait_for(lambda lines: "" in lines)  # idle tick: nothing new, reader is waiting
    except PermissionError:
        pytest.skip("/dev/kmsg not readable here")
    assert bg.stop() < 0.5


# ------------------------------------------------------------------------------ files


def test_file_read_once(tmp_path: Path) -> None:
    p = tmp_path / "kern.log"
    p.write_bytes(b"line one\r\nline \xff two\n" + b"x" * 100 + b"\nlast without newline")
    reader = KmsgReader(str(p), follow=False, max_line_bytes=50)
    assert reader.mode() == "file"
    lines = _collect(reader)
    assert lines == ["line one", "line \ufffd two", "x" * 50, "last without newline"]
    assert reader.stats.truncated == 1
    assert reader.stats.lines == 4


def test_file_fixture_through_parser(tmp_path: Path) -> None:
    p = tmp_path / "dmesg.txt"
    p.write_text(
        (FIXTURES / "fallen_off_bus_real.txt").read_text() + (FIXTURES / "xid_real.txt").read_text(),
        encoding="utf-8",
    )
    parser = KmsgParser()
    events = [ev for line in _collect(KmsgReader(str(p), follow=False)) for ev in parser.feed(line)]
    events += parser.flush()
    assert isinstance(events[0], FallenOffBus) and events[0].pci_bus_id == "0000:b3:00.0"
    assert sum(isinstance(e, KernelXid) for e in events) == 54


def test_file_follow_starts_at_end_and_sees_appends(tmp_path: Path) -> None:
    p = tmp_path / "kern.log"
    p.write_text("old line\n")
    bg = _Background(KmsgReader(str(p), follow=True, poll_interval_s=0.02))
    time.sleep(0.1)
    with p.open("a") as f:
        f.write("new line\npart")
        f.flush()
        time.sleep(0.1)
        f.write("ial\n")
    bg.wait_for(lambda lines: "partial" in lines)
    assert bg.stop() < 0.5
    assert bg.lines == ["new line", "partial"]


def test_file_follow_from_start_and_rotation(tmp_path: Path) -> None:
    p = tmp_path / "kern.log"
    p.write_text("first\n")
    reader = KmsgReader(str(p), follow=True, from_start=True, poll_interval_s=0.02)
    bg = _Background(reader)
    bg.wait_for(lambda lines: "first" in lines)
    rotated = tmp_path / "kern.log.1"
    p.rename(rotated)
    p.write_text("after rotation\n")
    bg.wait_for(lambda lines: "after rotation" in lines)
    p.write_text("")  # truncated in place
    time.sleep(0.1)
    p.write_text("after truncation\n")
    bg.wait_for(lambda lines: "after truncation" in lines)
    bg.stop()
    assert reader.stats.reopened >= 2


def test_file_follow_idle_ticks_and_stop_within_half_a_second(tmp_path: Path) -> None:
    p = tmp_path / "quiet.log"
    p.write_text("")
    bg = _Background(KmsgReader(str(p), follow=True, idle_ticks=True))
    bg.wait_for(lambda lines: lines.count("") >= 2)
    assert bg.stop() < 0.5


# ------------------------------------------------------------------------------ pipes / FIFOs / stdin


def test_pipe_stream_until_eof() -> None:
    r, w = os.pipe()
    reader = KmsgReader("-", follow=False, stream=os.fdopen(r, "rb"))
    assert reader.mode() == "stream"
    bg = _Background(reader)
    with os.fdopen(w, "wb") as f:
        f.write(b"[    1.000000] hello\n")
        f.flush()
        bg.wait_for(lambda lines: "[    1.000000] hello" in lines)
        f.write(("[    2.000000] " + XID_94 + "\n").encode())
    bg.thread.join(2)
    assert not bg.thread.is_alive()
    assert bg.lines == ["[    1.000000] hello", "[    2.000000] " + XID_94]


def test_pipe_idle_ticks_and_stop_while_writer_is_silent() -> None:
    r, w = os.pipe()
    try:
        bg = _Background(KmsgReader("-", follow=True, stream=os.fdopen(r, "rb"), idle_ticks=True))
        os.write(w, b"only line\n")
        bg.wait_for(lambda lines: "only line" in lines and "" in lines)
        assert bg.stop() < 0.5
    finally:
        os.close(w)


def test_named_fifo_writer_opens_later(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    reader = KmsgReader(str(fifo), follow=False, poll_interval_s=0.02)
    assert reader.mode() == "stream"
    bg = _Background(reader)
    time.sleep(0.1)  # reader is waiting; no writer yet, must not see EOF
    assert bg.thread.is_alive()
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"a\nb\n")
    os.close(fd)
    bg.thread.join(2)
    assert not bg.thread.is_alive()
    assert bg.lines == ["a", "b"]


def test_stream_without_file_descriptor() -> None:
    data = io.BytesIO(b"one\n" + b"z" * 30 + b"\ntwo\xff\nthree")
    reader = KmsgReader("-", follow=False, stream=data, max_line_bytes=10)
    assert _collect(reader) == ["one", "z" * 10, "two\ufffd", "three"]
    assert reader.stats.truncated == 1


def test_shared_stop_event_and_validation(tmp_path: Path) -> None:
    ev = threading.Event()
    p = tmp_path / "f.log"
    p.write_text("x\n")
    reader = KmsgReader(str(p), follow=True, stop_event=ev)
    ev.set()
    assert reader.stopped
    assert _collect(reader) == []
    with pytest.raises(ValueError):
        KmsgReader(str(p), poll_interval_s=0)
    with pytest.raises(ValueError):
        KmsgReader(str(p), max_line_bytes=0)


def test_reader_is_an_iterator_of_str(tmp_path: Path) -> None:
    p = tmp_path / "f.log"
    p.write_text("a\n")
    it: Iterator[str] = iter(KmsgReader(str(p), follow=False))
    assert next(it) == "a"
    with pytest.raises(StopIteration):
        next(it)


def test_relayed_records_after_the_cursor_and_a_relay_restart_are_yielded_once(tmp_path: Path) -> None:
    # The DaemonSet's kmsg-relay sidecar re-sends the kernel's whole backlog whenever it restarts;
    # the persisted cursor (after_seq) and the newest seq seen skip what was handled.
    def rec(seq: int, text: str) -> str:
        return f"3,{seq},{1_000_000 + seq},-;{text}\n"

    f = tmp_path / "relay"
    backlog = rec(5, "old") + rec(6, "handled before the restart") + rec(7, "new after the cursor")
    f.write_text(backlog + " SUBSYSTEM=pci\n" + backlog + rec(8, "newest") + "plain text line\n")
    r = KmsgReader(str(f), follow=False, from_start=True, after_seq=6)
    lines = list(r)
    assert [ln.split("] ", 1)[1] for ln in lines[:2]] == ["new after the cursor", "newest"]
    assert lines[2] == "plain text line"
    assert r.last_seq == 8 and r.stats.skipped == 5  # 5, 6, then 5, 6, 7 again


def test_only_the_kernel_facility_speaks_for_the_driver(tmp_path: Path) -> None:
    # Raw /dev/kmsg records as the relay passes them: root or a privileged container may write to
    # /dev/kmsg, but the kernel never gives a userspace write facility 0 (kern).
    xid = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    load = "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024"
    p = tmp_path / "relay.log"
    p.write_text(
        f"3,1,100,-;{xid}\n"  # kern.err: the driver's own line
        f"14,2,200,-;{xid}\n"  # user.info: echo ... > /dev/kmsg
        f"12,3,300,-;myapp: NVRM: Xid (PCI:0000:3c:00): 48, pid=1, name=x, DBE\n"  # user.warn
        f"30,4,400,-;{load}\n"  # daemon.info: forged recovery evidence
    )
    reader = KmsgReader(str(p), follow=False)
    parser = KmsgParser(driver_loads=True)
    events = [ev for line in _collect(reader) for ev in parser.feed(line)] + parser.flush()
    assert [(type(e).__name__, getattr(e, "xid", None)) for e in events] == [("KernelXid", 79)]
    assert reader.stats.not_kernel == 3
