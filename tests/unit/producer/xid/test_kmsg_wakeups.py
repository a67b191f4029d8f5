"""The kernel-log reader costs nothing while the log is quiet.

Wake-ups are counted the way the kernel counts them: the reader thread's voluntary context switches
(``/proc/self/task/<tid>/status``), one per return from a blocking wait, whatever the code does.
The input is a FIFO, what the shipped DaemonSet's kmsg relay feeds the agent (``/dev/kmsg`` goes
through the same wait).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.xid.kmsg_input import KmsgInput
from gpupipe_producer.xid.kmsg_reader import KmsgReader
from gpupipe_producer.xid.wake import WakeEvent

XID_79 = "NVRM: Xid (PCI:0000:91:00): 79, pid=1234, name=python, GPU has fallen off the bus."
IDLE_S = 1.0


def _switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as fh:
        for line in fh:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def _wait(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def _idle_wakeups(thread: threading.Thread, seconds: float) -> int:
    """The thread's wake-ups over ``seconds`` of an idle input (time passing is the test)."""
    assert thread.native_id is not None
    before = _switches(thread.native_id)
    time.sleep(seconds)
    return _switches(thread.native_id) - before


@pytest.fixture
def fifo(tmp_path: Path) -> Any:
    path = tmp_path / "kmsg.fifo"
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # the relay: a writer that stays
    yield path, writer
    os.close(writer)


def test_an_idle_kernel_log_does_not_wake_the_reader(fifo: Any) -> None:
    path, writer = fifo
    stop = WakeEvent()
    reader = KmsgReader(str(path), follow=True, idle_ticks=True, stop_event=stop)
    reader.tick_needed = lambda: False  # no Xid held: no idle tick wanted
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(reader), daemon=True)
    t.start()
    try:
        os.write(writer, b"[    1.000000] positioned\n")
        _wait(lambda: "[    1.000000] positioned" in lines)
        woke = _idle_wakeups(t, IDLE_S)
        assert woke <= 2, f"{woke} wake-ups in {IDLE_S}s of silence (was 10 per second)"
        t0 = time.monotonic()
        stop.set()  # from another thread: wakes the blocked reader at once
        t.join(2)
        assert not t.is_alive() and time.monotonic() - t0 < 0.5
    finally:
        stop.set()
        t.join(2)


def test_a_relay_restart_is_waited_for_without_polling(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.fifo"
    os.mkfifo(path)  # no writer but the relay's, which comes and goes
    reader = KmsgReader(str(path), follow=True)
    lines: list[str] = []
    t = threading.Thread(target=lambda: lines.extend(reader), daemon=True)
    t.start()
    try:
        _wait(lambda: reader.waiting)
        other = os.open(path, os.O_WRONLY)  # a relay instance that writes and goes away
        os.write(other, b"first\n")
        os.close(other)
        _wait(lambda: lines == ["first"])
        assert _idle_wakeups(t, 0.5) <= 2  # no end of file, no polling while no relay runs
        again = os.open(path, os.O_WRONLY)  # the restarted relay
        os.write(again, b"second\n")
        os.close(again)
        _wait(lambda: lines == ["first", "second"])
        assert reader.stats.wakeups <= 4
    finally:
        reader.stop()
        t.join(2)
    assert not t.is_alive()


def test_a_held_xid_is_flushed_by_a_tick_then_the_reader_sleeps_again(fifo: Any) -> None:
    # The parser holds an Xid for continuation lines; a timeout is armed only while it does.
    path, writer = fifo
    got: queue.Queue[tuple[Any, ...]] = queue.Queue()
    stop = WakeEvent()
    kin = KmsgInput(str(path), got.put, stop, retry_s=0.05)
    t = threading.Thread(target=kin.run, daemon=True)
    t.start()
    try:
        _wait(lambda: kin.reader is not None and kin.reader.waiting)
        os.write(writer, f"3,42,5000000,-;{XID_79}\n".encode())
        kind, _, _, ev, seq = got.get(timeout=2)  # flushed by the idle tick, no further line needed
        assert (kind, ev.xid, seq) == ("kmsg", 79, 42)
        _wait(lambda: kin.reader is not None and kin.reader.waiting)
        assert _idle_wakeups(t, IDLE_S) <= 2
        assert kin.stalled_for(time.monotonic()) == 0.0  # waiting: idle, not stuck
    finally:
        stop.set()
        t.join(2)
    assert not t.is_alive()


def test_an_agent_on_a_quiet_kernel_log_stays_healthy(tmp_path: Path, fifo: Any) -> None:
    # The reader blocks without a timeout now: /healthz must tell "idle" (waiting) from "stuck".
    from tests.agent_harness import running_agent
    from tests.fake_nvml import FakeNvml
    from tests.unit.producer.agent.test_node_agent import config, memory_publisher

    path, _ = fifo
    pub, _mem = memory_publisher()
    cfg = config(tmp_path, kmsg_path=str(path), stall_after_s=0.3, kmsg_retry_s=0.05)
    with running_agent(cfg, pub, FakeNvml.node("H100", 1)) as ra:
        ra.ticks_after(10)  # about 1 s of kernel-log silence, three times the stall limit
        ok, detail = ra.agent.health()
        assert ok, detail
        assert ra.agent.kmsg_input is not None and ra.agent.kmsg_input.reader is not None
        assert ra.agent.kmsg_input.reader.stats.wakeups <= 3
        ra.stop()
