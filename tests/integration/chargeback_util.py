"""Helpers for the chargeback integration tests: run the service, watch its checkpoints, read its output."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from gpupipe.kafka import topics
from gpupipe_consumers.report.command import read_chargeback_records
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.integration.metrics_helpers import http_get

HOUR_MS = 3_600_000
_COORDINATOR_LOADING = (
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
)


def past_hour_ms(hours_back: int) -> int:
    """A whole hour well in the past (samples must not be ahead of their Kafka timestamps)."""
    now = int(time.time() * 1000)
    return now - now % HOUR_MS - hours_back * HOUR_MS


def start_service(
    kafka: str, prefix: str, log_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`gpupipe chargeback` in a subprocess, logs to ``log_path`` (appended)."""
    log = open(log_path, "a")  # noqa: SIM115 (owned by the process' lifetime)
    return hygiene.popen(
        [
            *GPUPIPE,
            "chargeback",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--log-format",
            "text",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def stop_service(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM and wait: a clean stop commits what is pending and exits 0."""
    if proc.poll() is None:
        proc.terminate()
    return proc.wait(timeout=timeout)


def kill_left(procs: dict[str, subprocess.Popen]) -> None:
    """SIGKILL whatever a failed test left running (its `finally`), and reap it."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


class Progress:
    """A group's committed checkpoints of an input topic (offset, and replay_until from the metadata)."""

    def __init__(self, kafka: str, group: str, topic: str) -> None:
        self.topic = topic
        self.c = Consumer(
            {
                "bootstrap.servers": kafka,
                "group.id": group,
                "enable.auto.commit": False,
                # Not read_committed: that would wait for a killed instance's pending offset commit.
                "isolation.level": "read_uncommitted",
            }
        )
        parts = self.c.list_topics(topic, timeout=10).topics[topic].partitions
        self.parts = sorted(parts)
        self.refresh_high()

    def until(self) -> dict[int, int]:
        """Per partition, the position up to which output is committed (0 when none)."""
        out = {}
        deadline = time.monotonic() + 20
        while True:  # a fresh broker may not have loaded the group coordinator yet (NOT_COORDINATOR)
            try:
                committed = self.c.committed([TopicPartition(self.topic, p) for p in self.parts], timeout=10)
                break
            except KafkaException as exc:
                transient = exc.args[0].retriable() or exc.args[0].code() in _COORDINATOR_LOADING
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for tp in committed:
            until = 0
            if tp.offset is not None and tp.offset >= 0 and tp.metadata:
                until = json.loads(tp.metadata)["until"]
            out[tp.partition] = until
        return out

    def committed_total(self) -> int:
        return sum(self.until().values())

    def refresh_high(self) -> None:
        deadline = time.monotonic() + 20
        while True:  # a topic created a moment ago may not have its partition leaders yet
            try:
                self.high = {
                    p: self.c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[1]
                    for p in self.parts
                }
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def done(self) -> bool:
        u = self.until()
        return all(u[p] >= h for p, h in self.high.items())

    def wait_done(self, timeout: float = 60, procs: Iterable[subprocess.Popen] = ()) -> None:
        deadline = time.monotonic() + timeout
        while not self.done():
            for p in procs:
                assert p.poll() is None, f"chargeback exited early with {p.returncode}"
            assert time.monotonic() < deadline, f"not done in {timeout}s: {self.until()} vs {self.high}"
            time.sleep(0.1)

    def close(self) -> None:
        self.c.close()


def wait_log(path: Path, text: str, count: int = 1, timeout: float = 30) -> None:
    """Wait until ``text`` occurs ``count`` times in the log (e.g. the service got its partitions)."""
    deadline = time.monotonic() + timeout
    while path.read_text().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not {count}x in {path}:\n{path.read_text()[-2000:]}"
        time.sleep(0.05)


def read_to_end(kafka: str, topic: str, timeout: float = 30) -> list:
    """Every committed message of ``topic``, up to the end (partition EOF everywhere)."""
    c = Consumer(
        {
            "bootstrap.servers": kafka,
            "group.id": f"t-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out, pending = [], set(parts)
    deadline = time.monotonic() + timeout
    try:
        while pending:
            assert time.monotonic() < deadline, f"{topic}: no end in {timeout}s"
            for m in c.consume(1000, 0.2):
                if m.error() is None:
                    out.append(m)
                elif m.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard(m.partition())
    finally:
        c.close()
    return out


def read_output(kafka: str, topic: str) -> list[dict[str, Any]]:
    return read_chargeback_records(kafka, topic, AvroCodec(), timeout_s=30)


SUM_FIELDS = (
    "allocated_gpu_seconds",
    "used_gpu_seconds",
    "idle_gpu_seconds",
    "activity_unknown_gpu_seconds",
    "shared_gpu_seconds",
    "mig_gpu_seconds",
    "lost_gpu_seconds",
    "energy_joules",
    "energy_estimated_joules",
    "sample_count",
    "cost_total",
)


def totals(
    records: Iterable[dict[str, Any]], key: tuple[str, ...] = ("window_start_ms", "namespace")
) -> dict:
    """Sums of SUM_FIELDS per ``key`` (windows and corrections together, as reports sum them)."""
    out: dict[tuple, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SUM_FIELDS, 0.0))
    for r in records:
        t = out[tuple(r[k] for k in key)]
        for f in SUM_FIELDS:
            t[f] += r[f]
    return dict(out)


def assert_same_totals(a: dict, b: dict, rel: float = 1e-9) -> None:
    assert a.keys() == b.keys(), (
        f"different rows: only in first {a.keys() - b.keys()}, second {b.keys() - a.keys()}"
    )
    for k in a:
        for f in SUM_FIELDS:
            x, y = a[k][f], b[k][f]
            assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-9), f"{k} {f}: {x} != {y}"


def window_keys(records: Iterable[dict[str, Any]]) -> list[tuple]:
    """Identity of every final window record; exactly-once output means no repeats."""
    return sorted(
        (r["window_start_ms"], r["namespace"], r["node"], r["gpu_model"], r["source_partition"])
        for r in records
        if r["kind"] == "window"
    )


def new_id() -> str:
    return uuid.uuid4().hex[:8]


def counter_sum(text: str, name: str) -> float:
    """Sum of a counter family's ``_total`` samples in a /metrics text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}_total") and not line.startswith("#")
    )


def run_and_scrape(
    kafka: str,
    prefix: str,
    group: str,
    log: Path,
    ready: Callable[[str], bool],
    *,
    wait_for: str | None = None,
    stable: bool = False,
) -> str:
    """One chargeback run (10 m windows, 1 m grace) to the end of the input; the service's /metrics
    text once ``ready`` holds for it (and, with ``stable``, two scrapes in a row were the same:
    the counters have taken what the commits and read-backs gave them), then a clean stop. Without
    static membership the stopped instance leaves the group, so a test can delete the group."""
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    port = free_port()
    args = ("--window", "10m", "--grace", "1m", "--group-id", group, "--no-static-membership")
    svc = start_service(kafka, prefix, log, *args, "--listen", f"127.0.0.1:{port}")
    try:
        prog.wait_done(60, [svc])
        if wait_for is not None:
            wait_log(log, wait_for, timeout=60)
        deadline = time.monotonic() + 60
        last = ""
        while True:  # the counters follow the commit that the progress group saw
            text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
            if (ready(text) and (not stable or text == last)) or time.monotonic() > deadline:
                break
            last = text
            time.sleep(0.3 if stable else 0.2)
        assert stop_service(svc) == 0, log.read_text()[-3000:]
        return text
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        prog.close()
