"""The first `make demo` on a fresh broker, end to end: it comes up, serves GPUs where dcgm-exporter
users look, stays up, and Ctrl-C ends it with exit 0 and nothing left running.

A service that reads a topic of a broker formatted moments before can meet "Not leader for
partition"; on a broker that has run before it never does, so only a demo on a new broker state
shows a start-up that crashes on it. The demo runs as `make demo` runs it (scripts/demo.py with the
project's Python); every port and directory is the test's own, so a demo or a test beside it on this
machine changes nothing. Every wait is on an event (a line the demo prints, an HTTP answer, the demo
ending); the deadlines only bound a failure on a loaded machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

import pytest

from tests.conftest import BROKER_START_TIMEOUT, REPO
from tests.hygiene import _die_with_parent, live_descendants, popen

pytestmark = pytest.mark.integration

T = TypeVar("T")

DEMO = REPO / "scripts" / "demo.py"
#: The demo's own processes, by what their command line shows.
SERVICES = {
    "producer": "gpupipe produce",
    "metrics": "gpupipe metrics",
    "chargeback": "gpupipe chargeback",
    "alerts": "gpupipe alerts",
    "recommend": "gpupipe recommend",
    "lake": "gpupipe lake write",
    "prometheus": "prometheus --config.file",
    "alertmanager": "alertmanager --config.file",
}
#: The demo's gpupipe services (each with /healthz), and the variable that moves its port.
HTTP_PORTS = {
    name: f"GPUPIPE_DEMO_{name.upper()}_PORT"
    for name in ("producer", "metrics", "chargeback", "alerts", "recommend", "lake")
}
NODES = [f"sim-node-{i:04d}" for i in range(4)]  # the demo's 4-node fleet
STARTED_S = 300.0  # a fresh broker's first start (a JVM on a loaded machine), then eight processes
READY_S = 180.0  # from "started" to every service healthy and GPU series on the metrics port
UP_S = 25.0  # every service must stay up this long once ready (a start-up crash comes within seconds)
STOP_S = 120.0  # Ctrl-C: eight processes, then the broker


class Demo:
    """scripts/demo.py as a child; its output (stdout and stderr) read line by line as it comes."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.logs = logs
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = popen(
            [sys.executable, str(DEMO)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_as_in_a_terminal,
        )
        self._reader = threading.Thread(target=self._read, name="demo-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout_s: float) -> str:
        """The first output line matching `pattern`, once the demo has printed it."""
        rx = re.compile(pattern)

        def found() -> str | None:
            return next((line for line in self.lines if rx.search(line)), None)

        with self._cond:
            self._cond.wait_for(lambda: found() is not None or not self._reader.is_alive(), timeout_s)
            line = found()
        assert line is not None, (
            f"the demo never printed /{pattern}/ within {timeout_s:.0f} s\n{self.explain()}"
        )
        return line

    def await_(self, probe: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """Poll `probe` until it gives a value; the demo ending first fails at once, naming why."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = probe()
            if value is not None:
                return value
            assert self.proc.poll() is None, (
                f"the demo exited {self.proc.returncode} before {what}\n{self.explain()}"
            )
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s\n{self.explain()}"
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.5)  # paces the poll, and wakes at once if the demo ends

    def explain(self) -> str:
        """The demo's output and the end of every service's log: what a failure report needs."""
        parts = ["--- demo output:", *self.lines[-40:]]
        for log in sorted(self.logs.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-8:]
            parts += [f"--- {log.name}:", *tail]
        return "\n".join(parts)

    def close(self) -> None:
        self._reader.join(10)


def _as_in_a_terminal() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ctrl-C's default action, which a shell's background job (this pytest, perhaps) has ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with_parent()


def _get(url: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError:
        return None


def _healthy(port: int) -> bool:
    got = _get(f"http://127.0.0.1:{port}/healthz")
    return got is not None and got[0] == 200 and json.loads(got[1]).get("status") == "ok"


def _gpu_scrape(port: int) -> str | None:
    """The metrics port's scrape once it shows the whole fleet: every node, a MIG slice, a time-sliced GPU."""
    got = _get(f"http://127.0.0.1:{port}/metrics")
    if got is None or got[0] != 200:
        return None
    util = [line for line in got[1].splitlines() if line.startswith("DCGM_FI_DEV_GPU_UTIL{")]
    nodes = {m.group(1) for line in util if (m := re.search(r'Hostname="([^"]+)"', line))}
    mig = any("GPU_I_PROFILE=" in line for line in got[1].splitlines() if line.startswith("DCGM_FI_"))
    pods_per_gpu: dict[str, set[str]] = {}
    for line in got[1].splitlines():
        if line.startswith("gpupipe_pod_gpu_util_percent{"):
            uuid = re.search(r'UUID="([^"]+)"', line)
            pod = re.search(r'pod="([^"]+)"', line)
            if uuid and pod:
                pods_per_gpu.setdefault(uuid.group(1), set()).add(pod.group(1))
    shared = any(len(pods) > 1 for pods in pods_per_gpu.values())
    return got[1] if nodes == set(NODES) and mig and shared else None


def _prometheus_has_gpus(port: int) -> bool:
    query = urllib.parse.urlencode({"query": "count(DCGM_FI_DEV_GPU_UTIL)"})
    got = _get(f"http://127.0.0.1:{port}/api/v1/query?{query}")
    if got is None or got[0] != 200:
        return False
    result = json.loads(got[1])["data"]["result"]
    return bool(result) and float(result[0]["value"][1]) > 0


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _listen_port(taken: Collection[int]) -> int:
    """A free port below the kernel's ephemeral range: the demo's own clients (dozens of Kafka
    connections) take their local ports from that range and could take a listen port chosen there
    between the demo's check and a service's bind ("Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, low)
        if port not in taken and _port_free(port):
            return port
    raise AssertionError(f"no free port in 20000-{low}")


def _demo_ports() -> dict[str, int]:
    """A distinct free port for every GPUPIPE_DEMO_*_PORT variable of the demo."""
    variables = re.findall(r'"(GPUPIPE_DEMO_\w+_PORT)"', DEMO.read_text())
    assert len(variables) == 10, variables  # the scan sees every port the demo has
    ports: dict[str, int] = {}
    for variable in variables:
        ports[variable] = _listen_port(ports.values())
    return ports


def _alive(pids: dict[int, str]) -> dict[int, str]:
    out = {}
    for pid, cmd in pids.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            out[pid] = cmd
    return out


def _demo_env(ports: dict[str, int], kafka_dir: Path, logs: Path) -> dict[str, str]:
    """The demo's environment: its ports and directories, and a new Kafka state dir (a fresh broker)."""
    env = {k: v for k, v in os.environ.items() if k != "GPUPIPE_DEMO_SECURE"}
    env.update({v: str(p) for v, p in ports.items()})
    env.update(KAFKA_LOCAL_DIR=str(kafka_dir), GPUPIPE_DEMO_DIR=str(logs), PYTHONUNBUFFERED="1")
    env.update(BROKER_START_TIMEOUT)
    return env


def _broker_pid(kafka_dir: Path) -> int | None:
    """The broker's pid once kafka-local has launched it (it writes the file, then runs the JVM)."""
    try:
        return int((kafka_dir / "kafka.pid").read_text().strip() or 0) or None
    except OSError:
        return None


def _clean_up(demo: Demo, children: dict[int, str], env: dict[str, str], kafka_dir: Path) -> None:
    """After a failure: the demo, the processes it started in their own sessions, and the broker."""
    if demo.proc.poll() is None:
        demo.proc.send_signal(signal.SIGTERM)
        try:
            demo.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            demo.proc.kill()
            demo.proc.wait()
    for pid in _alive(children):  # own sessions: a signal to the demo's group misses them
        os.kill(pid, signal.SIGKILL)
    if (kafka_dir / "kafka.pid").exists():  # the broker daemonized: only kafka-local stop ends it
        subprocess.run([REPO / "scripts" / "kafka-local", "stop"], env=env, capture_output=True, timeout=120)
    demo.close()


@pytest.mark.timeout(STARTED_S + READY_S + UP_S + STOP_S + 60)
def test_first_demo_on_a_fresh_broker_comes_up_stays_up_and_stops_clean(tmp_path: Path) -> None:
    ports = _demo_ports()
    kafka_dir, logs = tmp_path / "kafka", tmp_path / "demo"  # a new state dir: a broker formatted now
    env = _demo_env(ports, kafka_dir, logs)
    began = time.monotonic()
    demo = Demo(env, logs)
    children: dict[int, str] = {}
    try:
        demo.wait_line(r"^demo:\s+GPU metrics .*GPUPIPE_DEMO_METRICS_PORT$", 120)
        assert not [line for line in demo.lines if "not installed" in line], demo.explain()
        demo.wait_line(r"^demo: logs in ", STARTED_S)
        started = time.monotonic()
        scrape = demo.await_(lambda: _gpu_scrape(ports["GPUPIPE_DEMO_METRICS_PORT"]), READY_S, "GPU series")
        for name, variable in HTTP_PORTS.items():
            port = ports[variable]
            demo.await_(lambda p=port: _healthy(p) or None, READY_S, f"{name} healthy on :{port}")
        am = ports["GPUPIPE_DEMO_ALERTMANAGER_PORT"]
        demo.await_(
            lambda: (_get(f"http://127.0.0.1:{am}/-/ready") or (0, ""))[0] == 200 or None, 60, "Alertmanager"
        )
        prom = ports["GPUPIPE_DEMO_PROMETHEUS_PORT"]
        demo.await_(lambda: _prometheus_has_gpus(prom) or None, READY_S, "GPU series in Prometheus")
        ready = time.monotonic()
        assert 'modelName="' in scrape and "DCGM_FI_DRIVER_VERSION=" in scrape  # dcgm-exporter's labels

        children = live_descendants(demo.proc.pid)
        for name, marker in SERVICES.items():
            assert any(marker in cmd for cmd in children.values()), f"no {name} process: {children}"
        children[demo.await_(lambda: _broker_pid(kafka_dir), 10, "the broker's pid")] = "kafka broker"
        with contextlib.suppress(subprocess.TimeoutExpired):  # the demo's watch sees no service end
            demo.proc.wait(UP_S)
        assert demo.proc.poll() is None, f"the demo exited {demo.proc.returncode} while up\n{demo.explain()}"
        assert _alive(children) == children, f"died while up: {set(children) - set(_alive(children))}"
        for name, variable in HTTP_PORTS.items():
            assert _healthy(ports[variable]), f"{name} unhealthy after {UP_S:.0f} s\n{demo.explain()}"

        demo.proc.send_signal(signal.SIGINT)  # Ctrl-C
        stopping = time.monotonic()
        rc = demo.proc.wait(STOP_S)
        stopped = time.monotonic()
        demo.close()
        assert rc == 0, demo.explain()
        assert demo.lines[-1] == "demo: Kafka stopped. Bye.", demo.explain()
        assert not [line for line in demo.lines if "exited with" in line], demo.explain()
        assert _alive(children) == {}, "left running after Ctrl-C"
        assert [v for v, p in ports.items() if not _port_free(p)] == []
        print(
            f"demo: started {started - began:.1f} s, ready {ready - began:.1f} s, "
            f"stopped in {stopped - stopping:.1f} s after Ctrl-C"
        )
    finally:
        _clean_up(demo, children, env, kafka_dir)


@pytest.mark.timeout(STARTED_S + STOP_S + 60)
def test_ctrl_c_while_the_broker_starts_stops_the_demo_and_the_broker(tmp_path: Path) -> None:
    ports = _demo_ports()
    kafka_dir, logs = tmp_path / "kafka", tmp_path / "demo"
    env = _demo_env(ports, kafka_dir, logs)
    demo = Demo(env, logs)
    broker: dict[int, str] = {}
    try:
        demo.wait_line(r"^demo: starting local Kafka", 120)
        broker[demo.await_(lambda: _broker_pid(kafka_dir), 120, "a broker launched")] = "kafka broker"
        os.killpg(demo.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the demo and kafka-local
        rc = demo.proc.wait(STOP_S)
        demo.close()
        assert rc == 0 and not [line for line in demo.lines if "Traceback" in line], demo.explain()
        # Ctrl-C lands while the broker starts; on a fast machine it may land just after, a plain stop
        assert demo.lines[-1] in ("demo: stopped while Kafka was starting. Bye.", "demo: Kafka stopped. Bye.")
        assert _alive(broker) == {}, "the broker outlived the demo"
        assert _port_free(ports["GPUPIPE_DEMO_KAFKA_PORT"])
    finally:
        _clean_up(demo, broker, env, kafka_dir)
