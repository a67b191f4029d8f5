"""`gpupipe alerts` end to end: real Kafka, real Alertmanager (Debian package), fake Kubernetes API.

The service runs as the CLI in a subprocess, like in production. Short windows keep the run short:
--resolve-after 6s, --update-interval 1s, --resend-interval 2s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.alerts.engine.alert_record import alert_from_record
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe, read_all
from tests.k8s_api_fake import FakeKubeApi

pytestmark = pytest.mark.integration

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
AM_CONFIG = """
route:
  receiver: "null"
  group_by: [alertname, node]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: "null"
inhibit_rules:
  - source_matchers: [alertname="GpuNodeXidStorm"]
    target_matchers: [alertname="GpuXidError"]
    equal: [node]
"""


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


# ------------------------------------------------------------------------------------ Alertmanager


class Alertmanager:
    def __init__(self, tmp: Path, port: int | None = None) -> None:
        if not os.access(ALERTMANAGER, os.X_OK):
            pytest.fail(f"{ALERTMANAGER} is missing (apt-get install prometheus-alertmanager)", pytrace=False)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tmp / f"am-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "am.yml").write_text(AM_CONFIG)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Alertmanager:
        self.log = open(self.dir / "am.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = hygiene.popen(
            [
                ALERTMANAGER,
                f"--config.file={self.dir / 'am.yml'}",
                f"--storage.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 20, "Alertmanager /-/ready")
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"Alertmanager exited: {(self.dir / 'am.log').read_text()[-2000:]}", pytrace=False)
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())

    def alerts(self) -> list[dict[str, Any]]:
        return [a for a in self.get("/api/v2/alerts") if a["labels"].get("source") == "gpupipe"]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.log.close()


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    am = Alertmanager(tmp_path).start()
    try:
        yield am
    finally:
        am.stop()


# ----------------------------------------------------------------------------------- the service


class AlertsProcess:
    def __init__(self, kafka: str, prefix: str, tmp: Path, *flags: str, group: str | None = None) -> None:
        self.port = free_port()
        self.logfile = tmp / f"alerts-{uuid.uuid4().hex[:6]}.log"
        self.cmd = [
            *GPUPIPE,
            "alerts",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--from-beginning",
            "--group-id",
            group or f"alerts-{prefix}",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--instance-id",
            "it",
            *flags,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AlertsProcess:
        self._log = open(self.logfile, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = hygiene.popen(self.cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until(self._healthy, 60, "alerts /healthz")
        return self

    def log_text(self) -> str:
        return self.logfile.read_text(errors="replace")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"gpupipe alerts exited {self.proc.returncode}:\n{self.log_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(5)
        self._log.close()
        return rc


# ------------------------------------------------------------------------------------------ Kafka


class TopicReader:
    """Accumulates every GpuAlert record of a topic from the beginning."""

    def __init__(self, kafka: str, topic: str) -> None:
        self.codec = AvroCodec()
        self.c = Consumer(
            {"bootstrap.servers": kafka, "group.id": f"t-{uuid.uuid4()}", "enable.auto.commit": False}
        )
        md = self.c.list_topics(topic, timeout=10).topics[topic]
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        for m in self.c.consume(1000, 0.2):
            if not m.error():
                self.records.append(self.codec.decode(m.value()).record)
        return self.records

    def latest(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for r in self.poll():
            if r["status"] == "action":
                continue
            prev = out.get(r["alert_id"])
            if prev is None or r["sequence"] >= prev["sequence"]:
                out[r["alert_id"]] = r
        return out

    def close(self) -> None:
        self.c.close()


def produce(kafka: str, topic: str, name: str, records: list[dict[str, Any]], raw: list[bytes] = ()) -> None:
    enc = AvroCodec().encoder(name)
    p = Producer({"bootstrap.servers": kafka})
    for r in records:
        p.produce(topic, enc.encode(r), (r.get("uuid") or r["pci_bus_id"]).encode())
    for b in raw:
        p.produce(topic, b, b"junk")
    assert p.flush(15) == 0


def xid_event(host: str, bus: str, code: int | None, ts: int, **kw: Any) -> dict[str, Any]:
    ev = {
        "event_id": f"{host}|{kw.get('source', 'kmsg')}|{bus}|{code}|{ts}|{uuid.uuid4().hex[:6]}",
        "timestamp_ms": ts,
        "hostname": host,
        "kind": "xid",
        "xid": code,
        "pci_bus_id": bus,
        "gpu_index": None,
        "uuid": None,
        "model_name": "NVIDIA H200",
        "driver_version": "570.124.06",
        "pid": None,
        "process_name": None,
        "message": "",
        "gpu_instance_id": None,
        "compute_instance_id": None,
        "mig_uuid": None,
        "source": "kmsg",
        "allocations": [
            {
                "namespace": "team-a",
                "pod": f"train-{host}",
                "container": "main",
                "resource_name": None,
                "replica": None,
            }
        ],
    }
    ev.update(kw)
    return ev


def sample(host: str, bus: str, ts: int, **kw: Any) -> dict[str, Any]:
    from gpupipe_schemas import catalog

    rec = {f["name"]: f.get("default") for f in catalog.current("GpuSample").raw["fields"]}
    rec.update(
        timestamp_ms=ts,
        hostname=host,
        gpu_index=int(bus.split(":")[1], 16) // 16,
        uuid=f"GPU-{host}-{bus[5:7]}",
        pci_bus_id=f"0000{bus}.0" if len(bus) == 10 else bus,
        model_name="NVIDIA H200",
        interval_ms=1000,
    )
    rec.update(kw)
    return rec


def _topics(kafka: str, prefix: str) -> dict[str, str]:
    ensure_topics(kafka, [topics.XID, topics.SAMPLES, topics.ALERTS, topics.DEADLETTER], prefix=prefix)
    return {
        t: topics.with_prefix(prefix, t)
        for t in (topics.XID, topics.SAMPLES, topics.ALERTS, topics.DEADLETTER)
    }


def test_alerts_end_to_end(kafka: str, topic_prefix: str, alertmanager: Alertmanager, tmp_path: Path) -> None:
    t = _topics(kafka, topic_prefix)
    kube_token = tmp_path / "token"
    kube_token.write_text("it-token")
    reader = TopicReader(kafka, t[topics.ALERTS])
    with FakeKubeApi(["node-a", "node-b", "node-d"], token="it-token") as kube:
        flags = [
            "--alertmanager-url",
            alertmanager.url,
            "--resolve-after",
            "6s",
            "--dedupe-window",
            "60s",
            "--update-interval",
            "1s",
            "--resend-interval",
            "2s",
            "--cordon",
            "--kube-api-url",
            kube.url,
            "--kube-token-file",
            str(kube_token),
            "--cordon-max-per-hour",
            "1",
        ]
        svc = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
        try:
            now = int(time.time() * 1000)
            dup = xid_event("node-a", "0000:18:00", 79, now, message="GPU has fallen off the bus.")
            xids = [
                dup,
                dict(dup),  # the same event twice (producer retry): counted once
                xid_event("node-a", "0000:18:00", 79, now + 500, message="GPU has fallen off the bus."),
                xid_event("node-a", "0000:28:00", 13, now + 10, pid=101, process_name="python3"),
                xid_event("node-a", "0000:38:00", 13, now + 20, pid=102, process_name="python3"),
                # one Xid seen by NVML (uuid, no text) and by the kernel log (text): one occurrence
                xid_event("node-b", "00000000:18:00.0", 95, now, source="nvml", uuid="GPU-node-b-18"),
                xid_event(
                    "node-b", "0000:18:00", 95, now + 300, message="Uncontained: FBHUB. RST: Yes, D-RST: No"
                ),
                xid_event("node-c", "0000:28:00", 4242, now, message="a code from a future driver"),
                xid_event("node-c", "0000:38:00", None, now, kind="unknown"),
                xid_event("node-c", "0000:05:00.0", 10001, now, kind="sxid", message="Non-fatal, Link 3"),
                xid_event("node-c", "0000:48:00", 31, now - 3_600_000),  # an hour late
            ]
            produce(kafka, t[topics.XID], "XidEvent", xids, raw=[b"\xc3\x01not-avro"])
            produce(
                kafka,
                t[topics.SAMPLES],
                "GpuSample",
                [
                    sample("node-c", "0000:48:00", now - 1000, ecc_dbe_volatile_total=0),
                    sample("node-c", "0000:48:00", now, ecc_dbe_volatile_total=2),
                    sample("node-d", "0000:18:00", now, row_remap_failure=True),
                    sample("node-e", "0000:18:00", now),  # healthy: nothing
                ],
            )

            def gpu_keys() -> set[tuple[str, str | None, str]]:
                return {
                    (
                        r["hostname"],
                        r["pci_bus_id"],
                        r["alertname"] + ":" + ",".join(map(str, r["xid_codes"][:1])),
                    )
                    for r in reader.latest().values()
                }

            expected = {
                ("node-a", "0000:18:00.0", "GpuXidError:79"),
                ("node-a", "0000:28:00.0", "GpuXidError:13"),
                ("node-a", "0000:38:00.0", "GpuXidError:13"),
                ("node-a", None, "GpuNodeXidStorm:13"),
                ("node-b", "0000:18:00.0", "GpuXidError:95"),
                ("node-c", "0000:28:00.0", "GpuXidError:4242"),
                ("node-c", "0000:38:00.0", "GpuXidError:0"),
                ("node-c", "0000:05:00.0", "NvswitchSxidError:10001"),
                ("node-c", "0000:48:00.0", "GpuXidError:31"),
                ("node-c", "0000:48:00.0", "GpuEccUncorrectable:"),
                ("node-d", "0000:18:00.0", "GpuRowRemapFailure:"),
            }
            wait_until(lambda: expected <= gpu_keys(), 30, f"alerts {expected - gpu_keys()}")
            latest = reader.latest()
            assert len(latest) == len(expected), sorted(gpu_keys() - expected)  # one alert per (GPU, fault)
            by = {
                (r["hostname"], r["pci_bus_id"], r["alertname"], tuple(r["xid_codes"][:1])): r
                for r in latest.values()
            }
            x79 = by[("node-a", "0000:18:00.0", "GpuXidError", (79,))]
            wait_until(lambda: reader.latest()[x79["alert_id"]]["occurrences"] == 2, 10, "79 count update")
            assert x79["drain_node"] and x79["action"] == "RESTART_BM" and x79["severity"] == "critical"
            x95 = by[("node-b", "0000:18:00.0", "GpuXidError", (95,))]
            assert (
                x95["occurrences"] == 1
                and x95["gpu_uuid"] == "GPU-node-b-18"
                and "Uncontained" in x95["message"]
            )
            assert by[("node-c", "0000:28:00.0", "GpuXidError", (4242,))]["known"] is False
            storm = next(r for r in latest.values() if r["scope"] == "node")
            assert len(storm["gpus"]) == 3 and storm["drain_node"]
            assert x79["first_event_id"] == dup["event_id"] and x79["emitted_at_ms"] >= x79["first_seen_ms"]

            # cordon: three nodes call for draining (node-a, node-b, node-d); the limit is 1 per hour
            def actions_if(n: int) -> list[dict[str, Any]] | None:
                acts = [r for r in reader.poll() if r["status"] == "action"]
                return acts if len(acts) >= n else None

            actions = wait_until(lambda: actions_if(3), 15, "three cordon decisions")
            outcomes = sorted(a["remediation"]["outcome"] for a in actions)
            assert outcomes == ["cordoned", "rate_limited", "rate_limited"], outcomes
            cordoned = next(a for a in actions if a["remediation"]["outcome"] == "cordoned")
            node = cordoned["remediation"]["node"]
            assert kube.node(node)["spec"]["unschedulable"] is True
            assert len(kube.patches()) == 1
            assert (
                kube.node(node)["metadata"]["annotations"]["gpupipe.io/cordon-alert-id"]
                == cordoned["alert_id"]
            )

            # Alertmanager received them, grouped by (alertname, node), per-GPU alerts inhibited by the storm
            def am_has_all() -> list[dict[str, Any]] | None:
                got = alertmanager.alerts()
                ids = {a["annotations"].get("alert_id") for a in got}
                firing = {i for i, r in reader.latest().items() if r["status"] == "firing"}
                return got if firing <= ids and x79["alert_id"] in ids else None

            am_alerts = wait_until(am_has_all, 15, "alerts in Alertmanager")
            a79 = next(a for a in am_alerts if a["annotations"]["alert_id"] == x79["alert_id"])
            assert a79["labels"] == {
                "alertname": "GpuXidError",
                "severity": "critical",
                "node": "node-a",
                "cause_class": x79["cause_class"],
                "scope": "gpu",
                "source": "gpupipe",
                "xid": "79",
                "pci_bus_id": "0000:18:00.0",
            }
            assert (
                a79["annotations"]["action"] == "RESTART_BM" and a79["annotations"]["pod"] == "train-node-a"
            )
            assert a79["annotations"]["runbook"] and a79["annotations"]["summary"].startswith(
                "CRITICAL: XID 79"
            )
            assert a79["status"]["state"] == "suppressed" and a79["status"]["inhibitedBy"]
            groups = alertmanager.get("/api/v2/alerts/groups")
            node_a_xid = [g for g in groups if g["labels"] == {"alertname": "GpuXidError", "node": "node-a"}]
            assert len(node_a_xid) == 1 and len(node_a_xid[0]["alerts"]) == 3
            assert len(read_all(kafka, t[topics.DEADLETTER], expect=1, timeout_s=10)) == 1

            # quiet for --resolve-after: application-class alerts resolve; faults that need a reset,
            # reboot or RMA stay firing until evidence of recovery: here an operator's ack.
            # A node storm stays as long as a sticky member fires (its members stay inhibited under it).
            def is_sticky(r: dict[str, Any]) -> bool:
                return alert_from_record(r).sticky

            def stays(r: dict[str, Any]) -> bool:
                if r["scope"] != "node":
                    return is_sticky(r)
                members = reader.latest().values()
                return any(
                    m["parent_alert_id"] == r["alert_id"] and m["status"] == "firing" and is_sticky(m)
                    for m in members
                )

            stuck = wait_until(
                lambda: (
                    [r for r in reader.latest().values() if r["status"] == "firing"]
                    if all(r["status"] == "resolved" for r in reader.latest().values() if not stays(r))
                    else None
                ),
                20,
                "quiet resolution of the application-class alerts",
            )
            assert x79["alert_id"] in {r["alert_id"] for r in stuck} and all(stays(r) for r in stuck)
            stuck = [r for r in stuck if r["scope"] != "node"]  # the storm ends with its members
            ack_flags = ("--bootstrap-servers", kafka, "--topic-prefix", topic_prefix)
            bad = gpupipe("alerts", *ack_flags, "--ack", "no-such-alert")
            assert bad.returncode == 2 and "no alert no-such-alert" in bad.stderr, bad.stderr
            for r in stuck:
                res = gpupipe("alerts", *ack_flags, "--ack", r["alert_id"], "--ack-note", "GPU reseated")
                assert res.returncode == 0 and "acknowledged" in res.stdout, res.stderr
            wait_until(
                lambda: all(r["status"] == "resolved" for r in reader.latest().values()), 20, "resolution"
            )
            wait_until(lambda: not alertmanager.alerts(), 15, "Alertmanager resolution")
            resolved79 = reader.latest()[x79["alert_id"]]
            assert resolved79["resolve_reason"] == "acknowledged" and resolved79["occurrences"] == 2
        finally:
            rc = svc.stop()
        assert rc == 0, svc.log_text()[-3000:]

        # restart: open state and the cordon ledger come back from gpu.alerts.v1
        svc2 = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
        try:
            again = xid_event(
                "node-a", "0000:18:00", 79, int(time.time() * 1000), message="GPU has fallen off the bus."
            )
            produce(kafka, t[topics.XID], "XidEvent", [again])

            # acknowledged as dealt with, the fault is back: a new incident (new id), no second cordon
            def new79() -> dict[str, Any] | None:
                return next(
                    (
                        r
                        for r in reader.latest().values()
                        if r["status"] == "firing"
                        and r["xid_codes"][:1] == [79]
                        and r["hostname"] == "node-a"
                    ),
                    None,
                )

            reopened = wait_until(new79, 20, "the 79 to come back as a new alert")
            assert reopened["alert_id"] != x79["alert_id"] and reopened["drain_node"] is True
            wait_until(
                lambda: any(
                    a["annotations"]["alert_id"] == reopened["alert_id"] for a in alertmanager.alerts()
                ),
                10,
                "new alert in Alertmanager",
            )
            time.sleep(0.5)  # give a (wrong) second cordon the chance to show up
            assert len(kube.patches()) == 1
            cordons = [
                r for r in reader.poll() if r["status"] == "action" and r["remediation"]["kind"] == "cordon"
            ]
            assert len(cordons) == 3
        finally:
            assert svc2.stop() == 0, svc2.log_text()[-3000:]
    reader.close()


def test_alertmanager_down_then_back(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    t = _topics(kafka, topic_prefix)
    am = Alertmanager(tmp_path)  # port chosen, not started yet
    svc = AlertsProcess(
        kafka,
        topic_prefix,
        tmp_path,
        "--alertmanager-url",
        am.url,
        "--resend-interval",
        "2s",
        "--no-health-signals",
    ).start()
    reader = TopicReader(kafka, t[topics.ALERTS])
    try:
        res = gpupipe(
            "produce",
            "--source",
            "simulated",
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--interval",
            "1s",
            "--duration",
            "30s",
            "--speed",
            "max",
            "--xid-rate",
            "900",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            topic_prefix,
            "--log-format",
            "text",
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        # the Kafka path is unaffected by the missing Alertmanager
        firing = wait_until(lambda: reader.latest() or None, 30, "alerts on Kafka")
        wait_until(lambda: "alertmanager post failed" in svc.log_text(), 15, "a failed POST in the log")
        assert all(r["status"] == "firing" for r in firing.values())
        am.start()
        try:

            def delivered() -> bool:
                ids = {a["annotations"]["alert_id"] for a in am.alerts()}
                return set(reader.latest()) <= ids

            wait_until(delivered, 30, "queued alerts delivered after Alertmanager came back")
        finally:
            assert svc.stop() == 0, svc.log_text()[-3000:]
            am.stop()
    finally:
        reader.close()
        if svc.proc and svc.proc.poll() is None:
            svc.stop()
