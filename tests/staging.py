"""Staging in a box: the deployed system as real processes, one harness for a test and a bench.

Contract: ``Staging(workdir).start()`` brings up, each as a real OS process through its real entry
point, a 3-broker KRaft cluster (``scripts/kafka-local``), ``nodes`` node agents (``gpupipe produce
--source nvml`` through ``tests/fake_nvml_cli.py``, each with the shipped ``kmsg-relay`` over a fake
kernel log and a kubelet double on a unix socket), two ``gpupipe metrics`` in one group, two
``gpupipe chargeback`` in one group (the second takes the first's partitions when it dies), the
``gpupipe alerts --ha`` pair cordoning through a Kubernetes API double, a real Alertmanager on the
shipped config (timers shortened) notifying a webhook, and a real Prometheus scraping both metrics
replicas with the shipped rules and alerting to that Alertmanager. ``close()`` ends everything (also
at interpreter exit); every wait awaits an event (a ready probe, a broker listed, a page notified).

Faults: :meth:`kill`/:meth:`restart` a process, :meth:`kill_leader` of a topic's partition and
:meth:`start_broker` again, :meth:`pause_broker`/:meth:`resume_broker`, :meth:`inject_xid` into a
node's kernel log. :meth:`audit` holds the system to its invariants (pages, cordons, Prometheus'
view, chargeback's counts) and returns the figures; the caller asserts or prints them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the kubelet doubles' gRPC: no line per fork

from gpupipe.kafka import topics
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.am_webhook import WebhookReceiver
from tests.conftest import _PORTS, BROKER_START_TIMEOUT, REPO, free_port
from tests.k8s_api_fake import FakeKubeApi
from tests.kafka_cluster import SCRIPT as KAFKA_LOCAL
from tests.kafka_cluster import KafkaCluster, free_run
from tests.kmsg_relay_proc import RelayProcess
from tests.kubelet_fake import FakeKubelet

T = TypeVar("T")
PREFIX = "stg."
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
WINDOW_MS, GRACE_MS = 5_000, 2_000  # chargeback's windows: short, so a short drill closes several
DRAIN_XIDS = {79}  # the codes the drill injects that call for a drain (the catalog's RESTART_BM)


def await_event(what: str, check: Callable[[], T], timeout_s: float, every_s: float = 0.2) -> T:
    """Poll ``check`` until it answers something true (an OSError counts as "not yet")."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g}s (last: {last!r})")
        time.sleep(every_s)


def http_json(url: str, timeout: float = 3) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"null")
        except ValueError:
            return exc.code, None


def prometheus_binary() -> tuple[str, str]:
    """(path, major version): Prometheus 3 where scripts/prometheus3-local already built it (or
    $PROMETHEUS3 names it), else Debian's 2.x; never a build here (minutes)."""
    env = os.environ.get("PROMETHEUS3")
    cache = Path(os.environ.get("GPUPIPE_CACHE", Path.home() / ".cache" / "gpupipe")) / "bin"
    built = sorted(cache.glob("prometheus-3.*"))
    for cand in ([env] if env else []) + [str(p) for p in built]:
        if os.access(cand, os.X_OK):
            return cand, "3"
    debian = shutil.which("prometheus")
    if debian is None:
        raise RuntimeError("no Prometheus: run scripts/prometheus3-local or install Debian's prometheus")
    return debian, "2"


