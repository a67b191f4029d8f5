"""/healthz of the node agent when its XID loop or its kernel-log reader stops making progress.

``NodeAgent.health()`` names ``xid_loop_stalled`` when the main loop (XIDs and delivery) has not come
round for the stall time, and ``kmsg_reader_stalled`` when the kernel-log reader thread is alive but
busy without getting round its loop (an idle reader blocked waiting for input is not stalled). A
liveness probe restarts the agent on either, so both must turn unhealthy while stuck, naming the
problem, and healthy again once the loop moves: a slow moment must not leave the pod condemned.

How each is made to stall, without sleeps: the main loop serves delivery reports in the producer's
``poll()`` (librdkafka runs the callbacks there; the XID spool's acknowledgement writes to disk in one,
which a hung disk blocks), so a producer whose ``poll()`` waits on a gate holds that loop. The
kernel-log reader hands each event to the agent's queue; a put that waits on a gate holds the reader
between two lines, alive and not waiting for input. ``stall_after_s`` is short so the tests take
a fraction of a second; every wait polls for the awaited state with a deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.agent import node_agent
from gpupipe_producer.publish import Publisher
from gpupipe_producer.xid.kmsg_input import KmsgInput
from tests.agent_harness import node_for_fixtures, running_agent, wait_for
from tests.unit.producer.agent.test_node_agent import MemoryProducer, config, memory_publisher
from tests.unit.producer.agent.test_node_agent_resilience import XID48, record

STALL_S = 0.3


def unhealthy(agent: node_agent.NodeAgent) -> dict[str, Any] | None:
    """health()'s detail while unhealthy, else None (for wait_for)."""
    ok, detail = agent.health()
    return None if ok else detail


class GatedProducer(MemoryProducer):
    """MemoryProducer whose ``poll()`` (where librdkafka runs delivery callbacks) blocks while the gate
    is closed, as a delivery callback stuck on a hung disk does."""

    def __init__(self, conf: dict[str, Any]) -> None:
        super().__init__(conf)
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()

    def poll(self, timeout: float = 0.0) -> int:
        if not self.gate.is_set():
            self.blocked.set()
            self.gate.wait()
        return super().poll(timeout)


@pytest.fixture
def gated_publisher() -> Iterator[tuple[Publisher, GatedProducer]]:
    holder: list[GatedProducer] = []

    def factory(conf: dict[str, Any]) -> GatedProducer:
        holder.append(GatedProducer(conf))
        return holder[0]

    pub = Publisher({}, producer_factory=factory)
    try:
        yield pub, holder[0]
    finally:
        holder[0].gate.set()  # never leave the agent's thread blocked, pass or fail


def test_a_stuck_xid_loop_fails_healthz_by_name_and_recovers(
    tmp_path: Path, gated_publisher: tuple[Publisher, GatedProducer]
) -> None:
    pub, producer = gated_publisher
    with running_agent(config(tmp_path, stall_after_s=STALL_S), pub, node_for_fixtures()) as ra:
        ra.ticks_after(1)
        wait_for(lambda: ra.agent.health()[0], 5, "healthy at start")
        producer.gate.clear()
        wait_for(producer.blocked.is_set, 5, "the main loop blocked in poll()")
        detail = wait_for(lambda: unhealthy(ra.agent), 5, "unhealthy")
        assert "xid_loop_stalled" in detail["problems"], detail
        # NVML polling has its own thread: it goes on while the XID loop is stuck
        ra.ticks_after(2)
        producer.gate.set()
        wait_for(lambda: ra.agent.health()[0], 5, "healthy again once the loop moves")
        ra.stop()


class GatedKmsgInput(KmsgInput):
    """The real kernel-log input, with its hand-off to the agent behind a gate (closed: the reading
    thread stops between two lines, alive and not waiting for input)."""

    gate = threading.Event()
    blocked = threading.Event()

    def __init__(self, path: str, put: Any, stop: threading.Event, **kw: Any) -> None:
        def gated(item: Any) -> None:
            if not self.gate.is_set():
                self.blocked.set()
                while not self.gate.wait(0.05) and not stop.is_set():
                    pass
            put(item)

        super().__init__(path, gated, stop, **kw)


@pytest.fixture
def gated_kmsg(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[GatedKmsgInput]]:
    GatedKmsgInput.gate = threading.Event()
    GatedKmsgInput.gate.set()
    GatedKmsgInput.blocked = threading.Event()
    monkeypatch.setattr(node_agent, "KmsgInput", GatedKmsgInput)
    try:
        yield GatedKmsgInput
    finally:
        GatedKmsgInput.gate.set()


def test_a_stuck_kernel_log_reader_fails_healthz_by_name_and_recovers(
    tmp_path: Path, gated_kmsg: type[GatedKmsgInput]
) -> None:
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")
    kmsg.write_text("")
    pub, _ = memory_publisher()
    cfg = config(
        tmp_path,
        kmsg_path=str(kmsg),
        boot_id_path=str(boot),
        xid_merge_window_s=0.0,
        kmsg_retry_s=0.05,
        stall_after_s=STALL_S,
    )
    with running_agent(cfg, pub, node_for_fixtures()) as ra:
        ra.ticks_after(1)
        assert isinstance(ra.agent.kmsg_input, GatedKmsgInput)
        wait_for(lambda: ra.agent.health()[0], 5, "healthy while the kernel log is quiet")
        gated_kmsg.gate.clear()
        with kmsg.open("a") as f:
            f.write(record(1, XID48))
        wait_for(gated_kmsg.blocked.is_set, 5, "the reader held between two lines")
        detail = wait_for(lambda: unhealthy(ra.agent), 5, "unhealthy")
        assert ra.agent.kmsg_alive()
        assert "kmsg_reader_stalled" in detail["problems"], detail
        gated_kmsg.gate.set()
        wait_for(lambda: ra.agent.xids_sent >= 1, 5, "the held Xid sent")
        wait_for(lambda: ra.agent.health()[0], 5, "healthy again once the reader moves")
        ra.stop()


class DyingKmsgInput(KmsgInput):
    """The real kernel-log input whose reading thread ends with an exception a bug would raise."""

    def _positioned(self) -> None:
        super()._positioned()  # ready: it has read what was there
        raise RuntimeError("a bug in the kernel-log reader")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the bug, on purpose
def test_a_kernel_log_reader_that_died_fails_healthz_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found while writing the tests above: a reader thread that ended with an exception left
    /healthz healthy (the stall check looks only at a live reader): no XID from the kernel log any
    more, and nothing said so but a gauge."""
    monkeypatch.setattr(node_agent, "KmsgInput", DyingKmsgInput)
    kmsg, boot = tmp_path / "kmsg", tmp_path / "boot_id"
    boot.write_text("b0a7-1\n")
    kmsg.write_text("")
    pub, _ = memory_publisher()
    cfg = config(tmp_path, kmsg_path=str(kmsg), boot_id_path=str(boot), stall_after_s=STALL_S)
    with running_agent(cfg, pub, node_for_fixtures()) as ra:
        ra.ticks_after(1)
        wait_for(lambda: not ra.agent.kmsg_alive(), 5, "the reader thread ended")
        detail = wait_for(lambda: unhealthy(ra.agent), 5, "unhealthy")
        assert "kmsg_reader_died" in detail["problems"], detail
        ra.stop()
