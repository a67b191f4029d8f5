"""A cluster's life in accelerated time: the alerts service and its cordons against ground truth.

Three parts, each usable alone:

* :func:`generate` (pure, seeded): a cluster of nodes with GPUs over N simulated days -- hardware faults
  from NVIDIA's catalog (drain class: 79, 95, 48 with 63/64, 64, 119; benign: 63, 92, 94), application
  faults (13, 31) and job kills (43/45 on every GPU of a job), recoveries by GPU reset, driver reload
  and reboot with the evidence the node agent publishes (samples whose volatile counters restart, the
  driver's load line, a new boot id, healthy samples after), per-node clock skew of a few minutes,
  producer restarts without a kernel-log cursor (the boot's XIDs published again with their original
  times and ids), broker outages (input held and delivered in a burst), and the service's own life:
  restarts every few hours and HA failovers. It returns the input with its delivery times and the
  ground truth: when each GPU was broken and what needs draining.
* :class:`Drill` runs it: one :class:`~gpupipe_consumers.alerts.handler.AlertsHandler` at a time with the
  injected clock, a :class:`~gpupipe_consumers.alerts.cordon.Cordoner` against the Kubernetes API double, an
  :class:`~gpupipe.clients.alertmanager.AlertmanagerSender` posting to :class:`SimAlertmanager`, and the
  published records kept as the topic is, so each new instance restores from them as ``activate()`` does.
* :func:`check` holds what Alertmanager and the cluster saw against the truth and counts violations.

What cannot hold by design, and is therefore generated within bounds rather than checked away: an XID
delivered more than ``--max-event-age`` (6 h) after its own time is history, not a fault (outages here
stay under an hour); a service down longer than Alertmanager's ``endsAt`` (4 x the resend interval)
lets Alertmanager expire its alerts (restarts here take seconds to two minutes); a GPU reset whose
before and after samples straddle a service restart leaves no evidence (sample baselines are not
restored), so its alert waits for an ack or a reboot -- counted as ``stuck_after_recovery``, a liveness
figure, never a safety violation.
"""

from __future__ import annotations

import heapq
import json
import random
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from gpupipe.clients.alertmanager import AlertmanagerSender
from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe.domain.pci import canonical
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from gpupipe_consumers.alerts.cordon import Cordoner, KubeNodeApi
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.plumbing.consume_loop import InRecord

S = 1000
MIN = 60 * S
HOUR = 60 * MIN
DAY = 24 * HOUR
T0 = 1_800_000_000_000
LOOKBACK = DAY  # --restore-lookback
MAX_EVENT_AGE = 6 * HOUR  # --max-event-age


@dataclass(frozen=True, slots=True)
class FaultKind:
    code: int
    message: str
    drain: bool
    """The GPU is broken until recovered, and its node must be drained meanwhile."""
    mends: frozenset[str]
    """Which recoveries end it (``reset``, ``driver``, ``reboot``)."""
    follow: tuple[int, ...] = ()
    """Codes the driver logs right after it for the same fault (48's page retirement)."""


ANY = frozenset({"reset", "driver", "reboot"})
HARDWARE = (
    FaultKind(79, "GPU has fallen off the bus.", True, frozenset({"reboot"})),
    FaultKind(95, "Uncontained: FBHUB. RST: Yes, D-RST: No", True, ANY),
    FaultKind(48, "DBE (double bit error) ECC error", True, ANY, follow=(63,)),
    FaultKind(48, "DBE (double bit error) ECC error", True, ANY, follow=(64,)),
    FaultKind(64, "Dynamic Page Retirement: failed", True, ANY),
    FaultKind(119, "Timeout after 6s of waiting for RPC response from GPU0 GSP!", True, ANY),
)
BENIGN = (
    FaultKind(63, "Dynamic Page Retirement: New page retired", False, frozenset()),
    FaultKind(92, "High single-bit ECC error rate", False, frozenset()),
    FaultKind(94, "Contained: SM (0x1). RST: No, D-RST: No", False, frozenset()),
)
APPLICATION = (
    FaultKind(
        13, "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address", False, frozenset()
    ),
    FaultKind(31, "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_00000000", False, frozenset()),
)


@dataclass(frozen=True)
class DrillConfig:
    seed: int = 1
    days: float = 2.0
    nodes: int = 13
    gpus_per_node: int = 8
    hardware_faults_per_gpu_day: float = 0.03
    app_faults_per_gpu_day: float = 0.1
    benign_faults_per_gpu_day: float = 0.01
    job_kills_per_node_day: float = 0.5
    sample_every_ms: int = 15 * MIN
    restart_every_ms: int = 4 * HOUR
    failover_share: float = 0.3
    outages_per_day: float = 1.0
    upgrades: int = 3
    lost_cursors: int = 2
    max_skew_ms: int = 4 * MIN
    tick_ms: int = 15 * S
    reconcile_ms: int = MIN
    resend_ms: int = MIN
    cordon_max_per_hour: int = 2
    cordon_max_share: float = 0.5