@dataclass
class Proc:
    """One long-running process of the system, in its own process group; ``port`` serves /healthz."""

    name: str
    argv: list[str]
    log: Path
    port: int
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> Proc:
        with self.log.open("ab") as out:
            self.proc = hygiene.popen(self.argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> tuple[int, Any]:
        if not self.alive():
            raise AssertionError(f"{self.name} exited {self.proc and self.proc.poll()}: {self.tail()}")
        return http_json(f"http://127.0.0.1:{self.port}/healthz")

    def ready(self) -> bool:
        """200 on /healthz; False while it is not running (the supervisor may be restarting it)."""
        return self.alive() and http_json(f"http://127.0.0.1:{self.port}/healthz")[0] == 200

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            hygiene.stop_group(self.proc, signal.SIGKILL, timeout=1)

    def stop(self) -> int | None:
        return None if self.proc is None else hygiene.stop_group(self.proc)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@dataclass
class Node:
    """A simulated GPU node: its kernel log (a file the relay serves), kubelet double and agent."""

    name: str
    gpus: list[tuple[str, str]]  # (UUID, short bus id "0000:18:00") per GPU index
    ring: Path
    relay: RelayProcess
    kubelet: FakeKubelet
    agent: Proc
    seq: int = 100

    def write_kmsg(self, text: str, level: int = 3) -> None:
        """One raw /dev/kmsg record, stamped with this host's monotonic clock (as the kernel's)."""
        self.seq += 1
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        with self.ring.open("a") as f:
            f.write(f"{level},{self.seq},{usec},-;{text}\n")


@dataclass(frozen=True)
class Fault:
    node: str
    gpu: int
    xid: int
    bus: str


@dataclass
class Audit:
    """What :meth:`Staging.audit` found; ``violations`` lists every broken invariant in words."""

    faults: int = 0
    paged_once: int = 0
    pages: dict[str, int] = field(default_factory=dict)  # fault -> pages notified
    false_pages: list[str] = field(default_factory=list)
    cordoned: list[str] = field(default_factory=list)
    false_cordons: list[str] = field(default_factory=list)
    missing_cordons: list[str] = field(default_factory=list)
    gpus_expected: int = 0
    gpus_in_prometheus: int = 0
    chargeback_windows: int = 0
    samples_in_topic: int = 0
    samples_charged: float = 0.0
    samples_miscounted: float = 0.0
    exits: list[str] = field(default_factory=list)  # processes that exited on their own (restarted)
    violations: list[str] = field(default_factory=list)


class Staging:
    def __init__(self, workdir: Path, nodes: int = 2, gpus: int = 2, interval: str = "1s") -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        # unix socket paths must stay under 108 bytes: a short directory of its own
        self.sockdir = Path(tempfile.mkdtemp(prefix="stg-", dir="/tmp"))
        self.n_nodes, self.n_gpus, self.interval = nodes, gpus, interval
        self.cluster: KafkaCluster | None = None
        self.nodes: list[Node] = []
        self.procs: dict[str, Proc] = {}
        self.faults: list[Fault] = []
        self.hook: WebhookReceiver | None = None
        self.kube: FakeKubeApi | None = None
        self.am: Proc | None = None
        self.prom: Proc | None = None
        self.prom_version = ""
        self.timings: dict[str, float] = {}
        self._closed = False
        self._paused: set[int] = set()
        self.held: set[str] = set()  # processes the drill keeps down: the supervisor leaves them
        self.exits: list[tuple[str, int]] = []  # (name, status) of every exit the drill did not cause
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        atexit.register(self.close)

    # -- start ------------------------------------------------------------------------------------
    def start(self) -> Staging:
        try:
            t0 = time.monotonic()
            self._start_kafka()
            self.timings["kafka_s"] = time.monotonic() - t0
            self._start_doubles()
            self._start_alertmanager()
            for i in range(self.n_nodes):
                self._start_node(i)
            self._start_services()
            self._start_prometheus()
            self._supervisor = threading.Thread(
                target=self._supervise, name="staging-supervisor", daemon=True
            )
            self._supervisor.start()
            self.await_ready(240)
            self.timings["start_s"] = time.monotonic() - t0
            return self
        except BaseException:
            self.close()
            raise

    def _start_kafka(self) -> None:
        base = free_run(6, _PORTS)
        env = {
            **os.environ,
            "KAFKA_LOCAL_DIR": str(self.dir / "kafka"),
            "KAFKA_BROKERS": "3",
            "KAFKA_PORT": str(base),
            "KAFKA_STOP_TIMEOUT": "15",
            **BROKER_START_TIMEOUT,
        }
        self._kafka_env = env
        out = subprocess.run(
            [KAFKA_LOCAL, "start", "--fresh"], env=env, capture_output=True, text=True, timeout=400
        )
        if out.returncode != 0:
            subprocess.run([KAFKA_LOCAL, "stop"], env=env, capture_output=True, timeout=120)
            raise RuntimeError(f"the 3-broker cluster did not start:\n{out.stderr[-3000:]}")
        self.cluster = KafkaCluster(out.stdout.strip().splitlines()[-1], env)

    def _start_doubles(self) -> None:
        self.hook = WebhookReceiver().__enter__()
        names = [f"gpu-node-{i}" for i in range(self.n_nodes)]
        self.kube = FakeKubeApi(names, token="staging").start()
        (self.dir / "kube-token").write_text("staging")

    def _start_alertmanager(self) -> None:
        assert self.hook is not None
        cfg = yaml.safe_load((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
        for route in [cfg["route"], *cfg["route"].get("routes", [])]:
            route["group_wait"], route["group_interval"] = "1s", "1s"  # pages in seconds, not minutes
        for rcv in cfg["receivers"]:  # the shipped receivers point at nothing: at the pager double here
            rcv["webhook_configs"] = [{"url": self.hook.url("/" + rcv["name"]), "send_resolved": True}]
        d = self.dir / "alertmanager"
        d.mkdir(exist_ok=True)
        (d / "am.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        self.am = Proc(
            "alertmanager",
            [ALERTMANAGER, f"--config.file={d / 'am.yml'}", f"--storage.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            d / "am.log", port,
        ).start()  # fmt: skip
        await_event("Alertmanager ready", lambda: self._probe(self.am, "/-/ready"), 30)

    def _probe(self, p: Proc | None, path: str) -> bool:
        assert p is not None and p.alive(), p and p.tail()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{p.port}{path}", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _common(self) -> list[str]:
        assert self.cluster is not None
        return [
            "--bootstrap-servers",
            self.cluster.bootstrap,
            "--topic-prefix",
            PREFIX,
            "--log-format",
            "text",
        ]

    def _gpupipe(self, name: str, *argv: str) -> Proc:
        port = free_port()
        cmd = [sys.executable, "-m", "gpupipe", *argv, *self._common(), "--listen", f"127.0.0.1:{port}"]
        p = Proc(name, cmd, self.dir / f"{name}.log", port).start()
        self.procs[name] = p
        return p

    def _start_node(self, i: int) -> None:
        sys.path.insert(0, str(REPO / "tests"))  # fake_nvml_cli builds the node as the agent will
        from tests.fake_nvml_cli import build

        name = f"gpu-node-{i}"
        spec = f"H100:{self.n_gpus}:salt={name}"
        fake = build(spec)
        gpus = [
            (g.uuid, g.pci_bus_id.lower().replace("00000000:", "0000:").rsplit(".", 1)[0]) for g in fake.gpus
        ]
        ring = self.dir / f"{name}.kmsg"
        ring.write_text("")
        relay = RelayProcess(ring, self.sockdir / f"k{i}.sock", log=self.dir / f"{name}-relay.log").start()
        gpu = "nvidia.com/gpu"
        pods = {
            "pod_resources": [
                {
                    "name": f"job-{i}-{g}",
                    "namespace": f"team-{g % 2}",
                    "containers": [
                        {"name": "main", "devices": [{"resource_name": gpu, "device_ids": [uuid]}]}
                    ],
                }
                for g, (uuid, _) in enumerate(gpus)
            ]
        }
        kubelet = FakeKubelet(pods, socket_path=str(self.sockdir / f"p{i}.sock"))
        port = free_port()
        spool = self.dir / f"{name}-spool"
        cmd = [sys.executable, str(REPO / "tests" / "fake_nvml_cli.py"), "produce", "--source", "nvml",
               *self._common(), "--interval", self.interval, "--kubelet-socket", kubelet.socket_path,
               "--kmsg-path", str(relay.sock), "--spool-dir", str(spool),
               "--listen", f"127.0.0.1:{port}"]  # fmt: skip
        env = {**os.environ, "GPUPIPE_FAKE_NVML": spec, "NODE_NAME": name}
        agent = Proc(name, cmd, self.dir / f"{name}.log", port, env=env).start()
        self.procs[name] = agent
        self.nodes.append(Node(name, gpus, ring, relay, kubelet, agent))

    def _start_services(self) -> None:
        assert self.am is not None and self.kube is not None
        for r in ("a", "b"):
            self._gpupipe(f"metrics-{r}", "metrics", "--group-id", "stg-metrics")
        for r in ("a", "b"):
            self._gpupipe(
                f"chargeback-{r}", "chargeback", "--group-id", "stg-chargeback", "--instance-id", f"cb-{r}",
                "--window", f"{WINDOW_MS}ms", "--grace", f"{GRACE_MS}ms", "--start", "earliest",
            )  # fmt: skip
        for r in ("a", "b"):
            self._gpupipe(
                f"alerts-{r}", "alerts", "--ha", "--ha-session-timeout", "6s", "--instance-id", r,
                "--group-id", "stg-alerts", "--alertmanager-url", f"http://127.0.0.1:{self.am.port}",
                "--cordon", "--kube-api-url",
                self.kube.url, "--kube-token-file", str(self.dir / "kube-token"),
            )  # fmt: skip

    def _start_prometheus(self) -> None:
        assert self.am is not None
        binary, self.prom_version = prometheus_binary()
        d = self.dir / "prometheus"
        d.mkdir(exist_ok=True)
        shipped = REPO / "deploy" / "prometheus"
        cfg = yaml.safe_load((shipped / "prometheus.yml").read_text())
        cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        cfg["rule_files"] = [str(shipped / f) for f in cfg["rule_files"]]
        cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{self.am.port}"]}]
        targets = {
            "gpupipe-metrics": [f"127.0.0.1:{self.procs[f'metrics-{r}'].port}" for r in ("a", "b")],
            "gpupipe-services": [
                f"127.0.0.1:{p.port}" for n, p in self.procs.items() if not n.startswith("metrics")
            ],
        }
        cfg["scrape_configs"] = [
            {**job, "static_configs": [{"targets": targets[job["job_name"]]}]}
            for job in cfg["scrape_configs"]
            if job["job_name"] in targets
        ]
        (d / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        port = free_port()
        self.prom = Proc(
            "prometheus",
            [binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            d / "prometheus.log", port,
        ).start()  # fmt: skip

    def _supervise(self) -> None:
        """The kubelet's part: a process that exits on its own (an alerts leader that lost its lease
        stops by design) is started again after a second; each such exit is recorded."""
        while not self._stop.wait(1.0):
            with self._lock:
                for name, p in self.procs.items():
                    if name in self.held or p.proc is None or p.proc.poll() is None:
                        continue
                    self.exits.append((name, p.proc.returncode))
                    p.start()

    # -- readiness --------------------------------------------------------------------------------
    def await_ready(self, timeout_s: float = 120) -> float:
        """Every process ready and Prometheus seeing every GPU in a scrape made after this call:
        the seconds it took."""
        t0, since = time.monotonic(), time.time()
        for p in self.procs.values():
            await_event(f"{p.name} ready", p.ready, timeout_s)
        self.timings["last_ready_procs_s"] = time.monotonic() - t0
        await_event("Prometheus ready", lambda: self._probe(self.prom, "/-/ready"), timeout_s)
        await_event(
            "Prometheus sees every GPU", lambda: self.prometheus_gpus(since) == self.all_gpus(), timeout_s
        )
        self.timings["last_ready_prometheus_s"] = time.monotonic() - t0
        await_event("an alerts instance leading", lambda: self.alerts_leader() is not None, timeout_s)
        self.timings["last_ready_s"] = time.monotonic() - t0
        return time.monotonic() - t0

    def all_gpus(self) -> set[str]:
        return {uuid for n in self.nodes for uuid, _ in n.gpus}

    def prometheus_query(self, expr: str) -> list[dict[str, Any]]:
        assert self.prom is not None
        q = urllib.parse.urlencode({"query": expr})
        code, doc = http_json(f"http://127.0.0.1:{self.prom.port}/api/v1/query?{q}", timeout=5)
        assert code == 200 and doc["status"] == "success", doc
        return list(doc["data"]["result"])

    def prometheus_gpus(self, since: float | None = None) -> set[str]:
        """GPUs whose temperature Prometheus scraped after ``since`` (epoch s; default 3 s ago), from
        either replica."""
        since = time.time() - 3 if since is None else since
        got = self.prometheus_query(f"count by (UUID) (timestamp(DCGM_FI_DEV_GPU_TEMP) > {since:.3f})")
        return {r["metric"].get("UUID", "") for r in got}

    def alerts_leader(self) -> str | None:
        for r in ("a", "b"):
            p = self.procs[f"alerts-{r}"]
            if p.alive():
                # AssertionError: it exited between alive() and the request (a lost lease, by design)
                with contextlib.suppress(OSError, AssertionError):
                    code, body = p.health()
                    if code == 200 and body.get("role") == "leader":
                        return p.name
        return None

    def await_takeover(self, dead: str, timeout_s: float = 60) -> float:
        """Seconds (from now) until an alerts instance other than ``dead`` leads."""
        t0 = time.monotonic()
        await_event(
            f"the standby taking over from {dead}",
            lambda: self.alerts_leader() not in (None, dead),
            timeout_s,
        )
        return time.monotonic() - t0

    # -- faults -----------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """SIGKILL one process (and its group): no goodbye to the group coordinator or the broker.
        It stays down until :meth:`restart`."""
        with self._lock:
            self.held.add(name)
            self.procs[name].kill9()

    def restart(self, name: str, timeout_s: float = 120) -> float:
        """Start the process again on its old flags and state; the seconds until it is ready."""
        p = self.procs[name]
        t0 = time.monotonic()
        with self._lock:
            self.held.discard(name)
            p.start()
        await_event(f"{name} ready again", p.ready, timeout_s)
        return time.monotonic() - t0

    def leader(self, base_topic: str, partition: int = 0) -> int:
        assert self.cluster is not None
        return await_event(
            f"a leader for {base_topic}[{partition}]",
            lambda: (lid := self.cluster.leader(PREFIX + base_topic, partition)) >= 0 and lid,  # type: ignore[union-attr]
            60,
        )

    def kill_leader(self, base_topic: str, partition: int = 0) -> int:
        """SIGKILL the broker leading the partition; its node number (brokers are node.id 1..3)."""
        assert self.cluster is not None
        node = self.leader(base_topic, partition)
        self.cluster.broker(node, "kill")
        return node

    def start_broker(self, node: int) -> float:
        """Start a broker again on its data; the seconds until the cluster lists it."""
        assert self.cluster is not None
        t0 = time.monotonic()
        self.cluster.broker(node, "start")
        await_event(f"broker {node} listed", lambda: node in self.cluster.alive(), 120)  # type: ignore[union-attr]
        return time.monotonic() - t0

    def stop_broker(self, node: int) -> None:
        """A clean stop (SIGTERM): the broker hands its leaderships over first, as in a rolling restart."""
        assert self.cluster is not None
        self.cluster.broker(node, "stop")

    def in_sync(self) -> bool:
        """Every partition of the system's topics has all 3 replicas in sync (none under-replicated)."""
        assert self.cluster is not None
        md = self.cluster.admin().list_topics(timeout=5)
        return all(
            len(p.isrs) == len(p.replicas)
            for name, t in md.topics.items()
            if name.startswith(PREFIX)
            for p in t.partitions.values()
        )

    def pause_broker(self, node: int) -> None:
        """SIGSTOP the broker: alive to the network, silent (a GC pause, a frozen VM)."""
        assert self.cluster is not None
        self.cluster.broker(node, "pause")
        self._paused.add(node)

    def resume_broker(self, node: int) -> None:
        assert self.cluster is not None
        self.cluster.broker(node, "resume")
        self._paused.discard(node)

    def inject_xid(self, node: int, gpu: int, code: int) -> Fault:
        """An XID line in the node's kernel log, as the NVIDIA driver writes it."""
        n = self.nodes[node]
        bus = n.gpus[gpu][1]
        n.write_kmsg(
            f"NVRM: Xid (PCI:{bus}): {code}, pid='<unknown>', name=<unknown>, injected by the drill."
        )
        f = Fault(n.name, gpu, code, bus)
        self.faults.append(f)
        return f

    # -- audit ------------------------------------------------------------------------------------
    def pages(self) -> dict[tuple[tuple[str, str], ...], int]:
        """Label set -> times it was paged (notified firing while not already firing)."""
        assert self.hook is not None
        firing: set[tuple[tuple[str, str], ...]] = set()
        out: dict[tuple[tuple[str, str], ...], int] = defaultdict(int)
        for n in self.hook.notifications():
            for a in n.alerts():
                key = tuple(sorted(a["labels"].items()))
                if a["status"] == "firing" and key not in firing:
                    firing.add(key)
                    out[key] += 1
                elif a["status"] == "resolved":
                    firing.discard(key)
        return dict(out)

    def _am_active(self) -> set[tuple[tuple[str, str], ...]]:
        assert self.am is not None
        code, alerts = http_json(
            f"http://127.0.0.1:{self.am.port}/api/v2/alerts?silenced=false&inhibited=false"
        )
        assert code == 200, alerts
        return {tuple(sorted(a["labels"].items())) for a in alerts if a["status"]["state"] == "active"}

    @staticmethod
    def _matches(f: Fault, labels: dict[str, str]) -> bool:
        return (
            labels.get("node") == f.node
            and labels.get("xid") == str(f.xid)
            and labels.get("pci_bus_id", "").lower().startswith(f.bus)
        )

    def audit(self, timeout_s: float = 120) -> Audit:
        """Await the system's settled view, then hold it to the invariants."""
        a = Audit(faults=len(self.faults), gpus_expected=len(self.all_gpus()))
        a.exits = [f"{n} (status {rc})" for n, rc in self.exits]

        # every fault paged, and Alertmanager's notifications caught up with its active alerts
        def settled() -> bool:
            pages = self.pages()
            paged = all(any(self._matches(f, dict(k)) for k in pages) for f in self.faults)
            return paged and self._am_active() <= set(pages)

        try:
            await_event("every fault paged, every active alert notified", settled, timeout_s, 0.5)
        except AssertionError as exc:
            a.violations.append(str(exc)[:500])
        pages = self.pages()
        for f in self.faults:
            n = sum(c for k, c in pages.items() if self._matches(f, dict(k)))
            a.pages[f"{f.node}/gpu{f.gpu}/xid{f.xid}"] = n
            a.paged_once += n == 1
            if n != 1:
                a.violations.append(f"{f.node} GPU {f.gpu} Xid {f.xid} paged {n} times")
        for k in pages:
            if not any(self._matches(f, dict(k)) for f in self.faults):
                a.false_pages.append(json.dumps(dict(k), sort_keys=True))
        a.violations += [f"a page without a fault: {p}" for p in a.false_pages]
        # cordons: exactly the nodes with a fault calling for a drain
        assert self.kube is not None
        drain = {f.node for f in self.faults if f.xid in DRAIN_XIDS}
        with contextlib.suppress(AssertionError):
            await_event("every drain cordoned", lambda: drain <= self._cordoned(), 30)
        a.cordoned = sorted(self._cordoned())
        a.false_cordons = sorted(set(a.cordoned) - drain)
        a.missing_cordons = sorted(drain - set(a.cordoned))
        a.violations += [f"{n} cordoned without a fault" for n in a.false_cordons]
        a.violations += [f"{n} not cordoned after a drain fault" for n in a.missing_cordons]
        # Prometheus sees every GPU
        try:
            await_event(
                "Prometheus sees every GPU", lambda: self.prometheus_gpus() == self.all_gpus(), timeout_s
            )
        except AssertionError as exc:
            a.violations.append(str(exc)[:500])
        a.gpus_in_prometheus = len(self.prometheus_gpus() & self.all_gpus())
        self._audit_chargeback(a, timeout_s)
        return a

    def _cordoned(self) -> set[str]:
        assert self.kube is not None
        return {n.name for n in self.nodes if self.kube.node(n.name).get("spec", {}).get("unschedulable")}

    def _audit_chargeback(self, a: Audit, timeout_s: float) -> None:
        """Every sample in the topic counted once by chargeback, window by window, for the windows
        closed for sure (their end plus grace behind the newest sample of every node)."""
        from tests.integration.chargeback_util import read_to_end

        assert self.cluster is not None
        codec = AvroCodec()
        bs = self.cluster.bootstrap
        samples: dict[int, set[tuple[str, int]]] = defaultdict(set)
        newest: dict[str, int] = {}
        for m in read_to_end(bs, PREFIX + topics.SAMPLES, timeout=60):
            r = codec.decode(m.value()).record
            ts = r["timestamp_ms"]
            samples[ts - ts % WINDOW_MS].add((r["uuid"], ts))
            newest[r["hostname"]] = max(newest.get(r["hostname"], 0), ts)
        if not newest:
            a.violations.append("no sample in the samples topic")
            return
        horizon = min(newest.values()) - GRACE_MS - WINDOW_MS  # closed for sure on every partition
        windows = sorted(w for w in samples if w + WINDOW_MS <= horizon)
        a.chargeback_windows = len(windows)
        a.samples_in_topic = sum(len(samples[w]) for w in windows)

        def charged() -> dict[int, float] | None:
            out: dict[int, float] = defaultdict(float)
            for m in read_to_end(bs, PREFIX + topics.CHARGEBACK, timeout=60):
                r = codec.decode(m.value()).record
                out[r["window_start_ms"]] += r["sample_count"]
            return out if all(out.get(w, 0) >= len(samples[w]) for w in windows) else None

        try:
            per = await_event("chargeback counted every closed window", charged, timeout_s, 1.0)
        except AssertionError as exc:
            a.violations.append(str(exc)[:300])
            per = defaultdict(float)
            for m in read_to_end(bs, PREFIX + topics.CHARGEBACK, timeout=60):
                r = codec.decode(m.value()).record
                per[r["window_start_ms"]] += r["sample_count"]
        a.samples_charged = sum(per.get(w, 0.0) for w in windows)
        a.samples_miscounted = sum(abs(per.get(w, 0.0) - len(samples[w])) for w in windows)
        if a.samples_miscounted:
            a.violations.append(
                f"chargeback miscounted {a.samples_miscounted:g} of {a.samples_in_topic} samples"
            )
        if not windows:
            a.violations.append("no chargeback window closed during the drill")

    # -- end --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop everything this harness started, whatever state it is in (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(30)
        for p in [*self.procs.values(), self.prom, self.am]:
            if p is not None and p.proc is not None:
                with contextlib.suppress(Exception):
                    p.kill9()
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.relay.stop()
            with contextlib.suppress(Exception):
                n.kubelet.close()
        if self.kube is not None:
            with contextlib.suppress(Exception):
                self.kube.stop()
        if self.hook is not None:
            with contextlib.suppress(Exception):
                self.hook.__exit__(None, None, None)
        if self.cluster is not None:
            for node in list(self._paused):  # a stopped process ignores SIGTERM until resumed
                with contextlib.suppress(Exception):
                    self.resume_broker(node)
            subprocess.run([KAFKA_LOCAL, "stop"], env=self._kafka_env, capture_output=True, timeout=120)
        shutil.rmtree(self.sockdir, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)


def short_drill(s: Staging) -> dict[str, float]:
    """The drill of ``make test``: an Xid 79, then at once the samples partition leader, a metrics
    replica and the leading alerts instance SIGKILLed, an Xid 13 while they are down; all restarted.
    Returns its figures (seconds); the audit is the caller's."""
    fig: dict[str, float] = {}
    s.inject_xid(0, 1, 79)
    node = s.kill_leader(topics.SAMPLES)
    s.kill("metrics-b")
    leader = s.alerts_leader()
    assert leader is not None
    s.kill(leader)
    s.inject_xid(1, 0, 13)  # nobody leads alerts now: the standby must page it once it takes over
    t0 = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # the JVM starts while the services do, as in a cluster
        broker = pool.submit(s.start_broker, node)
        fig["metrics_back_s"] = s.restart("metrics-b")
        # The killed leader comes back once the standby leads, as a pod's restart usually comes later
        # than a takeover (restarted sooner, it may win the election: a new leader then starts its
        # uncommitted XID partitions where the group's first leader did; test_ha_gap.py).
        fig["alerts_takeover_s"] = s.await_takeover(leader)
        fig["alerts_back_s"] = s.restart(leader)
        fig["broker_back_s"] = broker.result()
    s.await_ready(120)
    fig["recovery_s"] = time.monotonic() - t0
    fig.update({k: v for k, v in s.timings.items() if k.startswith("last_ready")})
    return fig
