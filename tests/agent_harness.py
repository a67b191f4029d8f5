"""Run the node agent in-process (a thread) for tests: fake NVML, fake kubelet, a kmsg file.

``node_for_fixtures()`` builds an 8-GPU H100 FakeNvml whose UUIDs and bus ids match the kubelet and
kmsg fixtures, so every fixture applies without rewriting:

* GPUs 0-5: ``whole_gpus`` UUIDs ...b0-...b5 (b0-b3 held by ml-train/llama-ft-0, b4-b5 by bert-sweep-7);
* GPU 6: the time-slicing GPU ``GPU-a0b1c2d3-...`` (dev-pod-1 and dev-pod-2 through replicas);
* GPU 7: MIG mode (3g.40gb gi 1, 1g.10gb gi 5/6/13), slices with the ``mig_mixed`` MIG UUIDs
  (reranker-0, notebook-alice, notebook-bob, embedder-0);
* bus ids: GPU 1 is 0000:9b:00 (the real Xid 119 lines), GPU 2 is 0000:91:00 (Xid 79), GPU 3 is
  0000:b3:00 (the real "fallen off the bus" report), GPU 7 is 0000:01:00 (the Xid 94/95 MIG lines);
  the others keep the DGX layout.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from gpupipe_producer.agent.node_agent import AgentConfig, NodeAgent
from gpupipe_producer.publish import Publisher
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_schemas.codec import AvroCodec
from tests.fake_nvml import FakeGpu, FakeMigSlice, FakeNvml, FakeProcess
from tests.kubelet_fake import load_fixture

KMSG_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "kmsg"

WHOLE = [f"GPU-8a1f0c3e-52d4-7b19-e6a0-3c5d9e7f20b{i}" for i in range(8)]
SHARED = "GPU-a0b1c2d3-e4f5-a6b7-c8d9-e0f1a2b3c4d5"
MIG_PARENT = "GPU-7e57a11e-0000-4000-8000-00000000d1f7"
MIG_RERANKER = "MIG-0b6d3c4e-7f21-5a8b-9c0d-1e2f3a4b5c6d"
MIG_ALICE = "MIG-1a2b3c4d-5e6f-5071-8293-a4b5c6d7e8f9"
MIG_BOB = "MIG-2b3c4d5e-6f70-5182-93a4-b5c6d7e8f90a"
MIG_EMBEDDER = "MIG-3c4d5e6f-7081-5293-a4b5-c6d7e8f90a1b"
UUIDS = [*WHOLE[:6], SHARED, MIG_PARENT]
BUS = {1: "00000000:9B:00.0", 2: "00000000:91:00.0", 3: "00000000:B3:00.0", 7: "00000000:01:00.0"}


def node_for_fixtures(uuids: list[str] | None = None, **kw: Any) -> FakeNvml:
    uuids = uuids or UUIDS
    gpus = []
    for i, uuid in enumerate(uuids):
        g = FakeGpu(i, model="H100", uuid=uuid, pci_bus_id=BUS.get(i))
        if i == 6:  # the time-sliced GPU runs one process per pod
            g.processes = [FakeProcess(40_001, "serve-a"), FakeProcess(40_002, "serve-b")]
        elif i == 0:
            g.processes = [FakeProcess(40_000, "torchrun")]
        gpus.append(g)
    fake = FakeNvml(gpus, **kw)
    if len(uuids) > 7:
        fake.gpus[7].enable_mig(
            [
                FakeMigSlice("3g.40gb", 1, uuid=MIG_RERANKER),
                FakeMigSlice("1g.10gb", 5, uuid=MIG_ALICE),
                FakeMigSlice("1g.10gb", 6, uuid=MIG_BOB),
                FakeMigSlice("1g.10gb", 13, uuid=MIG_EMBEDDER),
            ]
        )
    return fake


def combined_fixture() -> dict[str, Any]:
    """whole_gpus + time_slicing + mig_mixed pods in one List answer."""
    pods: list[Any] = []
    for name in ("whole_gpus", "time_slicing", "mig_mixed"):
        pods += load_fixture(name)["pod_resources"]
    return {"pod_resources": pods}


def kmsg_lines(name: str) -> list[str]:
    """The non-comment lines of tests/fixtures/kmsg/<name>.txt."""
    return [ln for ln in (KMSG_FIXTURES / name).read_text().splitlines() if ln and not ln.startswith("#")]


def find_line(name: str, *needles: str) -> str:
    for ln in kmsg_lines(name):
        if all(n in ln for n in needles):
            return ln
    raise LookupError(f"no line with {needles} in {name}")


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def metric(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    v = registry.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


class RunningAgent:
    def __init__(self, agent: NodeAgent, thread: threading.Thread, stop: threading.Event) -> None:
        self.agent = agent
        self.thread = thread
        self.stop_event = stop
        self.error: BaseException | None = None

    @property
    def registry(self) -> CollectorRegistry:
        return self.agent.metrics.registry

    def ticks_after(self, n: int, timeout: float = 10.0) -> None:
        """Wait until ``n`` more ticks ran."""
        target = self.agent.ticks + n
        wait_for(lambda: self.agent.ticks >= target, timeout, f"{n} ticks")

    def stop(self, timeout: float = 20.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "agent did not stop"
        if self.error is not None:
            raise self.error


@contextmanager
def running_agent(
    config: AgentConfig,
    publisher: Publisher,
    nvml: Any,
    *,
    t_samples: str = "samples",
    t_xid: str = "xid",
    metrics: ProducerMetrics | None = None,
) -> Iterator[RunningAgent]:
    metrics = metrics or ProducerMetrics()
    metrics.watch_publisher(publisher)
    agent = NodeAgent(config, publisher, metrics, AvroCodec(), t_samples, t_xid, nvml=nvml)
    stop = threading.Event()
    holder: list[RunningAgent] = []

    def target() -> None:
        try:
            agent.run(stop)
        except BaseException as exc:
            holder[0].error = exc
            agent.started.set()

    thread = threading.Thread(target=target, name="node-agent", daemon=True)
    ra = RunningAgent(agent, thread, stop)
    holder.append(ra)
    thread.start()
    try:
        wait_for(agent.started.is_set, 20, "agent start")
        if ra.error is not None:
            raise ra.error
        if config.kmsg_path and os.path.exists(config.kmsg_path):
            wait_for(agent.kmsg_ready.is_set, 10, "kmsg reader ready")
        yield ra
    finally:
        stop.set()
        thread.join(20)


def await_at_end_of(pid: int, path: Path, timeout: float = 30.0) -> None:
    """Wait until process ``pid`` holds ``path`` open at its end: a kernel-log follower has seeked
    there, so a line written now is read (one written before that seek never is)."""
    target, size = os.path.realpath(path), path.stat().st_size

    def at_end() -> bool:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir() if fds.exists() else ():
            with suppress(OSError):
                if os.readlink(fd) == target:
                    pos = (Path(f"/proc/{pid}/fdinfo") / fd.name).read_text().split()[1]
                    if int(pos) >= size:
                        return True
        return False

    wait_for(at_end, timeout, f"pid {pid} reading {path} from its end")