@dataclass(slots=True)
class Fault:
    """One fault of one GPU, in true (not skewed) time; ``recovered_ms`` None: still broken at the end."""

    fid: int
    node: str
    gpu: int
    kind: FaultKind
    at_ms: int
    recovered_ms: int | None = None
    recovery: str = ""
    event_ids: list[str] = field(default_factory=list)

    @property
    def hardware(self) -> bool:
        return self.kind.drain

    def broken_at(self, t: int) -> bool:
        return self.kind.drain and self.at_ms <= t and (self.recovered_ms is None or t < self.recovered_ms)


@dataclass(slots=True)
class Delivery:
    """One input record and when it reaches the service (``at_ms``: the broker delivers it)."""

    at_ms: int
    seq: int
    name: str  # XidEvent | GpuSample
    value: dict[str, Any]
    original: bool = True
    """False for a copy the producer published again (a backlog re-read without its cursor)."""

    def __lt__(self, other: Delivery) -> bool:
        return (self.at_ms, self.seq) < (other.at_ms, other.seq)


@dataclass(frozen=True, slots=True)
class ServiceOp:
    at_ms: int
    kind: str  # restart | failover
    down_ms: int
    replay: int
    """Input records handled but not committed before the crash: the new instance gets them again."""


@dataclass
class Scenario:
    cfg: DrillConfig
    nodes: list[str]
    faults: list[Fault]
    deliveries: list[Delivery]
    ops: list[ServiceOp]
    outages: list[tuple[int, int]]
    end_ms: int
    skews: dict[str, int]

    def hardware(self) -> list[Fault]:
        return [f for f in self.faults if f.hardware]


def _bus(g: int, nvml: bool) -> str:
    b = 0x18 + 16 * g
    return f"00000000:{b:02X}:00.0" if nvml else f"0000:{b:02x}:00"


class _NodeSim:
    """A node's truth while the scenario is generated: boot, counters, lost GPUs, its jobs."""

    def __init__(self, name: str, gpus: int, skew: int) -> None:
        self.name = name
        self.skew = skew
        self.boot = 1
        self.kseq = 100
        # the energy counter as (value, at): it grows with time from there, so samples generated out of
        # time order (the ones around a fault) still read a counter that only a reset lowers
        self.energy: list[tuple[int, int]] = [(1_000_000 * (g + 1), T0) for g in range(gpus)]
        self.dbe = [0] * gpus
        self.lost = [False] * gpus
        self.broken: list[Fault | None] = [None] * gpus
        self.boot_xids: list[dict[str, Any]] = []
        self.job = 0

    def boot_id(self) -> str:
        return f"{self.name}-boot-{self.boot}"


