"""NvmlControl (producer/agent/nvml_control.py) on its own, against the fake NVML: a let-go that must
wait is postponed, said and retried. The whole agent:
tests/unit/producer/agent/test_node_agent_nvml_control.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpupipe_producer.agent.nvml_control import NvmlControl
from gpupipe_producer.nvml.events import XidEventWatcher
from gpupipe_producer.nvml.source import NvmlSource
from tests.fake_nvml import FakeClock, FakeNvml


class Node:
    """A started source and watcher under an NvmlControl; everything stopped at the end."""

    def __init__(self, fake: FakeNvml, release: Path) -> None:
        self.fake = fake
        self.clock = FakeClock()
        self.source = NvmlSource(fake, "node-a", {"lost_reinit": 60.0}, self.clock, self.clock.wall)
        self.source.start()
        self.source.call_timeout_s = 0.1  # each GPU on its worker, as in the agent
        self.watcher = XidEventWatcher(fake, lambda ev: None, timeout_ms=50)
        self.watcher.start()
        self.errors: list[str] = []
        self.control = NvmlControl(
            self.source, self.watcher, str(release), on_watcher_error=self.errors.append
        )

    def step(self, seconds: float = 1.0) -> bool:
        return self.control.step(self.clock.advance(seconds))

    def close(self) -> None:
        for g in self.fake.gpus:
            g.hang(0)
        self.watcher.stop()
        self.source.shutdown()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(FakeNvml.node("H100", 2), tmp_path / "nvml-release")
    yield n
    n.close()


def _stall_gpu1(node: Node) -> None:
    node.fake.gpus[1].hang(30.0)  # its worker's call does not return
    node.source.poll(node.clock.advance(1.0))  # the fast group is due: GPU 1 is asked
    assert node.source.stalled_count() == 1 and not node.source.can_suspend()


def _unstall_gpu1(node: Node) -> None:
    node.fake.gpus[1].hang(0)  # the call returns
    deadline = time.monotonic() + 5
    while not node.source.can_suspend():
        assert time.monotonic() < deadline, "GPU 1's worker still busy"
        time.sleep(0.005)


def test_a_release_request_that_must_wait_is_said_once_counted_and_done_when_it_can(
    node: Node, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _stall_gpu1(node)
    (tmp_path / "nvml-release").touch()
    with caplog.at_level(logging.WARNING, logger="gpupipe.agent"):
        for _ in range(3):
            assert node.step() is True  # still held: polled as before
    said = [r.getMessage() for r in caplog.records if "postponed" in r.getMessage()]
    assert len(said) == 1 and "NVML release postponed" in said[0], said
    ctl = node.control
    assert ctl.released is None and ctl.release_pending == "gpu_call_in_flight"
    assert ctl.postponed == {"gpu_call_in_flight": 3}
    assert node.fake.init_count == 2  # nothing was let go meanwhile
    _unstall_gpu1(node)
    assert node.step() is False and ctl.released == "request" and ctl.release_pending is None
    assert node.fake.init_count == 0


def test_a_postponed_reinitialisation_does_not_double_its_back_off(node: Node) -> None:
    node.fake.gpus[0].lose()
    node.source.poll(node.clock())
    assert node.source.lost_gpus and not node.source.reinit_due(node.clock())  # due in 60 s
    _stall_gpu1(node)
    node.step(61.0)  # due, but GPU 1's call is in flight: postponed
    assert node.source.reinit_due(node.clock()), "still due: no re-initialisation happened"
    assert node.control.reinits["gpu_lost"] == 0 and node.control.postponed["gpu_call_in_flight"] == 1
    _unstall_gpu1(node)
    node.step()  # tried at the next tick, not 120 s later
    assert node.control.reinits["gpu_lost"] == 1 and node.fake.sessions == 2


def test_an_event_watcher_that_cannot_start_after_nvml_was_taken_again_is_retried(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "nvml-release"
    release.touch()
    assert node.step() is False and node.fake.init_count == 0
    real = node.fake.nvmlDeviceGetCount
    calls: list[int] = []

    def count() -> Any:  # the source's count answers, the watcher's (the next) fails once
        calls.append(1)
        if len(calls) == 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return real()

    monkeypatch.setattr(node.fake, "nvmlDeviceGetCount", count)
    release.unlink()
    assert node.step() is True  # taken again; the watcher's start failed
    assert node.watcher.registered == []
    assert node.step() is True  # before: never tried again, no NVML XIDs until a restart
    assert node.watcher.registered == [0, 1] and node.fake.init_count == 2
    assert node.errors == ["event_set"]  # counted (gpupipe_producer_nvml_errors_total)
