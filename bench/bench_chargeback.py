"""Benchmark: chargeback throughput, transactions included, on the benchmark broker.

Input: 200k GpuSample records of a simulated fleet (10 nodes x 8 GPUs, 10 s interval, 2500 ticks),
produced once to a fresh topic. Then, on that same input:

1. ours: `gpupipe chargeback` (1 h windows, exactly-once transactions every second) as a
   subprocess, timed from its start until its committed checkpoints say the whole input was
   processed (the replay_until in the commit metadata reaches the high watermark everywhere);
2. quix: an equivalent Quix Streams application (decode the same Avro with the same projected
   reader schema, split each sample's GPU-seconds, used seconds and energy per namespace,
   `group_by` namespace, 1 h tumbling-window sums, `processing_guarantee="exactly-once"`, commit
   every second) in its own virtualenv (.bench-venv, created on first use: its confluent-kafka pin
   differs from ours), timed the same way (input and repartition topic committed to the end);
3. floors, measured in this run on the same records, in this process: ``decode``, the service's
   own decoder (``service.sample_decoder``) over the payloads; ``consume``, a bare confluent-kafka
   consumption of the topic (values read, nothing decoded);
4. the in-process per-sample path (bench/chargeback_path.py: ``ChargebackService.process`` on
   in-memory messages, no Kafka, no transactions) against the decoder beside it, and against the
   absolute budget of 20 us per sample, labelled as such.

Prints `chargeback_vs_quix ratio=<quix_s/ours_s> target=2.00`, `chargeback_vs_decode
ratio=<decode_s/ours_s>` and `chargeback_vs_consume ratio=<consume_s/ours_s>` (the share of the
service's time its floors take; targets: those floors' shares at 20 us per sample), the path's
lines and the absolute rates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import chargeback_path
from common import REPO, bench_kafka, best_of, figure, ratio_line
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from gpupipe.kafka import topics
from gpupipe_consumers.chargeback.service import sample_decoder
from gpupipe_consumers.chargeback.settings import projected_sample_schema
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

NODES, GPUS, INTERVAL_S, TICKS = 10, 8, 10, 2500
SAMPLES = NODES * GPUS * TICKS
BENCH_VENV = REPO / ".bench-venv"
QUIX_REQUIREMENTS = ["quixstreams", "fastavro"]
#: The budget for a sample, and the floors the targets assume (decoder, bare consume; both
#: measured in the run, these only set the targets): 6 us of decode and 3.5 us of consume in 20 us.
BUDGET_US, DECODE_US, CONSUME_US = chargeback_path.BUDGET_US, 6.0, 3.5

# The Quix Streams application (runs in .bench-venv); argv: bootstrap in_topic out_topic group state_dir
QUIX_APP = r'''
import io, json, sys
from fastavro import parse_schema, schemaless_reader
from quixstreams import Application
from quixstreams.dataframe.windows import Sum
from quixstreams.models.serializers import Deserializer

bootstrap, in_topic, out_topic, group, state_dir, schemas = sys.argv[1:7]
writer_raw, reader_raw = json.loads(open(schemas).read())
WRITER, READER = parse_schema(writer_raw), parse_schema(reader_raw)


class AvroSample(Deserializer):
    """Single-object encoding: 10-byte header, then Avro; decoded with the projected reader schema."""

    def __call__(self, value, ctx):
        return schemaless_reader(io.BytesIO(value[10:]), WRITER, READER)


def split(s):
    """The sample's GPU-seconds, used GPU-seconds and energy, per namespace (as chargeback splits)."""
    dt = (s["interval_ms"] or 10000) / 1000.0
    mig = s["mig"]
    frac = mig["slice_fraction"] if mig else (0.0 if s["mig_enabled"] else 1.0)
    act = s["sm_active_ratio"] if s["sm_active_ratio"] is not None else (s["gpu_util_ratio"] or 0.0)
    energy = (s["power_w"] or 0.0) * dt
    pods = []
    for a in s["allocations"]:
        if (a["namespace"], a["pod"]) not in pods:
            pods.append((a["namespace"], a["pod"]))
    if not pods:
        pods = [("__unallocated__", None)]
    w = 1.0 / len(pods)
    return [
        {"ns": ns, "alloc": dt * frac * w, "used": dt * frac * w * act, "energy": energy * w}
        for ns, _ in pods
    ]