def generate(cfg: DrillConfig) -> Scenario:
    """The scenario for ``cfg`` (pure: same config, same scenario)."""
    rnd = random.Random(cfg.seed)
    span = int(cfg.days * DAY)
    end = T0 + span
    names = [f"node-{i:03d}" for i in range(cfg.nodes)]
    nodes = {n: _NodeSim(n, cfg.gpus_per_node, rnd.randint(-cfg.max_skew_ms, cfg.max_skew_ms)) for n in names}
    faults: list[Fault] = []
    raw: list[tuple[int, str, dict[str, Any]]] = []  # (true time, name, value) before delivery
    republish: list[tuple[int, dict[str, Any]]] = []  # (true time, value) of backlog re-reads

    # what happens, in true time: (time, order, what, args), played in order from a heap
    happenings: list[tuple[int, int, str, tuple[Any, ...]]] = []
    order = 0

    def at(t: int, what: str, *args: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(happenings, (t, order, what, args))

    for n in names:
        for g in range(cfg.gpus_per_node):
            for _ in range(_poisson(rnd, cfg.hardware_faults_per_gpu_day * cfg.days)):
                at(T0 + 30 * MIN + rnd.randrange(span - HOUR), "hw", n, g, rnd.choice(HARDWARE))
            for _ in range(_poisson(rnd, cfg.benign_faults_per_gpu_day * cfg.days)):
                at(T0 + rnd.randrange(span), "fault", n, g, rnd.choice(BENIGN))
            for _ in range(_poisson(rnd, cfg.app_faults_per_gpu_day * cfg.days)):
                at(T0 + rnd.randrange(span), "fault", n, g, rnd.choice(APPLICATION))
        for _ in range(_poisson(rnd, cfg.job_kills_per_node_day * cfg.days)):
            at(T0 + rnd.randrange(span), "kill", n)
        for k in range(int(cfg.days * 4) + 1):  # a new job every ~6 h
            at(T0 + k * 6 * HOUR + rnd.randrange(HOUR), "job", n)
    for _ in range(cfg.upgrades + cfg.lost_cursors):
        at(T0 + 2 * HOUR + rnd.randrange(max(1, span - 3 * HOUR)), "recursor", rnd.choice(names))
    for k in range(1, span // cfg.sample_every_ms):  # every GPU's periodic sample
        at(T0 + k * cfg.sample_every_ms, "samples")

    fid = 0

    def emit_xid(
        node: _NodeSim, g: int, code: int, t: int, msg: str, pid: int | None, f: Fault | None
    ) -> None:
        node.kseq += 1
        ts = t + node.skew
        bus = _bus(g, nvml=False)
        ev = {
            "event_id": f"{node.name}|kmsg|{bus}|xid{code}|{ts}|s{node.kseq}",
            "timestamp_ms": ts,
            "hostname": node.name,
            "kind": "xid",
            "xid": code,
            "pci_bus_id": bus,
            "gpu_index": g,
            "uuid": f"GPU-{node.name}-{g}",
            "pid": pid,
            "process_name": "python3" if pid else None,
            "message": msg,
            "source": "kmsg",
            "boot_id": node.boot_id(),
            "allocations": [{"namespace": "ml", "pod": f"{node.name}-job-{node.job}", "container": "main"}],
        }
        raw.append((t, "XidEvent", ev))
        node.boot_xids.append(ev)
        if f is not None:
            f.event_ids.append(ev["event_id"])

    def emit_driver_load(node: _NodeSim, t: int) -> None:
        node.kseq += 1
        ts = t + node.skew
        ev = {
            "event_id": f"{node.name}|kmsg||driver_loaded|{ts}|s{node.kseq}",
            "timestamp_ms": ts,
            "hostname": node.name,
            "kind": "driver_loaded",
            "xid": None,
            "pci_bus_id": "",
            "gpu_index": None,
            "uuid": None,
            "driver_version": "580.65.06",
            "pid": None,
            "process_name": None,
            "message": "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.65.06",
            "source": "kmsg",
            "boot_id": node.boot_id(),
            "allocations": [],
        }
        raw.append((t, "XidEvent", ev))
        node.boot_xids.append(ev)

    def emit_sample(node: _NodeSim, g: int, t: int) -> None:
        s = {
            "timestamp_ms": t + node.skew,
            "hostname": node.name,
            "pci_bus_id": _bus(g, nvml=True),
            "uuid": f"GPU-{node.name}-{g}",
            "gpu_index": g,
            "total_energy_mj": node.energy[g][0] + max(0, t - node.energy[g][1]) * 5_000 // (15 * MIN),
            "ecc_dbe_volatile_total": node.dbe[g],
            "ecc_sbe_volatile_total": 0,
            "gpu_recovery_action": 0,
            "gpu_lost": node.lost[g],
            "allocations": [{"namespace": "ml", "pod": f"{node.name}-job-{node.job}", "container": "main"}],
        }
        raw.append((t, "GpuSample", s))

    while happenings:
        t, _, what, args = heapq.heappop(happenings)
        if what == "samples":
            for node in nodes.values():
                for g in range(cfg.gpus_per_node):
                    emit_sample(node, g, t)
            continue
        node = nodes[args[0]] if args else nodes[names[0]]
        if what == "job":
            node.job += 1
        elif what == "recursor":  # the agent starts without its cursor: the boot's kernel log again
            republish.extend((t + rnd.randrange(5 * S), ev) for ev in node.boot_xids)
        elif what == "kill":  # a job killed on every GPU: Xid 43 or 45 within milliseconds
            code = rnd.choice((43, 45))
            for g in range(cfg.gpus_per_node):
                if not node.lost[g]:  # a GPU off the bus runs no job and logs nothing but its loss
                    emit_xid(node, g, code, t + g, "Ch 00000008", 1000 + node.job, None)
        elif what == "fault":  # application or benign: the GPU goes on working
            g, kind = args[1], args[2]
            pid = 2000 + rnd.randrange(100) if kind in APPLICATION else None
            if node.lost[g]:
                continue  # off the bus: no job runs on it, no page is retired
            fid += 1
            f = Fault(fid, node.name, g, kind, t)
            faults.append(f)
            emit_xid(node, g, kind.code, t, kind.message, pid, f)
        elif what == "hw":
            g, kind = args[1], args[2]
            if node.broken[g] is not None or t >= end - 2 * HOUR:
                continue  # a broken GPU is off duty: no second fault until it is mended
            fid += 1
            f = Fault(fid, node.name, g, kind, t)
            faults.append(f)
            node.broken[g] = f
            emit_sample(node, g, t - 30 * S)  # the 30 s samples around it: the baseline a reset needs
            emit_xid(node, g, kind.code, t, kind.message, None, f)
            for i, code in enumerate(kind.follow):
                emit_xid(node, g, code, t + 200 * (i + 1), "", None, f)
            if kind.code == 48:
                node.dbe[g] += 1
            if kind.code == 79:
                node.lost[g] = True
            emit_sample(node, g, t + 30 * S)
            rt = t + 40 * MIN + rnd.randrange(2 * DAY)
            if rnd.random() >= 0.1 and rt < end - HOUR:  # some stay broken to the end
                at(rt, "recover", node.name, g, rnd.choice(sorted(kind.mends)))
        elif what == "recover":
            _recover(node, args[1], args[2], t, cfg, emit_sample, emit_driver_load)

    raw.sort(key=lambda x: x[0])
    deliveries, outages = _deliver(rnd, cfg, raw, republish, end)
    ops = _service_ops(rnd, cfg, end)
    skews = {n: nodes[n].skew for n in names}
    return Scenario(cfg, names, faults, deliveries, ops, outages, end, skews)


def _recover(
    node: _NodeSim,
    g: int,
    how: str,
    t: int,
    cfg: DrillConfig,
    emit_sample: Callable[[_NodeSim, int, int], None],
    emit_driver_load: Callable[[_NodeSim, int], None],
) -> None:
    """A GPU reset restarts that GPU's counters; a driver reload or a reboot every GPU's, with the
    driver's load line (under a new boot id after a reboot) in the kernel log; each followed by the
    30 s samples that show the GPUs healthy. What the recovery mends is mended (a reset leaves a GPU
    that fell off the bus broken; a driver reload too)."""
    if node.broken[g] is None:  # mended meanwhile by a node-wide recovery
        return
    gpus = [g] if how == "reset" else list(range(cfg.gpus_per_node))
    for x in gpus:
        emit_sample(node, x, t - 30 * S)
    if how == "reboot":
        node.boot += 1
        node.boot_xids = []
    if how != "reset":
        emit_driver_load(node, t + 20 * S)
    for x in gpus:
        f = node.broken[x]
        if f is not None and how not in f.kind.mends:
            continue  # still broken: a lost GPU stays lost, its counters say nothing
        node.energy[x] = (1_000 + x, t)
        node.dbe[x] = 0
        if f is not None:
            f.recovered_ms, f.recovery = t, how
            node.broken[x] = None
            node.lost[x] = False
    for x in gpus:
        emit_sample(node, x, t + 30 * S)
        emit_sample(node, x, t + 60 * S)


def _poisson(rnd: random.Random, lam: float) -> int:
    n, p, limit = 0, 1.0, pow(2.718281828459045, -lam)
    while True:
        p *= rnd.random()
        if p <= limit:
            return n
        n += 1


def _deliver(
    rnd: random.Random,
    cfg: DrillConfig,
    raw: list[tuple[int, str, dict[str, Any]]],
    republish: list[tuple[int, dict[str, Any]]],
    end: int,
) -> tuple[list[Delivery], list[tuple[int, int]]]:
    """When the broker hands each record to the service: about a second after it happened, or at the end
    of a broker outage (held by the producers' spools and queues, then delivered in a burst). Records of
    one GPU keep their order, as Kafka keeps a key's (one partition, one producer): a fault's page
    retirement, 200 ms after it, never overtakes it."""
    outages: list[tuple[int, int]] = []
    for _ in range(_poisson(rnd, cfg.outages_per_day * cfg.days)):
        start = T0 + HOUR + rnd.randrange(max(1, end - T0 - 3 * HOUR))
        outages.append((start, start + 2 * MIN + rnd.randrange(40 * MIN)))
    outages.sort()
    out: list[Delivery] = []
    seq = 0

    def when(t: int) -> int:
        d = t + 200 + rnd.randrange(1500)
        for a, b in outages:
            if a <= d < b:
                return b + rnd.randrange(30 * S)
        return d

    last: dict[tuple[str, str], int] = {}  # (host, GPU) -> delivery time of its latest record
    for t, name, value in raw:
        seq += 1
        key = (
            str(value.get("hostname")),
            str(value.get("mig_uuid") or value.get("uuid") or value.get("pci_bus_id")),
        )
        at = max(when(t), last.get(key, 0))
        last[key] = at
        out.append(Delivery(at, seq, name, value))
    for t, value in republish:
        seq += 1
        out.append(Delivery(when(t), seq, "XidEvent", dict(value), original=False))
    out.sort()
    return [d for d in out if d.at_ms < end], outages


def _service_ops(rnd: random.Random, cfg: DrillConfig, end: int) -> list[ServiceOp]:
    ops: list[ServiceOp] = []
    t = T0
    while True:
        t += cfg.restart_every_ms // 2 + rnd.randrange(cfg.restart_every_ms)
        if t >= end:
            return ops
        if rnd.random() < cfg.failover_share:  # the leader dies; the standby takes over in ~10 s
            ops.append(ServiceOp(t, "failover", 6 * S + rnd.randrange(5 * S), rnd.randrange(20)))
        else:  # a redeploy or a crash: a new pod restores and resumes
            ops.append(ServiceOp(t, "restart", 20 * S + rnd.randrange(100 * S), rnd.randrange(50)))


# ------------------------------------------------------------------------------------- Alertmanager


def _ms(iso: str) -> int:
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000)


LabelKey = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class AmEvent:
    at_ms: int
    kind: str  # page | resolved
    labels: dict[str, str]
    annotations: dict[str, str]


class SimAlertmanager:
    """Alertmanager's view of alerts, on the drill's clock: an alert is its label set; it fires from a
    post whose ``endsAt`` is ahead until ``endsAt`` passes (sent resolved, or expired because nobody
    re-sent it). A label set that starts firing is a page; one that stops is a RESOLVED; firing again
    after that is a second page."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.ends: dict[LabelKey, int] = {}
        self.last: dict[LabelKey, dict[str, Any]] = {}
        self.events: list[AmEvent] = []
        self.posts = 0
        self.up = True

    def expire(self, now: int) -> None:
        for key, ends in list(self.ends.items()):
            if ends <= now:
                a = self.last[key]
                self.events.append(AmEvent(ends, "resolved", dict(key), a["annotations"]))
                del self.ends[key]

    def post(self, url: str, body: bytes, timeout_s: float) -> int:
        if not self.up:
            raise ConnectionRefusedError("alertmanager down")
        now = self.clock()
        self.expire(now)
        self.posts += 1
        for a in json.loads(body):
            key: LabelKey = tuple(sorted(a["labels"].items()))
            ends = _ms(a["endsAt"])
            firing = key in self.ends
            self.last[key] = a
            if ends > now:
                if not firing:
                    self.events.append(AmEvent(now, "page", dict(key), a["annotations"]))
                self.ends[key] = ends
            elif firing:
                self.events.append(AmEvent(now, "resolved", dict(key), a["annotations"]))
                del self.ends[key]
        return 200


# ---------------------------------------------------------------------------------------- the drill


class _Topic:
    """``gpu.alerts.v1`` as far as a restore reads it: what was acknowledged, in order."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []


class _TopicSink(ListSink):
    """The service's sink: records reach the topic when the broker is up; during an outage they wait
    (as the real sink's flush does) and a crash meanwhile loses them, with the input not committed."""

    def __init__(self, topic: _Topic, broker_up: Callable[[], bool]) -> None:
        super().__init__()
        self.topic = topic
        self.broker_up = broker_up
        self.held: list[dict[str, Any]] = []

    def send(self, record: dict[str, Any]) -> None:
        super().send(record)
        self.held.append(record)
        self.deliver()

    def deliver(self) -> None:
        if self.held and self.broker_up():
            self.topic.records.extend(self.held)
            self.held.clear()


@dataclass
class Instance:
    service: AlertsHandler
    sink: _TopicSink
    sender: AlertmanagerSender


class Drill:
    """Runs a :class:`Scenario` (see module doc). ``api`` is the Kubernetes API double holding the nodes;
    ``make_sender`` gives each service instance its Alertmanager sender in place of one posting to
    :class:`SimAlertmanager` (the real-Alertmanager leg, tests/life_drill_am.py); ``on_step`` is called
    with the drill's time after every tick."""

    def __init__(
        self,
        sc: Scenario,
        api: Any,
        tmp: Path,
        *,
        make_sender: Callable[[], AlertmanagerSender] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.sc = sc
        self.cfg = sc.cfg
        self.api = api
        self.now = T0
        self.am = SimAlertmanager(lambda: self.now)
        self._make_sender = make_sender
        self._on_step = on_step
        token = tmp / "token"
        token.write_text("tok")
        self.kube = KubeNodeApi(KubeClient(KubeConfig(api.url, str(token), None), timeout_s=5))
        self.topic = _Topic()
        self.handled_at: dict[int, int] = {}  # delivery seq -> first handled
        self.rejected: list[tuple[InRecord, str, str]] = []
        self.cordon_log: list[tuple[int, str, bool]] = []  # (time, node, unschedulable now)
        self._unsched = {n: False for n in sc.nodes}
        self.instances = 0
        self.inst: Instance | None = None

    def _clock_s(self) -> float:
        return self.now / 1000

    def _broker_up(self) -> bool:
        return not any(a <= self.now < b for a, b in self.sc.outages)

    def _start(self) -> Instance:
        holder: dict[str, AlertsHandler] = {}
        sink = _TopicSink(self.topic, self._broker_up)
        cordoner = Cordoner(
            self.kube,
            dry_run=False,
            max_per_hour=self.cfg.cordon_max_per_hour,
            max_share=self.cfg.cordon_max_share,
            uncordon=True,
            on_result=lambda r: holder["svc"].on_cordon_result(r),
            instance=f"i{self.instances}",
            clock=self._clock_s,
        )
        sender = (
            self._make_sender()
            if self._make_sender is not None
            else AlertmanagerSender(
                "http://am",
                shape=gpu_alert_shape,
                resend_interval_ms=self.cfg.resend_ms,
                post=self.am.post,
                clock=self._clock_s,
            )
        )
        svc = AlertsHandler(
            sink=sink,
            registry=CollectorRegistry(),
            alertmanager=sender,
            cordoner=cordoner,
            clock=self._clock_s,
            instance=f"i{self.instances}",
            reconcile_interval_ms=self.cfg.reconcile_ms,
        )
        holder["svc"] = svc
        self.instances += 1
        # what activate() reads: the look-back of the topic, the ledger at least the last hour
        ledger = [r for r in self.topic.records if r["emitted_at_ms"] >= self.now - max(LOOKBACK, HOUR)]
        alerts = [r for r in ledger if r["emitted_at_ms"] >= self.now - LOOKBACK]
        svc.restore(alerts, ledger=ledger)
        return Instance(svc, sink, sender)

    def _work(self, inst: Instance) -> None:
        """The cordon worker's and the sender's turn, then the nodes as the API now holds them."""
        c = inst.service.cordoner
        assert c is not None
        while not c._queue.empty():
            item = c._queue.get_nowait()
            if item is not None:
                c._run_one(item)
        inst.sender.step(None if self._make_sender is not None else self.now)
        inst.sink.deliver()
        for n in self.sc.nodes:
            u = bool((self.api.node(n).get("spec") or {}).get("unschedulable"))
            if u != self._unsched[n]:
                self._unsched[n] = u
                self.cordon_log.append((self.now, n, u))

    def run(self) -> Drill:
        sc, cfg = self.sc, self.cfg
        ops = list(sc.ops)
        inst = self._start()
        i = 0
        n = len(sc.deliveries)
        pending: list[Delivery] = []  # delivered by the broker, not yet consumed (service down)
        down_until = 0
        uncommitted: list[Delivery] = []
        t = T0
        while t < sc.end_ms:
            t += cfg.tick_ms
            self.now = t
            if ops and ops[0].at_ms <= t:  # the instance dies; its successor starts after the gap
                op = ops.pop(0)
                down_until = op.at_ms + op.down_ms
                replay = uncommitted[-op.replay :] if op.replay else []
                pending[:0] = replay  # not committed: consumed again
                self.inst = None
            while i < n and sc.deliveries[i].at_ms <= t:
                pending.append(sc.deliveries[i])
                i += 1
            if t < down_until:
                self.am.expire(t)
                continue
            if self.inst is None and t >= down_until:
                inst = self.inst = self._start()
            self.inst = inst
            if pending:
                batch = [
                    InRecord(
                        "gpu.xid.v1" if d.name == "XidEvent" else "gpu.samples.v1",
                        0,
                        d.seq,
                        None,
                        d.name,
                        d.value,
                        d.at_ms,
                    )
                    for d in pending
                ]
                for d in pending:
                    self.handled_at.setdefault(d.seq, t)
                self.rejected.extend(inst.service.handle(batch))
                uncommitted = (uncommitted + pending)[-100:]
                pending = []
            inst.service.tick()
            self._work(inst)
            self.am.expire(t)
            if self._on_step is not None:
                self._on_step(t)
        inst.service.flush()
        self._work(inst)
        return self


# --------------------------------------------------------------------------------------- the checker


@dataclass
class Verdict:
    hardware_faults: int = 0
    paged_once: int = 0
    unpaged: list[Fault] = field(default_factory=list)
    repaged: list[tuple[Fault, int]] = field(default_factory=list)
    resolved_while_broken: list[tuple[AmEvent, Fault]] = field(default_factory=list)
    false_drains: list[tuple[int, str]] = field(default_factory=list)
    lost_drains: list[Fault] = field(default_factory=list)
    refused_by_limit: int = 0
    uncordoned_while_broken: list[tuple[int, str, Fault]] = field(default_factory=list)
    lost_xids: list[dict[str, Any]] = field(default_factory=list)
    history_xids: int = 0
    stuck_after_recovery: list[Fault] = field(default_factory=list)
    pages: int = 0
    restarts: int = 0
    cordons: int = 0
    xids: int = 0

    def violations(self) -> dict[str, int]:
        return {
            "unpaged": len(self.unpaged),
            "repaged": len(self.repaged),
            "resolved_while_broken": len(self.resolved_while_broken),
            "false_drains": len(self.false_drains),
            "lost_drains": len(self.lost_drains),
            "uncordoned_while_broken": len(self.uncordoned_while_broken),
            "lost_xids": len(self.lost_xids),
        }

    def pages_per_fault(self) -> float:
        paged = self.paged_once + len(self.repaged)
        total = sum(n for _, n in self.repaged) + self.paged_once
        return total / paged if paged else 0.0


def _gpu_of(labels: dict[str, str]) -> tuple[str, str] | None:
    bus = labels.get("pci_bus_id")
    if not bus or labels.get("scope") != "gpu":
        return None
    return labels["node"], canonical(bus)


class AmView(Protocol):
    """Pages and RESOLVEDs in the drill's time, and the label sets firing at its end."""

    events: list[AmEvent]
    ends: dict[LabelKey, int]


def check(d: Drill, am: AmView | None = None) -> Verdict:
    """Hold what Alertmanager sent (``am``; by default the simulated one's) and what the cluster did
    against the scenario's truth."""
    sc = d.sc
    am = am if am is not None else d.am
    v = Verdict(restarts=d.instances - 1, xids=0)
    v.pages = sum(1 for e in am.events if e.kind == "page")
    by_gpu: dict[tuple[str, str], list[Fault]] = defaultdict(list)
    for f in sc.faults:
        by_gpu[(f.node, canonical(_bus(f.gpu, nvml=False)))].append(f)
    hw = sc.hardware()
    v.hardware_faults = len(hw)
    # Alertmanager: pages and RESOLVEDs of each GPU's label sets while it is broken
    gpu_events: dict[tuple[str, str], list[AmEvent]] = defaultdict(list)
    for e in am.events:
        gk = _gpu_of(e.labels)
        # an application fault's alert (a job's Xid 13/31/43/45 on a GPU that is also broken) is the
        # job's, not the hardware fault's: neither its page nor its RESOLVED is the fault's
        if gk is not None and e.labels.get("cause_class") != "application":
            gpu_events[gk].append(e)
    for f in hw:
        gk = (f.node, canonical(_bus(f.gpu, nvml=False)))
        until = f.recovered_ms if f.recovered_ms is not None else sc.end_ms + 1
        pages = [e for e in gpu_events[gk] if e.kind == "page" and f.at_ms <= e.at_ms < until]
        if not pages:
            v.unpaged.append(f)
        elif len(pages) > 1:
            v.repaged.append((f, len(pages)))
        else:
            v.paged_once += 1
        for e in gpu_events[gk]:
            if e.kind == "resolved" and f.broken_at(e.at_ms):
                v.resolved_while_broken.append((e, f))
    # the cluster: every cordon while a drain fault the service knew of was open; no uncordon while broken
    handled = d.handled_at
    first_seen: dict[str, int] = {}
    for dl in sc.deliveries:
        if dl.name == "XidEvent" and dl.original and dl.seq in handled:
            first_seen.setdefault(dl.value["event_id"], handled[dl.seq])
    limited = {
        (r["remediation"]["node"], r["remediation"]["at_ms"])
        for r in d.topic.records
        if r["status"] == "action" and (r.get("remediation") or {}).get("outcome") == "rate_limited"
    }
    evidence = _EvidenceIndex(sc, handled)
    for t, node, unsched in d.cordon_log:
        faults = [f for f in hw if f.node == node]
        if unsched:
            v.cordons += 1
            known = [f for f in faults if f.broken_at(t) or _known_open(f, first_seen, evidence, t)]
            if not known:
                v.false_drains.append((t, node))
        else:
            for f in faults:
                if f.broken_at(t):
                    v.uncordoned_while_broken.append((t, node, f))
    for f in hw:
        seen = [first_seen[e] for e in f.event_ids if e in first_seen]
        if not seen:
            continue
        t0 = min(seen)
        until = f.recovered_ms if f.recovered_ms is not None else sc.end_ms
        if until - t0 < 10 * MIN:
            continue
        drained = _unsched_during(d, f.node, t0, until)
        if not drained:
            if any(n == f.node and t0 <= at <= until for n, at in limited):
                v.refused_by_limit += 1
            else:
                v.lost_drains.append(f)
    # XIDs: every original XID counted in an alert record spanning its time, or delivered as history
    spans: dict[tuple[str, str], list[tuple[int, int, set[int]]]] = defaultdict(list)
    for r in d.topic.records:
        if r["status"] in ("firing", "resolved") and r["scope"] == "gpu" and r.get("pci_bus_id"):
            spans[(r["hostname"], canonical(r["pci_bus_id"]))].append(
                (r["first_seen_ms"], r["last_seen_ms"], set(r["xid_codes"]))
            )
    for dl in sc.deliveries:
        ev = dl.value
        if dl.name != "XidEvent" or not dl.original or ev["kind"] != "xid":
            continue
        v.xids += 1
        if dl.seq not in handled:
            v.lost_xids.append(ev)
            continue
        if handled[dl.seq] - ev["timestamp_ms"] > MAX_EVENT_AGE:
            v.history_xids += 1
            continue
        gk = (ev["hostname"], canonical(ev["pci_bus_id"]))
        ts, code = ev["timestamp_ms"], ev["xid"]
        if not any(a <= ts <= b and code in codes for a, b, codes in spans[gk]):
            v.lost_xids.append(ev)
    # liveness: a fault recovered an hour before the end whose alert still fires (a job's alert on the
    # GPU, raised in the last minutes, is not the fault's)
    open_now = {
        (k[0], k[1])
        for k, labels in ((_gpu_of(dict(key)), dict(key)) for key in am.ends)
        if k is not None and labels.get("cause_class") != "application"
    }
    for f in hw:
        gk = (f.node, canonical(_bus(f.gpu, nvml=False)))
        if f.recovered_ms is not None and f.recovered_ms < sc.end_ms - HOUR and gk in open_now:
            later = [g for g in by_gpu[gk] if g.hardware and g.at_ms > f.at_ms]
            if not any(g.broken_at(sc.end_ms) for g in later):
                v.stuck_after_recovery.append(f)
    return v


class _EvidenceIndex:
    """When the service first handled a record of a node stamped at or after a time: the earliest it
    could know of a recovery at that time."""

    def __init__(self, sc: Scenario, handled: dict[int, int]) -> None:
        per: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for dl in sc.deliveries:
            if dl.seq in handled:
                per[dl.value["hostname"]].append((dl.value["timestamp_ms"], handled[dl.seq]))
        self._ts: dict[str, list[int]] = {}
        self._min: dict[str, list[int]] = {}
        for node, rows in per.items():
            rows.sort()
            suffix = [0] * len(rows)
            best = 2**63
            for i in range(len(rows) - 1, -1, -1):
                best = min(best, rows[i][1])
                suffix[i] = best
            self._ts[node] = [r[0] for r in rows]
            self._min[node] = suffix
        self.skews = sc.skews

    def known_at(self, node: str, true_ms: int) -> int | None:
        ts = self._ts.get(node, [])
        i = bisect_left(ts, true_ms + self.skews.get(node, 0))
        return self._min[node][i] if i < len(ts) else None


def _known_open(f: Fault, first_seen: dict[str, int], ev: _EvidenceIndex, t: int) -> bool:
    """Whether at ``t`` the service had seen fault ``f`` and not yet any record after its recovery (a
    cordon then is right by what it knew: the recovery's records were still on their way)."""
    seen = [first_seen[e] for e in f.event_ids if e in first_seen]
    if not seen or min(seen) > t:
        return False
    if f.recovered_ms is None:
        return True
    known = ev.known_at(f.node, f.recovered_ms)
    return known is None or known > t


def _unsched_during(d: Drill, node: str, a: int, b: int) -> bool:
    state = False
    for t, n, u in d.cordon_log:
        if n != node:
            continue
        if t > b:
            break
        if t >= a and u:
            return True
        state = u
    return state


__all__ = [
    "DAY",
    "HOUR",
    "MIN",
    "T0",
    "AmEvent",
    "AmView",
    "Drill",
    "DrillConfig",
    "Fault",
    "LabelKey",
    "S",
    "Scenario",
    "SimAlertmanager",
    "Verdict",
    "check",
    "generate",
]
