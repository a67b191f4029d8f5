"""The agent's kernel-log input thread (producer/xid/kmsg_input.py) on its own."""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.xid import kmsg_input
from gpupipe_producer.xid.kmsg_input import KmsgInput
from gpupipe_producer.xid.kmsg_reader import KmsgReader
from gpupipe_producer.xid.wake import WakeEvent

XID_79 = "NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def test_after_a_failed_open_the_retry_reads_the_backlog_not_from_the_end(tmp_path: Path) -> None:
    # Review §2 node_agent.py:653: after a read error the 10 s retry reopened at the end, losing
    # what the kernel logged meanwhile. It reads the backlog after the cursor instead.
    path = tmp_path / "kmsg"
    got: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stop = WakeEvent()
    kin = KmsgInput(str(path), got.put, stop, after_seq=10, retry_s=0.05)
    t = threading.Thread(target=kin.run, daemon=True)
    t.start()
    try:
        deadline_errors = 0
        while kin.errors["ENOENT"] < 1 and deadline_errors < 500:
            stop.wait(0.01)
            deadline_errors += 1
        assert kin.errors["ENOENT"] >= 1 and not kin.ready.is_set()
        # Meanwhile the kernel logged records 10 (handled before: the cursor) and 11 (new).
        path.write_text(f"3,10,1000000,-;{XID_79}\n3,11,1100000,-;{XID_79.replace('79', '48', 1)}\n")
        kind, _, _, ev, seq = got.get(timeout=5)
        assert (kind, ev.xid, seq) == ("kmsg", 48, 11)
        assert got.empty() and kin.ready.wait(5)
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()


def test_a_read_error_while_an_xid_is_held_for_continuation_lines_loses_it_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review finding 3: the parser held Xid 79 (record 10) for continuation lines, the next read
    # failed, _read() left by the exception without flushing the parser, and run() moved the
    # cursor past record 10: the rebuilt reader skipped it, so Xid 79 was lost for good.
    path = tmp_path / "kmsg"
    path.write_text(f"3,10,1000000,-;{XID_79}\n3,11,1100000,-;{XID_79.replace('79', '48', 1)}\n")
    failed: list[int] = []

    class FailsOnceAfterRecord10(KmsgReader):
        """The real reader; its first read after record 10 fails with EIO (a flaky device)."""

        def __iter__(self) -> Iterator[str]:
            for line in super().__iter__():
                yield line
                if self.line_seq == 10 and not failed:
                    failed.append(10)
                    raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(kmsg_input, "KmsgReader", FailsOnceAfterRecord10)
    got: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stop = WakeEvent()
    kin = KmsgInput(str(path), got.put, stop, retry_s=0.01)
    t = threading.Thread(target=kin.run, daemon=True)
    t.start()
    try:
        seen = [got.get(timeout=5), got.get(timeout=5)]
        assert [(ev.xid, seq) for _, _, _, ev, seq in seen] == [(79, 10), (48, 11)]
        assert kin.errors["EIO"] == 1
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive() and got.empty()
