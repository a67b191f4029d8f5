"""Helpers of the metrics-consumer integration tests: processes, a real Prometheus, exposition parsing.

Everything waits on conditions with a deadline (never fixed sleeps) and fails, never skips, when a
service is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from confluent_kafka import Producer

from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.meaning import sample_kafka_key, xid_kafka_key
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard

REPO = Path(__file__).resolve().parents[2]
GPUPIPE = [sys.executable, "-m", "gpupipe"]
DEPLOY_PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
DEPLOY_KUBERNETES_SD = REPO / "deploy" / "prometheus" / "kubernetes-sd.yml"

T = TypeVar("T")


def wait_for(
    fn: Callable[[], T], timeout_s: float, what: str | Callable[[], str], interval_s: float = 0.25
) -> T:
    """Poll ``fn`` until it returns something truthy; fail with ``what`` (or what it returns)
    and the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = fn()
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            desc = what() if callable(what) else what
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {desc}; last: {last!r}"[:3000])
        time.sleep(interval_s)


def http_get(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 400:  # Prometheus explains a bad query in the body
            raise AssertionError(f"GET {url}: 400 {exc.read()[:500]!r}") from None
        raise


# -- processes ---------------------------------------------------------------------------------------
class Proc:
    """A gpupipe subprocess whose output goes to a log file (shown when a test fails)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = hygiene.popen(
            [*GPUPIPE, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "GPUPIPE_LOG_FORMAT": "text", **(env or {})},
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def start_producer(kafka: str, prefix: str, log_path: Path, *extra: str) -> Proc:
    return Proc(
        [
            "produce",
            "--source",
            "simulated",
            "--interval",
            "1s",
            "--speed",
            "1",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            *extra,
        ],
        log_path,
    )


def start_metrics(kafka: str, prefix: str, port: int, log_path: Path, *extra: str) -> Proc:
    return Proc(
        [
            "metrics",
            "--listen",
            f"127.0.0.1:{port}",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            *extra,
        ],
        log_path,
    )


class CraftedProducer:
    """Publishes hand-made records like the real producer does (keyed by GPU, murmur2)."""

    def __init__(self, kafka: str) -> None:
        self.codec = AvroCodec()
        self.p = Producer({"bootstrap.servers": kafka, "partitioner": "murmur2_random", "linger.ms": 5})

    def sample(self, topic: str, rec: dict[str, Any]) -> None:
        self.p.produce(topic, self.codec.encoder("GpuSample").encode(rec), sample_kafka_key(rec))

    def xid(self, topic: str, ev: dict[str, Any]) -> None:
        self.p.produce(topic, self.codec.encoder("XidEvent").encode(ev), xid_kafka_key(ev))

    def raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.p.produce(topic, value, key)

    def flush(self) -> None:
        assert self.p.flush(15) == 0, "crafted records not delivered"


# -- Prometheus ------------------------------------------------------------------------------------
def prometheus_config(
    metrics_targets: Iterable[str] | None = None,
    interval: str = "1s",
    *,
    path: Path = DEPLOY_PROMETHEUS,
    static_configs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A shipped config (deploy/prometheus/*.yml) reduced to its gpupipe-metrics job, with the
    test's targets in place of its discovery and a fast scrape interval.

    The job's other settings (honor_labels, relabelling) stay, so the tests run what we ship.
    ``static_configs`` may carry ``__meta_*`` labels to stand in for service discovery."""
    cfg = yaml.safe_load(path.read_text())
    cfg["global"] = {**cfg.get("global", {}), "scrape_interval": interval, "scrape_timeout": interval}
    cfg["global"]["evaluation_interval"] = interval
    jobs = [j for j in cfg["scrape_configs"] if j["job_name"] == "gpupipe-metrics"]
    assert len(jobs) == 1, f"{path} must have one gpupipe-metrics job"
    job = jobs[0]
    for key in [k for k in job if k.endswith("_sd_configs") or k == "static_configs"]:
        del job[key]
    job["static_configs"] = static_configs or [{"targets": list(metrics_targets or [])}]
    cfg["scrape_configs"] = [job]
    cfg.pop("rule_files", None)
    cfg.pop("alerting", None)
    return cfg


def prometheus3() -> tuple[str, str]:
    """(prometheus, promtool) of Prometheus 3, built from its Go module once (scripts/prometheus3-local)."""
    res = subprocess.run(
        [str(REPO / "scripts" / "prometheus3-local")], capture_output=True, text=True, timeout=3000, cwd=REPO
    )
    assert res.returncode == 0, f"could not find or build Prometheus 3:\n{res.stderr[-3000:]}"
    server, tool = res.stdout.strip().splitlines()[-1].split()
    return server, tool


#: Prometheus 3's scrape protocols (its config's ``scrape_protocols``), each of which every service
#: must serve when it is the only one a job accepts.
SCRAPE_PROTOCOLS = (
    "OpenMetricsText1.0.0",
    "OpenMetricsText0.0.1",
    "PrometheusText1.0.0",
    "PrometheusText0.0.4",
)


class Prometheus:
    """A real Prometheus on a free loopback port with a temporary config: Debian's 2.x, or the
    Prometheus 3 of :func:`prometheus3` (``binary``)."""

    def __init__(self, config: dict[str, Any], workdir: Path, port: int, binary: str | None = None) -> None:
        binary = binary or shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not found: install the Debian package 'prometheus'", pytrace=False)
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = hygiene.popen(
            [
                binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> bool:
            if self.popen.poll() is not None:
                pytest.fail(f"prometheus exited {self.popen.returncode}:\n{self.log_tail()}", pytrace=False)
            return http_get(self.url + "/-/ready", 2) is not None

        wait_for(ready, timeout_s, "prometheus /-/ready")

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query through the HTTP API (at evaluation time ``at``, default now); returns
        data.result (vector) or raises."""
        q = urllib.parse.urlencode({"query": expr, **({} if at is None else {"time": f"{at:.3f}"})})
        doc = json.loads(http_get(f"{self.url}/api/v1/query?{q}"))
        assert doc["status"] == "success", doc
        result = doc["data"]["result"]
        if doc["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        q = urllib.parse.urlencode({"match[]": match})
        doc = json.loads(http_get(f"{self.url}/api/v1/label/{label}/values?{q}"))
        assert doc["status"] == "success", doc
        return doc["data"]

    def targets_up(self) -> list[dict[str, Any]]:
        doc = json.loads(http_get(f"{self.url}/api/v1/targets"))
        return [t for t in doc["data"]["activeTargets"] if t["health"] == "up"]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()


# -- the exposition --------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def gpus_served(text: str) -> set[str]:
    """GPU keys (UUID, or MIG device... the parent UUID plus GPU_I_ID) on any DCGM_ series."""
    keys = set()
    for name, labels, _ in parse_exposition(text):
        if name.startswith("DCGM_") and "UUID" in labels:
            keys.add(labels["UUID"] + (f"/{labels['GPU_I_ID']}" if "GPU_I_ID" in labels else ""))
    return keys


ALLOWED_PROMTOOL = (
    "label names should be written in 'snake_case' not 'camelCase'",
    'counter metrics should have "_total" suffix',
    "metric name should not include type 'counter'",
)


def promtool_check(text: bytes) -> list[str]:
    """Run ``promtool check metrics``; fail on exit 1 (a parse error); return the lines that are
    not the naming complaints dcgm-exporter compatibility forces on us (DCGM_ names, camelCase)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus'", pytrace=False)
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=120)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode != 1, f"promtool check metrics failed:\n{out[-3000:]}"
    bad = []
    for line in out.splitlines():
        name, _, problem = line.partition(" ")
        if problem == ALLOWED_PROMTOOL[0]:
            continue
        if name.startswith("DCGM_") and problem in ALLOWED_PROMTOOL[1:]:
            continue
        bad.append(line)
    return bad