app = Application(
    broker_address=bootstrap,
    consumer_group=group,
    auto_offset_reset="earliest",
    processing_guarantee="exactly-once",
    commit_interval=1.0,
    state_dir=state_dir,
    loglevel="WARNING",
)
src = app.topic(
    in_topic,
    value_deserializer=AvroSample(),
    timestamp_extractor=lambda value, headers, ts, ts_type: value["timestamp_ms"],
)
out = app.topic(out_topic, value_serializer="json")
sdf = app.dataframe(src)
sdf = sdf.apply(split, expand=True)
sdf = sdf.group_by("ns")
sdf = sdf.tumbling_window(3_600_000, grace_ms=300_000).agg(
    alloc=Sum("alloc"), used=Sum("used"), energy=Sum("energy")
).final()
sdf = sdf.to_topic(out)
app.run()
'''


def produce_input(bootstrap: str, prefix: str) -> None:
    now = int(time.time())
    start = time.strftime("%Y-%m-%dT%H:00:00Z", time.gmtime(now - 12 * 3600))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpupipe",
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
            f"{TICKS * INTERVAL_S}s",
            "--start-time",
            start,
            "--speed",
            "max",
            "--seed",
            "3",
            "--xid-rate",
            "0",
            "--bootstrap-servers",
            bootstrap,
            "--topic-prefix",
            prefix,
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"producing the input failed:\n{proc.stderr[-2000:]}")


def read_payloads(bootstrap: str, topic: str) -> list[bytes]:
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}", "enable.auto.commit": False}
    )
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out: list[bytes] = []
    deadline = time.monotonic() + 120
    while len(out) < SAMPLES and time.monotonic() < deadline:
        out += [m.value() for m in c.consume(10_000, 1.0) if m.error() is None]
    c.close()
    if len(out) != SAMPLES:
        raise SystemExit(f"expected {SAMPLES} input records, read {len(out)}")
    return out


def decode_s(payloads: list[bytes]) -> float:
    """The service's own decoder over the payloads (its caches warm, as in a running service)."""
    decode = sample_decoder(
        AvroCodec(reader_schemas={"GpuSample": projected_sample_schema(catalog.current("GpuSample").raw)})
    )
    for v in payloads[:1000]:
        decode(v)

    def once() -> float:
        t = time.perf_counter()
        for v in payloads:
            decode(v)
        return time.perf_counter() - t

    return best_of(2, once)


def consume_s(bootstrap: str, topic: str) -> float:
    """A bare consumption of the whole topic from its start: values read, nothing decoded."""

    def once() -> float:
        c = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4()}", "enable.auto.commit": False}
        )
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        n, t = 0, time.perf_counter()
        deadline = t + 120
        while n < SAMPLES and time.perf_counter() < deadline:
            for m in c.consume(10_000, 1.0):
                if m.error() is None:
                    m.value()
                    n += 1
        dt = time.perf_counter() - t
        c.close()
        if n != SAMPLES:
            raise SystemExit(f"expected {SAMPLES} input records, consumed {n}")
        return dt

    return best_of(2, once)


class Committed:
    """Polls a group's committed offsets (read_uncommitted: never waits on pending transactions)."""

    def __init__(self, bootstrap: str, group: str) -> None:
        self.c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
            }
        )
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.group = group

    def high(self, topic: str) -> dict[int, int]:
        parts = self.c.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: self.c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}

    def committed(self, topic: str, parts: list[int]) -> list[TopicPartition]:
        return self.c.committed([TopicPartition(topic, p) for p in parts], timeout=10)

    def group_topics(self) -> set[str]:
        from confluent_kafka import ConsumerGroupTopicPartitions

        fut = self.admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(self.group)])[self.group]
        return {tp.topic for tp in fut.result().topic_partitions}

    def close(self) -> None:
        self.c.close()


def time_until(proc: subprocess.Popen, done, began: float, what: str, timeout: float = 900) -> float:
    while not done():
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before finishing")
        if time.monotonic() - began > timeout:
            raise SystemExit(f"{what} did not finish in {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - began


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_ours(bootstrap: str, prefix: str, in_topic: str, log: Path) -> float:
    group = f"bench-cb-{uuid.uuid4().hex[:8]}"
    probe = Committed(bootstrap, group)
    high = probe.high(in_topic)
    parts = sorted(high)

    def done() -> bool:
        for tp in probe.committed(in_topic, parts):
            until = json.loads(tp.metadata)["until"] if tp.offset >= 0 and tp.metadata else 0
            if until < high[tp.partition]:
                return False
        return True

    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpupipe",
                "chargeback",
                "--bootstrap-servers",
                bootstrap,
                "--topic-prefix",
                prefix,
                "--group-id",
                group,
                "--instance-id",
                "bench",
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            return time_until(proc, done, began, "gpupipe chargeback")
        finally:
            stop(proc)
            probe.close()


def ensure_bench_venv() -> Path:
    python = BENCH_VENV / "bin" / "python"
    if python.exists():
        ok = subprocess.run([str(python), "-c", "import quixstreams, fastavro"], capture_output=True)
        if ok.returncode == 0:
            return python
    print("  (creating .bench-venv with Quix Streams; first run only)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *QUIX_REQUIREMENTS], capture_output=True, text=True
    )
    if pip.returncode != 0:
        raise SystemExit(f"cannot install Quix Streams into {BENCH_VENV}:\n{pip.stderr[-2000:]}")
    return python


def run_quix(bootstrap: str, in_topic: str, out_topic: str, workdir: Path, log: Path) -> float:
    python = ensure_bench_venv()
    app = workdir / "quix_app.py"
    app.write_text(QUIX_APP)
    schemas = workdir / "schemas.json"
    writer = catalog.strip_logical_types(catalog.current("GpuSample").raw)
    reader = catalog.strip_logical_types(projected_sample_schema(catalog.current("GpuSample").raw))
    schemas.write_text(json.dumps([writer, reader]))
    group = f"bench-quix-{uuid.uuid4().hex[:8]}"
    probe = Committed(bootstrap, group)
    high_in = probe.high(in_topic)
    last_repart: dict[str, dict[int, int]] = {}

    def done() -> bool:
        for tp in probe.committed(in_topic, sorted(high_in)):
            if tp.offset < high_in[tp.partition]:
                return False
        # The repartition topic (group_by) must be drained too: committed at its end (a commit
        # marker may follow the last record) and no longer growing.
        repart = [t for t in probe.group_topics() if t != in_topic]
        if not repart:
            return False
        for t in repart:
            high = probe.high(t)
            committed = {tp.partition: tp.offset for tp in probe.committed(t, sorted(high))}
            if any(committed.get(p, -1) < h - 1 for p, h in high.items() if h > 0):
                return False
            if last_repart.get(t) != high:
                last_repart[t] = high
                return False
        return True

    began = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(python),
                str(app),
                bootstrap,
                in_topic,
                out_topic,
                group,
                str(workdir / "state"),
                str(schemas),
            ],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            return time_until(proc, done, began, "the Quix Streams app")
        finally:
            stop(proc)
            probe.close()


def main() -> None:
    bootstrap = bench_kafka()
    prefix = f"bench-cb-{uuid.uuid4().hex[:8]}."
    in_topic = topics.with_prefix(prefix, topics.SAMPLES)
    t = time.perf_counter()
    produce_input(bootstrap, prefix)
    figure("input_samples", SAMPLES)
    figure("produce_s", time.perf_counter() - t, "s")
    payloads = read_payloads(bootstrap, in_topic)
    dec_s = decode_s(payloads)
    del payloads
    figure("decode_us", dec_s / SAMPLES * 1e6, "us/sample (the service's own decoder, same records)")
    cons_s = consume_s(bootstrap, in_topic)
    figure("consume_us", cons_s / SAMPLES * 1e6, "us/sample (bare confluent-kafka consume, same records)")
    with tempfile.TemporaryDirectory(prefix="bench-chargeback-") as tmp:
        work = Path(tmp)
        ours_s = run_ours(bootstrap, prefix, in_topic, work / "chargeback.log")
        figure("chargeback_s", ours_s, "s (process start to input committed, transactions included)")
        figure("chargeback_samples_per_s", SAMPLES / ours_s, "samples/s")
        figure("chargeback_us", ours_s / SAMPLES * 1e6, "us/sample (whole process, transactions included)")
        # floors measured beside it; targets: each floor's share of 20 us per sample
        ratio_line("chargeback_vs_decode", dec_s / ours_s, DECODE_US / BUDGET_US)
        ratio_line("chargeback_vs_consume", cons_s / ours_s, CONSUME_US / BUDGET_US)
        chargeback_path.report(chargeback_path.measure())
        if os.environ.get("GPUPIPE_BENCH_SKIP_QUIX"):
            print("  quix: skipped (GPUPIPE_BENCH_SKIP_QUIX)")
            return
        quix_s = run_quix(bootstrap, in_topic, f"{prefix}quix.out", work, work / "quix.log")
        figure("quix_s", quix_s, "s (process start to input and repartition topic committed)")
        figure("quix_samples_per_s", SAMPLES / quix_s, "samples/s")
        ratio_line("chargeback_vs_quix", quix_s / ours_s, 2.00)


if __name__ == "__main__":
    main()
