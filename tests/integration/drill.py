"""Start-order, outage and restart drills over the whole pipeline (real broker, real CLI services).

Shared by tests/integration/test_drills.py (a short outage) and bench/bench_outage_drill.py (the
30 s outage of the issue). One run:

1. every service (simulated producer, metrics, chargeback, alerts) starts BEFORE the broker exists
   and must answer 503 "starting" on /healthz; then the broker starts (no topics: the services race
   to create them) and every service must become ready;
2. under load, the broker is killed with SIGKILL, kept down ``down_s``, and restarted on the same
   data; every service must recover (ready, metrics fresh again) without exiting;
3. metrics, chargeback and alerts are each stopped (SIGTERM, timed) and started again in turn;
4. the producer finishes its ``--duration`` and must exit 0 (nothing undelivered); then: every XID
   the simulated fleet made is in gpu.xid.v1 once, chargeback's closed windows count every sample
   exactly once, and each (GPU, XID) alert counts every occurrence, with no alert published twice;
5. the broker is killed again and every consumer gets SIGTERM: each must be gone within its 10 s
   shutdown budget (a second producer was already stopped the same way during the outage).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpupipe.kafka import topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.conftest import BROKER_START_TIMEOUT, REPO, _free_pair, free_port
from tests.hygiene import popen, stop_group
from tests.integration.kafka_util import GPUPIPE, read_all

PREFIX = "drill."
NODES, GPUS, INTERVAL_MS, SEED, XID_RATE = 2, 2, 1000, 5, 900.0
WINDOW_MS, GRACE_MS = 10_000, 3_000


def _health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=3) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait(fn: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except OSError as exc:  # not listening yet
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")


class Broker:
    """scripts/kafka-local with its own state dir and port; kill -9 keeps the data for a restart."""

    def __init__(self, state: Path) -> None:
        self.port = _free_pair()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "KAFKA_LOCAL_DIR": str(state),
            "KAFKA_PORT": str(self.port),
            "KAFKA_CONTROLLER_PORT": str(self.port + 1),
            **BROKER_START_TIMEOUT,
        }
        self.script = str(REPO / "scripts" / "kafka-local")
        self.state = state
        self.started = False

    def start(self) -> None:
        out = subprocess.run(
            [self.script, "start", "--port", str(self.port)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        self.started = True

    def kill9(self) -> None:
        pid = int((self.state / "kafka.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        wait(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 30, "broker gone")

    def stop(self) -> None:
        if self.started:
            subprocess.run([self.script, "stop"], env=self.env, capture_output=True, timeout=120)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class Service:
    name: str
    argv: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        out = open(self.log, "ab")  # noqa: SIM115 (closed with the process)
        self.proc = popen(
            [*GPUPIPE, *self.argv, "--listen", f"127.0.0.1:{self.port}", "--log-format", "text"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        out.close()

    def health(self) -> tuple[int, dict[str, Any]]:
        assert self.proc is not None and self.proc.poll() is None, self.died()
        return _health(self.port)

    def ready(self) -> bool:
        return self.health()[0] == 200

    def starting(self) -> bool:
        code, body = self.health()
        return code == 503 and body.get("status") == "starting"

    def died(self) -> str:
        rc = None if self.proc is None else self.proc.poll()
        return f"{self.name} exited with {rc}: {self.log.read_text()[-3000:]}"

    def sigterm(self) -> tuple[int, float]:
        """SIGTERM; (exit status, seconds to exit)."""
        assert self.proc is not None
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            rc = stop_group(self.proc, timeout=1)
        return rc, time.monotonic() - began

    def consumed(self) -> float:
        """Records consumed so far, from the service's own /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(
                ("gpupipe_consumer_records_total{", "gpupipe_chargeback_records_consumed_total")
            )
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc, signal.SIGKILL, timeout=1)


@dataclass
class Figures:
    """What a drill measured (seconds, counts)."""

    broker_start_to_all_ready_s: float = 0.0
    outage_s: float = 0.0
    broker_restart_s: float = 0.0
    recover_after_broker_back_s: dict[str, float] = field(default_factory=dict)
    shutdown_s: dict[str, float] = field(default_factory=dict)
    restart_ready_s: dict[str, float] = field(default_factory=dict)
    shutdown_broker_down_s: dict[str, float] = field(default_factory=dict)
    shutdown_broker_down_rc: dict[str, int] = field(default_factory=dict)
    xids_expected: int = 0
    xids_in_topic: int = 0
    xids_lost: int = 0
    xids_duplicated: int = 0
    samples_checked: int = 0
    samples_miscounted: int = 0
    alert_gpus: int = 0
    alert_occurrences_lost: int = 0
    alert_records_duplicated: int = 0
    producer_stop_rc: int | None = None
    producer_stop_line: str = ""
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.__dict__.items()]


