"""A rolling upgrade from the previous release, both versions running side by side, as users run them.

The previous release (0.1.0) is its own wheel, built from git history into a venv of its own
(tests/previous_release.py); every process here is a real `gpupipe` CLI of one version or the other.
The order is the one docs/operations.md prescribes, readers before writers:

1. 0.1.0 everywhere: its chargeback creates the topics and bills its producer's first half hour;
2. a chargeback replica of this version joins the same consumer group while the old one runs: the
   group splits the partitions between the versions and both bill the old producer's second half
   hour; then the old replica is replaced by one of this version under the same static member id,
   as a StatefulSet's rolling update does;
3. this version's producer takes over the same simulated nodes for the next hour.

What must hold: every window once (no repeat at the handovers), the same totals as one
uninterrupted run of this version over the same input (exact to 1e-9), and no dead letter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests import hygiene
from tests.agent_harness import await_at_end_of, find_line
from tests.conftest import free_port
from tests.integration.chargeback_util import (
    Progress,
    assert_same_totals,
    new_id,
    past_hour_ms,
    read_output,
    read_to_end,
    start_service,
    stop_service,
    totals,
    window_keys,
)
from tests.integration.kafka_util import GPUPIPE, REPO, read_all
from tests.previous_release import Release, previous_release

pytestmark = pytest.mark.integration

NODES, GPUS, INTERVAL_S, SEED = 4, 4, 10, 11  # 16 GPUs: records on most of the 12 partitions
WINDOW = ["--window", "10m", "--grace", "1m"]
WINDOW_MS, HALF_HOUR_MS = 600_000, 1_800_000


@pytest.fixture(scope="module")
def old() -> Release:
    return previous_release()


def _produce(
    release: Release | None, kafka: str, prefix: str, start_ms: int, procs: list, duration: str = "30m"
) -> None:
    """The same simulated nodes (same seed and names) from ``start_ms``, by ``release`` (None: this
    version), as fast as the broker takes them; returns once published."""
    cli, env = (release.gpupipe, release.env()) if release else (GPUPIPE, None)
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    argv = [*cli, "produce", "--source", "simulated", "--nodes", str(NODES), "--gpus-per-node", str(GPUS)]
    argv += ["--interval", f"{INTERVAL_S}s", "--duration", duration, "--start-time", start, "--speed", "max"]
    argv += ["--seed", str(SEED), "--xid-rate", "0", "--hostname-prefix", "upg-node-"]
    argv += ["--bootstrap-servers", kafka, "--topic-prefix", prefix, "--log-format", "text"]
    argv += ["--log-level", "warning"]
    proc = hygiene.popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    procs.append(proc)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]


def _await_share(proc: subprocess.Popen, log: Path, after: int = 0, timeout: float = 60) -> list[int]:
    """The partitions of the first non-empty "partitions assigned" line of a chargeback log after its
    first ``after`` such lines (the old instance's first is its start: it held them all)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [x for x in log.read_text().splitlines() if "partitions assigned" in x][after:]
        for line in lines:
            parts = json.loads(line.split("partitions=", 1)[1].split("]", 1)[0] + "]")
            if parts:
                return parts
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no share assigned: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def _await_log(proc: subprocess.Popen, log: Path, text: str, count: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text().count(text) < count:
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{text!r} not in {log}: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_chargeback_and_producers_upgraded_side_by_side_bill_every_window_once(
    kafka: str, old: Release, tmp_path: Path
) -> None:
    prefix = f"upg-{new_id()}."
    # The default output topic: 0.1.0 could exit on a topic it had just created for --output-topic.
    out, group = prefix + topics.CHARGEBACK, f"cb-upg-{new_id()}"
    start_ms = past_hour_ms(6)
    common = [*WINDOW, "--group-id", group, "--commit-interval", "100ms"]
    log_old = tmp_path / "chargeback-0-old.log"
    log_a, log_b = tmp_path / "chargeback-0-new.log", tmp_path / "chargeback-1-new.log"

    # 1. The old version alone: its chargeback creates the topics and bills its producer's first
    # half hour.
    with log_old.open("ab") as f:
        argv = [*old.gpupipe, "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", prefix]
        argv += [*common, "--instance-id", "cb-0", "--log-format", "text"]
        cb_old = hygiene.popen(argv, cwd=REPO, env=old.env(), stdout=f, stderr=subprocess.STDOUT)
    procs = [cb_old]
    try:
        _await_log(cb_old, log_old, "partitions assigned")
        _produce(old, kafka, prefix, start_ms, procs)
        prog = Progress(kafka, group, prefix + topics.SAMPLES)
        prog.wait_done(90, [cb_old])

        # 2. The rolling update: a replica of this version joins the group beside the old one, the
        # group splits the partitions between the versions, and both bill the next half hour.
        cb_b = start_service(kafka, prefix, log_b, *common, "--instance-id", "cb-1")
        procs.append(cb_b)
        # Cooperative rebalancing logs an empty assignment first; the share comes a rebalance later.
        held_b = _await_share(cb_b, log_b)
        _await_share(cb_old, log_old, after=1)
        assert len(held_b) < len(prog.parts), f"not split between the versions: {held_b}"
        before = dict(prog.high)
        _produce(old, kafka, prefix, start_ms + HALF_HOUR_MS, procs)
        prog.refresh_high()
        prog.wait_done(90, [cb_old, cb_b])
        fed_b = [p for p in held_b if prog.high[p] > before[p]]
        assert fed_b, f"no record for this version's partitions {held_b}: {before} -> {prog.high}"

        # ... then the old replica is replaced by one of this version under the same static member
        # id (a StatefulSet pod keeps its name).
        assert stop_service(cb_old) == 0, log_old.read_text()[-3000:]
        cb_a = start_service(kafka, prefix, log_a, *common, "--instance-id", "cb-0")
        procs.append(cb_a)
        _await_log(cb_a, log_a, "partitions assigned")

        # 3. This version's producer takes the same nodes over for hour two.
        _produce(None, kafka, prefix, start_ms + 2 * HALF_HOUR_MS, procs, duration="1h")
        prog.refresh_high()
        prog.wait_done(90, [cb_a, cb_b])
        prog.close()
        assert stop_service(cb_a) == 0, log_a.read_text()[-3000:]
        assert stop_service(cb_b) == 0, log_b.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                hygiene.stop_group(p)

    # One uninterrupted run of this version over the same input is the reference.
    ref_out, ref_group = prefix + "out.reference", f"cb-ref-{new_id()}"
    ref = start_service(
        kafka, prefix, tmp_path / "reference.log", *WINDOW, "--group-id", ref_group, "--output-topic", ref_out
    )
    ref_prog = Progress(kafka, ref_group, prefix + topics.SAMPLES)
    try:
        ref_prog.wait_done(90, [ref])
    finally:
        ref_prog.close()
        assert stop_service(ref) == 0, (tmp_path / "reference.log").read_text()[-3000:]

    upgraded, reference = read_output(kafka, out), read_output(kafka, ref_out)
    keys = window_keys(upgraded)
    assert keys and len(keys) == len(set(keys)), "a window billed twice across the version handover"
    # Two hours with 10-minute windows: the windows of both hours closed, from each version's records.
    starts = sorted({r["window_start_ms"] for r in upgraded})
    assert starts == [start_ms + k * WINDOW_MS for k in range(11)], starts
    assert_same_totals(totals(upgraded), totals(reference))
    assert read_to_end(kafka, prefix + topics.DEADLETTER) == []


def _agent(cli: list[str], env: dict[str, str], kafka: str, prefix: str, tmp_path: Path, log: Path):
    """A node agent on the fake NVML (the release's own double), following ``kmsg.log``."""
    argv = [*cli, "produce", "--source", "nvml", "--bootstrap-servers", kafka, "--topic-prefix", prefix]
    argv += ["--no-create-topics", "--interval", "500ms", "--kubelet-socket", "", "--no-nvml-events"]
    argv += ["--kmsg-path", str(tmp_path / "kmsg.log"), "--spool-dir", str(tmp_path / "spool")]
    argv += ["--listen", f"127.0.0.1:{free_port()}", "--log-format", "text"]
    with log.open("ab") as f:
        return hygiene.popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)


def test_a_node_agent_upgraded_with_xids_in_its_spool_delivers_them_once(
    kafka: str, old: Release, tmp_path: Path
) -> None:
    # The agent of 0.1.0 spools an XID while Kafka is away (a broker that is not there), is killed,
    # and is replaced by this version's agent on the same spool directory and kernel log, as a DaemonSet
    # update does: the XID reaches Kafka once, and the kernel-log line is not read twice.
    from gpupipe_producer.xid.spool_format import LEGACY_FILE, SPOOL_FILE, read_legacy, scan_records
    from gpupipe_schemas.codec import AvroCodec

    prefix = f"upg-agent-{new_id()}."
    (tmp_path / "kmsg.log").write_text("boot\n")  # not empty: its end is a position the agent seeks to
    spool, legacy = tmp_path / "spool" / SPOOL_FILE, tmp_path / "spool" / LEGACY_FILE

    def spooled() -> int:  # 0.1.0 wrote the text format; this version migrates it to its own
        old_format = len(read_legacy(legacy.read_bytes())[0]) if legacy.exists() else 0
        return old_format + (len(scan_records(spool.read_bytes()).records) if spool.exists() else 0)

    env = {"GPUPIPE_FAKE_NVML": "H100:2", "NODE_NAME": "upg-node"}
    old_cli = [str(old.python), "-P", str(old.tree / "tests" / "fake_nvml_cli.py")]
    old_log = tmp_path / "agent-old.log"
    agent = _agent(old_cli, old.env(**env), f"127.0.0.1:{free_port()}", prefix, tmp_path, old_log)
    try:
        _await_log(agent, old_log, "node agent started")
        # The agent follows the kernel log from its end: a line written before its seek is never seen.
        await_at_end_of(agent.pid, tmp_path / "kmsg.log")
        with (tmp_path / "kmsg.log").open("a") as f:
            f.write(find_line("xid_real.txt", "Xid (PCI:0000:91:00): 79") + "\n")
        deadline = time.monotonic() + 30
        while not spooled():
            assert agent.poll() is None, old_log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"0.1.0 spooled nothing: {old_log.read_text()[-3000:]}"
            time.sleep(0.1)
        # Killed, not stopped: 0.1.0 waits for Kafka on SIGTERM past a pod's grace period, and what it
        # spooled must survive the harshest end anyway.
        hygiene.stop_group(agent, signal.SIGKILL)
    finally:
        if agent.poll() is None:
            hygiene.stop_group(agent, signal.SIGKILL)
    assert spooled() == 1 and legacy.exists()

    ensure_topics(kafka, [topics.SAMPLES, topics.XID, topics.TOPOLOGY], prefix=prefix)
    new_cli = [sys.executable, str(REPO / "tests" / "fake_nvml_cli.py")]
    new_log = tmp_path / "agent-new.log"
    agent = _agent(new_cli, {**os.environ, **env}, kafka, prefix, tmp_path, new_log)
    try:
        deadline = time.monotonic() + 60
        while spooled():
            assert agent.poll() is None, new_log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the spool was not drained: {new_log.read_text()[-3000:]}"
            time.sleep(0.1)
        xids = [AvroCodec().decode(m.value()).record for m in read_all(kafka, prefix + topics.XID, expect=1)]
        assert [(x["kind"], x["xid"], x["hostname"]) for x in xids] == [("xid", 79, "upg-node")], xids
        assert read_all(kafka, prefix + topics.DEADLETTER, expect=None, timeout_s=2) == []
        assert hygiene.stop_group(agent) == 0, new_log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            hygiene.stop_group(agent, signal.SIGKILL)
    assert len(read_all(kafka, prefix + topics.XID, expect=None, timeout_s=2)) == 1
