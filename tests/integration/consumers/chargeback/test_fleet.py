"""Chargeback on a simulated fleet over a real broker: invariant, kill -9 restarts, two instances, reports.

One input (3 nodes x 4 GPUs, 10 s interval, two simulated hours = 8640 samples) is produced once per
module; each test runs the service with its own consumer group and output topic on it, and compares
with the uninterrupted run. Windows are 10 minutes with 1 minute of grace, so 11 windows close.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import signal
import subprocess
import time

import pytest
from confluent_kafka.admin import AdminClient

from gpupipe.commands.cli import build_parser
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.chargeback.accounting import gpu_fraction
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard
from tests.integration.chargeback_util import (
    Progress,
    assert_same_totals,
    new_id,
    past_hour_ms,
    read_output,
    start_service,
    stop_service,
    totals,
    wait_log,
    window_keys,
)
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe

pytestmark = pytest.mark.integration

NODES, GPUS, INTERVAL_S, SEED = 3, 4, 10, 6
WINDOW = ["--window", "10m", "--grace", "1m"]
WINDOW_MS = 600_000


def produce_fleet(
    kafka: str, prefix: str, start_ms: int, speed: str = "max", wait: bool = True
) -> subprocess.Popen | None:
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    argv = [
        *GPUPIPE,
        "produce",
        "--source",
        "simulated",
        "--nodes",
        str(NODES),
        "--gpus-per-node",
        str(GPUS),
        "--interval",
        f"{INTERVAL_S}s",
        "--duration",
        "2h",
        "--start-time",
        start_iso,
        "--speed",
        speed,
        "--seed",
        str(SEED),
        "--xid-rate",
        "0",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        prefix,
        "--log-format",
        "text",
        "--log-level",
        "warning",
    ]
    proc = hygiene.popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return None


@pytest.fixture(scope="module")
def fleet(kafka: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    prefix = f"cbfleet-{new_id()}."
    start_ms = past_hour_ms(6)
    produce_fleet(kafka, prefix, start_ms)
    samples, _ = SimulatedFleet(
        FleetConfig(nodes=NODES, gpus_per_node=GPUS, interval_ms=INTERVAL_S * 1000, seed=SEED)
    ).tick(start_ms)
    return {
        "prefix": prefix,
        "start_ms": start_ms,
        "gpus": len(samples),
        "fractions": sum(gpu_fraction(s) for s in samples),  # GPU-seconds per second of the fleet
        "dir": tmp_path_factory.mktemp("chargeback-fleet"),
    }


def run_to_end(kafka: str, fleet: dict, name: str, *args: str) -> list[dict]:
    """One uninterrupted instance over the whole input; returns its output records."""
    prefix, out = fleet["prefix"], f"{fleet['prefix']}out.{name}"
    group = f"cb-{name}-{new_id()}"
    proc = start_service(
        kafka,
        prefix,
        fleet["dir"] / f"{name}.log",
        *WINDOW,
        "--group-id",
        group,
        "--output-topic",
        out,
        *args,
    )
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    try:
        prog.wait_done(60, [proc])
    finally:
        prog.close()
        assert stop_service(proc) == 0, (fleet["dir"] / f"{name}.log").read_text()[-3000:]
    return read_output(kafka, out)


@pytest.fixture(scope="module")
def single(kafka: str, fleet: dict) -> list[dict]:
    return run_to_end(kafka, fleet, "single", "--instance-id", "single")


def test_invariant_and_report_formats(kafka: str, fleet: dict, single: list[dict], capsys) -> None:
    # 11 windows closed (the 12th waits for samples that never come), once each, no corrections.
    starts = sorted({r["window_start_ms"] for r in single})
    assert starts == [fleet["start_ms"] + k * WINDOW_MS for k in range(11)]
    keys = window_keys(single)
    assert len(keys) == len(set(keys)) == len(single)
    # Invariant: per window, the namespaces (with __unallocated__) add up to the GPU-seconds observed.
    per_window = totals(single, ("window_start_ms",))
    observed = fleet["fractions"] * WINDOW_MS / 1000
    for (ws,), t in per_window.items():
        assert abs(t["allocated_gpu_seconds"] - observed) <= INTERVAL_S * fleet["gpus"], ws
        assert t["allocated_gpu_seconds"] == pytest.approx(observed, rel=1e-9)  # no gaps in this input
        assert t["sample_count"] >= fleet["gpus"] * WINDOW_MS / 1000 / INTERVAL_S
        assert 0 < t["used_gpu_seconds"] <= t["allocated_gpu_seconds"]
        assert t["energy_joules"] > 0 and t["cost_total"] > 0
    namespaces = {r["namespace"] for r in single}
    assert "__unallocated__" in namespaces and len(namespaces) > 3
    assert sum(r["mig_gpu_seconds"] for r in single) > 0  # the fleet has a MIG node with seed 6

    # The report command on this topic, in every format (in-process, plus the real CLI once).
    frm = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(fleet["start_ms"] / 1000))
    to = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((fleet["start_ms"] + 3 * WINDOW_MS) / 1000))
    base = [
        "report",
        "chargeback",
        "--bootstrap-servers",
        kafka,
        "--topic",
        f"{fleet['prefix']}out.single",
        "--from",
        frm,
        "--to",
        to,
    ]

    def report(*extra: str) -> str:
        args = build_parser().parse_args([*base, *extra])
        assert args._run(args) == 0
        return capsys.readouterr().out

    rows = json.loads(report("--format", "json"))
    assert {r["window_start"] for r in rows} == {
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((fleet["start_ms"] + k * WINDOW_MS) / 1000))
        for k in range(3)
    }
    gpu_h = sum(r["gpu_hours_allocated"] for r in rows)
    assert gpu_h == pytest.approx(3 * observed / 3600, abs=1e-4)
    assert {
        "window_start",
        "window_end",
        "namespace",
        "team",
        "gpu_hours_allocated",
        "gpu_hours_used",
    } <= set(rows[0]) and {"gpu_hours_idle", "energy_kwh", "cost"} <= set(rows[0])
    assert any(r["namespace"] == "__unallocated__" for r in rows)

    table = report("--format", "table", "--by", "team", "--teams", "deploy/teams.example.yaml")
    assert table.splitlines()[0].startswith("WINDOW START") and "TOTAL" in table
    assert f"{gpu_h:.2f}" in table.splitlines()[-1] or f"{gpu_h:.2f}" in table

    csv_rows = list(csv.DictReader(io.StringIO(report("--format", "csv", "--period", "all"))))
    assert sum(float(r["gpu_hours_allocated"]) for r in csv_rows) == pytest.approx(gpu_h, abs=1e-4)
    assert {r["window_start"] for r in csv_rows} == {frm}

    focus = list(csv.DictReader(io.StringIO(report("--format", "focus", "--provisional"))))  # month open
    assert {"ChargePeriodStart", "ChargePeriodEnd", "BilledCost", "EffectiveCost", "ConsumedQuantity"} <= set(
        focus[0]
    ) and {"ConsumedUnit", "ResourceId", "Tags", "x_Namespace"} <= set(focus[0])
    assert {r["ConsumedUnit"] for r in focus} == {"GPU-Hours", "kWh"}
    gpu_lines = [r for r in focus if r["ConsumedUnit"] == "GPU-Hours"]
    assert sum(float(r["ConsumedQuantity"]) for r in gpu_lines) == pytest.approx(gpu_h, abs=1e-4)
    assert sum(float(r["BilledCost"]) for r in focus) == pytest.approx(sum(r["cost"] for r in rows), abs=1e-3)

    cli = gpupipe(*base, "--format", "jsonl", "--by", "namespace,node", timeout=60)
    assert cli.returncode == 0, cli.stderr
    lines = [json.loads(x) for x in cli.stdout.splitlines()]
    assert sum(r["gpu_hours_allocated"] for r in lines) == pytest.approx(gpu_h, abs=1e-4)
    assert all(r["node"] for r in lines)


def test_kill9_at_random_points_gives_the_same_totals(kafka: str, fleet: dict, single: list[dict]) -> None:
    # The same input, streamed live (two simulated hours in about 24 s) into a topic of its own while
    # the service is killed with SIGKILL after random delays and restarted, five times. The stream
    # must outlast the restarts (each one a process start and a group join, seconds on a loaded
    # machine): at 700x it ended before the fourth kill in CI.
    prefix, name = f"cbkill-{new_id()}.", "kill"
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=prefix)
    group = f"cb-{name}-{new_id()}"
    log = fleet["dir"] / f"{name}.log"
    args = (*WINDOW, "--group-id", group, "--instance-id", "k", "--commit-interval", "100ms")
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    producer = produce_fleet(kafka, prefix, fleet["start_ms"], speed="300", wait=False)
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    total = NODES * GPUS * 720
    mid_stream = 0
    history = []
    try:
        for k in range(5):
            before = prog.committed_total()
            proc = start_service(kafka, prefix, log, *args)
            if k == 2:  # one kill at a random moment of the startup (restore, replay, first commit)
                time.sleep(rng.uniform(0.1, 1.0))
            else:  # the others at a random moment after the instance committed progress of its own
                deadline = time.monotonic() + 10
                while prog.committed_total() <= before and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.6))
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.kill()  # SIGKILL: no commit, no close; maybe an open transaction left behind
            proc.wait()
            after = prog.committed_total()
            history.append((before, after, producer.poll() is None))
            mid_stream += before < after < total  # it made progress and had not reached the end
        assert producer.wait(timeout=60) == 0, producer.stderr.read()[-2000:]
        prog.refresh_high()
        assigned = log.read_text().count("partitions assigned")
        final = start_service(kafka, prefix, log, *args)
        wait_log(log, "partitions assigned", assigned + 1)
        prog.wait_done(60, [final])
        assert stop_service(final) == 0, log.read_text()[-3000:]
    finally:
        prog.close()
        if producer.poll() is None:
            producer.kill()
    # The kills hit a service that was making progress on a live stream (seed and history for replays).
    print(f"kill history (seed {seed}): {history}")
    assert mid_stream >= 3, f"seed {seed}: {history}"
    assert "partition restored" in log.read_text()
    recs = read_output(kafka, prefix + topics.CHARGEBACK)
    # Exactly once: every final window record once; the same records and totals as the uninterrupted run.
    assert window_keys(recs) == window_keys(single), f"seed {seed}: {history}"
    key = ("window_start_ms", "namespace", "node", "gpu_model")
    assert_same_totals(totals(recs, key), totals(single, key))
    assert_same_totals(totals(recs), totals(single))


def test_two_instances_split_partitions_and_give_the_same_totals(
    kafka: str, fleet: dict, single: list[dict]
) -> None:
    # The same input streamed live into a topic of its own; a second instance joins the group
    # while the first is mid-stream, so the first commits and hands over partitions with open
    # windows, which the second rebuilds by replay from the checkpoints.
    prefix = f"cbtwo-{new_id()}."
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=prefix)
    group = f"cb-two-{new_id()}"
    logs = [fleet["dir"] / f"two-{i}.log" for i in "ab"]
    args = (*WINDOW, "--group-id", group, "--commit-interval", "200ms")
    producer = produce_fleet(kafka, prefix, fleet["start_ms"], speed="300", wait=False)
    assert producer is not None
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    procs: list[subprocess.Popen] = []
    try:
        # The stream is held mid-way (the producer stopped) until the second instance has its
        # partitions: the handover then happens with input still to come on any machine, where
        # racing a producer at full speed lost on a loaded one.
        deadline = time.monotonic() + 60
        while True:
            prog.refresh_high()
            if sum(prog.high.values()) >= 2000:
                break
            assert time.monotonic() < deadline and producer.poll() is None, "the fleet never produced"
            time.sleep(0.05)
        os.kill(producer.pid, signal.SIGSTOP)
        procs.append(start_service(kafka, prefix, logs[0], *args, "--instance-id", "inst-0"))
        deadline = time.monotonic() + 20
        while prog.committed_total() == 0:
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-2000:]
            time.sleep(0.05)
        procs.append(start_service(kafka, prefix, logs[1], *args, "--instance-id", "inst-1"))
        admin = AdminClient({"bootstrap.servers": kafka})
        while True:
            desc = admin.describe_consumer_groups([group])[group].result()
            assigned = [len(m.assignment.topic_partitions) for m in desc.members]
            if str(desc.state).endswith("STABLE") and len(assigned) == 2 and all(assigned):
                break
            assert time.monotonic() < deadline + 20, f"group never stable with two members: {desc}"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.1)
        handed_over_at = prog.committed_total()
        os.kill(producer.pid, signal.SIGCONT)
        assert producer.wait(timeout=60) == 0, producer.stderr.read()[-2000:]
        prog.refresh_high()
        prog.wait_done(60, procs)
    finally:
        prog.close()
        codes = [stop_service(p) for p in procs]
        if producer.poll() is None:
            producer.kill()  # a stopped process dies of SIGKILL too
    assert codes == [0, 0], [lg.read_text()[-2000:] for lg in logs]
    assert 0 < handed_over_at < sum(prog.high.values())
    assert "partitions revoked" in logs[0].read_text()
    assert "partition restored" in logs[1].read_text()
    recs = read_output(kafka, prefix + topics.CHARGEBACK)
    assert {r["instance_id"] for r in recs} == {"inst-0", "inst-1"}
    assert window_keys(recs) == window_keys(single)
    key = ("window_start_ms", "namespace", "node", "gpu_model")
    assert_same_totals(totals(recs, key), totals(single, key))