def expected_fleet(start_ms: int, ticks: int) -> tuple[list[dict[str, Any]], int]:
    """(every XID the simulated producer makes, samples per tick): the fleet is deterministic."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=NODES,
            gpus_per_node=GPUS,
            interval_ms=INTERVAL_MS,
            seed=SEED,
            xid_rate_per_gpu_hour=XID_RATE,
        )
    )
    xids: list[dict[str, Any]] = []
    per_tick = 0
    for k in range(ticks):
        samples, x = fleet.tick(start_ms + k * INTERVAL_MS)
        per_tick = len(samples)
        xids += x
    return xids, per_tick


def run_drill(tmp: Path, down_s: float, run_s: int, restarts: bool = True) -> Figures:
    """The whole drill; returns its figures (assertions on them are the caller's)."""
    fig = Figures()
    broker = Broker(tmp / "kafka")
    bs = broker.bootstrap
    now = int(time.time() * 1000)
    start_ms = now - now % WINDOW_MS
    ticks = run_s * 1000 // INTERVAL_MS
    common = ["--bootstrap-servers", bs, "--topic-prefix", PREFIX, "--startup-timeout", "0"]
    producer = Service(
        "producer",
        [
            "produce",
            *common,
            "--source",
            "simulated",
            "--nodes",
            str(NODES),
            "--gpus-per-node",
            str(GPUS),
            "--interval",
            f"{INTERVAL_MS}ms",
            "--seed",
            str(SEED),
            "--xid-rate",
            str(XID_RATE),
            "--start-time",
            datetime.fromtimestamp(start_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "--duration",
            f"{run_s}s",
        ],
        tmp / "producer.log",
    )
    metrics = Service("metrics", ["metrics", *common, "--stale-after", "5m"], tmp / "metrics.log")
    chargeback = Service(
        "chargeback",
        [
            "chargeback",
            *common,
            "--window",
            f"{WINDOW_MS}ms",
            "--grace",
            f"{GRACE_MS}ms",
            "--instance-id",
            "drill-0",
            "--start",
            "earliest",
        ],
        tmp / "chargeback.log",
    )
    alerts = Service(
        "alerts",
        ["alerts", *common, "--update-interval", "0s", "--node-burst-gpus", "99", "--from-beginning"],
        tmp / "alerts.log",
    )
    # A second producer (own topics), stopped while the broker is down: it must exit within its
    # shutdown budget and say in one line what it could not deliver.
    spare = Service(
        "producer-2",
        [
            "produce",
            *common[:2],
            "--source",
            "simulated",
            "--topic-prefix",
            "drill2.",
            "--startup-timeout",
            "0",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--xid-rate",
            "36000",
        ],
        tmp / "producer-2.log",
    )
    consumers = [metrics, chargeback, alerts]
    services = [producer, spare, *consumers]
    try:
        # 1. services first, broker second, no topics yet
        for s in services:
            s.start()
        for s in services:
            wait(s.starting, 60, f"{s.name} answering 503 starting")
        t0 = time.monotonic()
        broker.start()
        for s in services:
            wait(s.ready, 120, f"{s.name} ready once the broker is up")
        fig.broker_start_to_all_ready_s = round(time.monotonic() - t0, 1)
        wait(lambda: _gpus(metrics) >= 1, 60, "metrics serving GPUs")

        # 2. kill -9 the broker under load, keep it down, bring it back
        time.sleep(3)
        broker.kill9()
        t_down = time.monotonic()
        time.sleep(2)
        rc, took = spare.sigterm()
        fig.shutdown_s["producer_broker_down"] = round(took, 2)
        fig.producer_stop_line = spare.log.read_text().strip().splitlines()[-1]
        fig.producer_stop_rc = rc
        time.sleep(max(0.0, down_s - (time.monotonic() - t_down)))
        for s in [producer, *consumers]:
            assert s.proc is not None and s.proc.poll() is None, s.died()
        t_restart = time.monotonic()
        fig.outage_s = round(t_restart - t_down, 1)
        broker.start()
        t_back = time.monotonic()
        fig.broker_restart_s = round(t_back - t_restart, 1)
        before = {s.name: s.consumed() for s in consumers}
        for s in consumers:  # recovered = consuming again (and chargeback committing again)
            wait(lambda s=s: s.ready() and s.consumed() > before[s.name], 120, f"{s.name} consuming again")
            if s is chargeback:
                wait(lambda: _committing(chargeback), 120, "chargeback committing again")
            fig.recover_after_broker_back_s[s.name] = round(time.monotonic() - t_back, 1)

        # 3. restart each consumer in turn under load
        if restarts:
            for s in consumers:
                rc, took = s.sigterm()
                assert rc == 0, s.died()
                fig.shutdown_s[s.name] = round(took, 2)
                t = time.monotonic()
                s.start()
                wait(s.ready, 120, f"{s.name} ready after its restart")
                fig.restart_ready_s[s.name] = round(time.monotonic() - t, 1)

        # 4. the producer finishes its duration and must have delivered everything
        assert producer.proc is not None
        rc = producer.proc.wait(run_s + 120)
        assert rc == 0, producer.died()
        _verify(fig, bs, start_ms, ticks, chargeback, alerts)

        # 5. stop every consumer with the broker gone (kill -9 again): each within its 10 s budget
        broker.kill9()
        time.sleep(1)
        began = time.monotonic()
        for s in consumers:
            assert s.proc is not None
            s.proc.send_signal(signal.SIGTERM)
        for s in consumers:
            assert s.proc is not None
            try:
                rc = s.proc.wait(30)
            except subprocess.TimeoutExpired:
                rc = stop_group(s.proc, timeout=1)
            fig.shutdown_broker_down_s[s.name] = round(time.monotonic() - began, 2)
            fig.shutdown_broker_down_rc[s.name] = rc
        return fig
    finally:
        for s in services:
            s.kill()
        broker.stop()


def _gpus(metrics: Service) -> int:
    code, body = metrics.health()
    return int(body.get("gpus") or 0) if code == 200 else 0


def _committing(chargeback: Service) -> bool:
    code, body = chargeback.health()
    return code == 200 and float(body.get("seconds_since_commit", 99)) < 3.0


def _verify(fig: Figures, bs: str, start_ms: int, ticks: int, chargeback: Service, alerts: Service) -> None:
    codec = AvroCodec()
    want, per_tick = expected_fleet(start_ms, ticks)
    fig.xids_expected = len(want)
    got = [codec.decode(m.value()).record for m in read_all(bs, PREFIX + topics.XID, expect=len(want))]
    ids = Counter(x["event_id"] for x in got)
    fig.xids_in_topic = len(got)
    fig.xids_lost = len({x["event_id"] for x in want} - set(ids))
    fig.xids_duplicated = sum(n - 1 for n in ids.values() if n > 1)

    # chargeback: every window that closed for sure counts every sample once
    last_ms = start_ms + (ticks - 1) * INTERVAL_MS
    closed = [w for w in range(start_ms, last_ms, WINDOW_MS) if w + WINDOW_MS + GRACE_MS <= last_ms]
    out = _read_chargeback(bs, len(closed), chargeback)
    per_window: dict[int, float] = defaultdict(float)
    for r in out:
        per_window[r["window_start_ms"]] += r["sample_count"]
    fig.samples_checked = per_tick * (WINDOW_MS // INTERVAL_MS) * len(closed)
    fig.samples_miscounted = int(
        sum(abs(per_window.get(w, 0) - per_tick * (WINDOW_MS // INTERVAL_MS)) for w in closed)
    )

    # alerts: each (GPU, XID) alert ends up counting every occurrence; nothing published twice
    pairs: dict[str, int] = Counter(x["uuid"] for x in want if x["kind"] == "xid")
    try:
        wait(lambda: _alerts_caught_up(bs, pairs), 60, "alerts counting every XID occurrence", every_s=1.0)
    except AssertionError as exc:
        fig.notes.append(str(exc)[:300])
    recs = _read_alerts(bs)
    seen = Counter((r["alert_id"], r["sequence"]) for r in recs)
    fig.alert_records_duplicated = sum(n - 1 for n in seen.values() if n > 1)
    best = _occurrences(recs)
    fig.alert_gpus = len(pairs)
    fig.alert_occurrences_lost = sum(max(0, n - best.get(p, 0)) for p, n in pairs.items())
    over = {p: best[p] for p, n in pairs.items() if best.get(p, 0) > n}
    if over:
        fig.notes.append(f"alerts counted more occurrences than XIDs for {over}")


def _read_chargeback(bs: str, n_windows: int, chargeback: Service) -> list[dict[str, Any]]:
    codec = AvroCodec()
    topic = PREFIX + topics.CHARGEBACK

    def enough() -> list[dict[str, Any]] | None:
        recs = [codec.decode(m.value()).record for m in read_all(bs, topic, expect=None, timeout_s=10)]
        return recs if len({r["window_start_ms"] for r in recs}) >= n_windows else None

    return wait(enough, 90, f"{n_windows} chargeback windows", every_s=1.0)


def _read_alerts(bs: str) -> list[dict[str, Any]]:
    codec = AvroCodec()
    return [codec.decode(m.value()).record for m in read_all(bs, PREFIX + topics.ALERTS, timeout_s=10)]


def _occurrences(recs: list[dict[str, Any]]) -> dict[str, int]:
    """Occurrences per GPU: the sum over its GPU-scope alerts of each alert's latest count."""
    per_alert: dict[str, tuple[str, int]] = {}
    for r in recs:
        if r["scope"] != "gpu" or not r["xid_codes"] or not r["gpu_uuid"]:
            continue
        _, n = per_alert.get(r["alert_id"], ("", 0))
        per_alert[r["alert_id"]] = (r["gpu_uuid"], max(n, r["occurrences"]))
    out: dict[str, int] = defaultdict(int)
    for gpu, n in per_alert.values():
        out[gpu] += n
    return dict(out)


def _alerts_caught_up(bs: str, pairs: dict[str, int]) -> bool:
    best = _occurrences(_read_alerts(bs))
    return all(best.get(p, 0) >= n for p, n in pairs.items())
