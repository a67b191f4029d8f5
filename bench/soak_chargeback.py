"""Issue 10 soak: chargeback under every failure at once, against closed-form totals (not in `make test`).

A synthetic fleet (default 10k GPUs, 2 simulated hours, one sample per GPU every 30 s) whose bill
is known in closed form: every GPU is held by one namespace for the whole run and samples at a
fixed interval, so each sample bills exactly one interval, its energy counter rises at a fixed
power, and the price of a sample is the price table's entry for the hour its (stamped) time falls
in. Into that input go:

* a price change at the start of the second hour (an effective-dated price file);
* a skewed node whose clock runs 10 minutes ahead (its samples land in shifted windows);
* an idle partition: the GPUs keyed to partition 0 stop after the first hour.

The input is produced to a broker of the soak's own (scripts/kafka-local on a free port), then
consumed by `gpupipe chargeback` while, at random moments: a second instance joins (rebalance to
two) and later leaves (back to one), an instance is killed with SIGKILL and restarted, and the
broker is restarted. After the input is consumed, --idle-timeout closes every window by broker
time and the checkpoints reach the end. `gpupipe report chargeback` (de-duplicating) must then
equal the closed-form totals per namespace (GPU-seconds, energy, cost) to 1e-9 relative.

Prints `chargeback_soak_exact ratio=1.000000000 target=1.000000000` when exact (ratio = 1 - the
largest relative error) and the fault history. Scale: --gpus, --hours, --interval; a smaller run
(e.g. --gpus 400) takes a few minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import REPO, figure, ratio_line
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from consumers.chargeback.synthetic import blank_sample
from consumers.report.chargeback_report import build_report
from consumers.report.reader import Deduplicator, deduplicated, iter_chargeback_records
from gpupipe import topics
from gpupipe.kafka_admin import ensure_topics
from schemas.codec import AvroCodec

H = 3_600_000
NAMESPACES = 20
POWER_W = 300.0
PRICE_1, PRICE_2, KWH = 4.0, 5.5, 0.12
SKEW_MS = 600_000
GPUPIPE = [sys.executable, "-m", "gpupipe"]


def free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise SystemExit("no free port pair")


class Broker:
    """A private kafka-local broker that can be restarted on the same port and state."""

    def __init__(self, state: Path) -> None:
        self.port = free_port_pair()
        self.env = {
            **os.environ,
            "KAFKA_LOCAL_DIR": str(state),
            "KAFKA_PORT": str(self.port),
            "KAFKA_CONTROLLER_PORT": str(self.port + 1),
        }
        self.script = str(REPO / "scripts" / "kafka-local")

    def start(self) -> str:
        out = subprocess.run(
            [self.script, "start", "--port", str(self.port)], env=self.env, capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"broker did not start:\n{out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        subprocess.run([self.script, "stop"], env=self.env, capture_output=True, timeout=120)


def start_ms_for(hours: float) -> int:
    """A whole hour far enough in the past that the whole run is before broker time."""
    now = int(time.time() * 1000)
    return now - now % H - int((hours + 3) * H)


def fleet(args: argparse.Namespace, t0: int) -> tuple[list[tuple[bytes, bytes]], dict[str, dict[str, float]]]:
    """(key, value) records in production order, and the closed-form totals per namespace."""
    enc = AvroCodec().encoder("GpuSample").encode
    interval = args.interval * 1000
    ticks = int(args.hours * H // interval)
    expected: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    records: list[tuple[bytes, bytes]] = []
    skewed_node = "node-0001"
    for k in range(ticks):
        true_ts = t0 + k * interval
        for g in range(args.gpus):
            node = f"node-{g // 8:04d}"
            uuid = f"GPU-{g:06d}"
            idle_group = g % args.idle_every == 0  # stops after the first hour (its own partition set)
            if idle_group and true_ts >= t0 + H:
                continue
            ts = true_ts + (SKEW_MS if node == skewed_node else 0)
            ns = f"ns-{g % NAMESPACES:02d}"
            s = blank_sample(
                timestamp_ms=ts,
                hostname=node,
                gpu_index=g % 8,
                uuid=uuid,
                pci_bus_id="00000000:10:00.0",
                model_name="NVIDIA H200",
                allocations=[
                    {
                        "namespace": ns,
                        "pod": f"{ns}-p{g}",
                        "container": "c",
                        "resource_name": None,
                        "replica": None,
                    }
                ],
                interval_ms=interval,
                gpu_lost=False,
                gpu_util_ratio=0.5,
                power_w=POWER_W,
                total_energy_mj=int(POWER_W * (k + 1) * interval),  # mJ: W x ms, continuous
            )
            records.append((uuid.encode(), enc(s)))
            window = ts - ts % H
            price = PRICE_1 if window < t0 + H else PRICE_2
            seconds = interval / 1000
            e = expected[ns]
            e["allocated_gpu_seconds"] += seconds
            e["energy_joules"] += POWER_W * seconds
            e["cost"] += seconds / 3600 * price + POWER_W * seconds / 3.6e6 * KWH
    return records, expected


def produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 50})
    for key, value in records:
        while True:
            try:
                p.produce(topic, value, key)
                break
            except BufferError:
                p.poll(0.05)
    if p.flush(120) != 0:
        raise SystemExit("input not fully produced")


def retried(fn, *args):  # type: ignore[no-untyped-def]
    """Call ``fn`` until the broker answers (a restarted broker loads its coordinators first)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return fn(*args)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def committed(bootstrap: str, group: str, topic: str, parts: list[int]) -> dict[int, tuple[int, int]]:
    return retried(_committed, bootstrap, group, topic, parts)


def ends(bootstrap: str, topic: str, parts: list[int]) -> dict[int, int]:
    return retried(_ends, bootstrap, topic, parts)


def _committed(bootstrap: str, group: str, topic: str, parts: list[int]) -> dict[int, tuple[int, int]]:
    """Per partition: (committed checkpoint offset, replay_until)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        out = {}
        for tp in c.committed([TopicPartition(topic, p) for p in parts], timeout=30):
            until = json.loads(tp.metadata)["until"] if tp.metadata else 0
            out[tp.partition] = (tp.offset, until)
        return out
    finally:
        c.close()


def _ends(bootstrap: str, topic: str, parts: list[int]) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "soak-ends"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=int(os.environ.get("GPUPIPE_SOAK_GPUS", "10000")))
    ap.add_argument("--hours", type=float, default=2.0)
    ap.add_argument("--interval", type=int, default=30, help="seconds between samples of a GPU")
    ap.add_argument("--idle-every", type=int, default=97, help="every Nth GPU stops after the first hour")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="gpupipe-soak-"))
    broker = Broker(work / "kafka")
    bootstrap = broker.start()
    procs: dict[str, subprocess.Popen] = {}
    history: list[str] = []
    try:
        prefix = "soak."
        ensure_topics(bootstrap, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=prefix)
        t_in, t_out = prefix + topics.SAMPLES, prefix + topics.CHARGEBACK
        t0 = start_ms_for(args.hours)
        began = time.monotonic()
        records, expected = fleet(args, t0)
        produce(bootstrap, t_in, records)
        figure("soak_input_samples", len(records))
        figure("soak_produce_seconds", round(time.monotonic() - began, 1))
        prices = work / "prices.yaml"
        valid_from = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((t0 + H) / 1000))
        prices.write_text(
            f"currency: USD\nenergy_per_kwh: {KWH}\ndefault_per_gpu_hour: 1.0\n"
            f"models: [{{match: NVIDIA H200, per_gpu_hour: {PRICE_1}}}]\n"
            f"changes:\n  - valid_from: {valid_from}\n"
            f"    models: [{{match: NVIDIA H200, per_gpu_hour: {PRICE_2}}}]\n"
        )
        group = f"{prefix}gpupipe-chargeback"
        parts = list(range(topics.DEFAULT_SPECS[topics.SAMPLES].partitions))
        log = open(work / "chargeback.log", "a")  # noqa: SIM115

        def start(name: str) -> None:
            procs[name] = subprocess.Popen(
                [
                    *GPUPIPE, "chargeback", "--bootstrap-servers", bootstrap, "--topic-prefix", prefix,
                    "--instance-id", name, "--prices", str(prices), "--idle-timeout", "5s",
                    "--commit-interval", "500ms", "--log-format", "text", "--log-level", "warning",
                ],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            history.append(f"start {name}")

        def stop(name: str, sig: int = signal.SIGTERM) -> None:
            p = procs.pop(name)
            p.send_signal(sig)
            rc = p.wait(timeout=120)
            history.append(f"{'kill -9' if sig == signal.SIGKILL else 'stop'} {name} rc={rc}")

        def progress() -> float:
            c = committed(bootstrap, group, t_in, parts)
            e = ends(bootstrap, t_in, parts)
            return sum(min(c[p][1], e[p]) for p in parts) / max(1, sum(e.values()))

        def supervise() -> None:
            """Restart an instance that exited, as its StatefulSet would (e.g. one that started
            while the broker was down and exited non-zero)."""
            for name, p in list(procs.items()):
                if p.poll() is not None:
                    history.append(f"{name} exited rc={p.returncode}, restarted")
                    del procs[name]
                    start(name)

        def wait_progress(target: float, limit: float) -> None:
            deadline = time.monotonic() + limit
            while progress() < target and time.monotonic() < deadline:
                supervise()
                time.sleep(1)

        start("a")
        wait_progress(rng.uniform(0.05, 0.2), 300)
        start("b")  # rebalance to two instances
        wait_progress(rng.uniform(0.25, 0.4), 300)
        stop("a", signal.SIGKILL)  # kill -9 at a random moment
        start("a")
        wait_progress(rng.uniform(0.45, 0.6), 300)
        broker.stop()  # broker restart under both instances
        history.append("broker stop")
        time.sleep(rng.uniform(1, 5))
        broker.start()
        history.append("broker start")
        supervise()
        wait_progress(rng.uniform(0.65, 0.8), 600)
        stop("b")  # back to one instance
        deadline = time.monotonic() + args.timeout
        while True:  # everything consumed, every window closed by idleness, checkpoints at the end
            c = committed(bootstrap, group, t_in, parts)
            e = ends(bootstrap, t_in, parts)
            if all(c[p][0] >= e[p] for p in parts):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"not done in time: {c} vs {e}")
            supervise()
            time.sleep(1)
        stop("a")
        figure("soak_seconds", round(time.monotonic() - began, 1))
        # The report's own code path (stream, de-duplicate by record_id, aggregate), in-process so
        # that no rounding of a rendered format hides an error.
        dedup = Deduplicator()
        stream = iter_chargeback_records(bootstrap, t_out, AvroCodec(), timeout_s=300)
        rows = build_report(deduplicated(stream, dedup), period="all")
        figure("soak_duplicates_ignored", dedup.dropped)
        got: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for row in rows:
            g = got[row.namespace or ""]
            g["allocated_gpu_seconds"] += row.gpu_hours_allocated * 3600
            g["energy_joules"] += row.energy_kwh * 3.6e6
            g["cost"] += row.cost
        worst, where = 0.0, ""
        for ns in sorted(set(expected) | set(got)):
            for f in ("allocated_gpu_seconds", "energy_joules", "cost"):
                x, y = got[ns][f], expected[ns][f]
                err = abs(x - y) / abs(y) if y else abs(x)
                if err >= worst:
                    worst, where = err, f"{ns} {f}: report {x!r} expected {y!r}"
        figure("soak_namespaces", len(expected))
        figure("soak_worst_relative_error", f"{worst:.3e} ({where})")
        print(f"soak history (seed {seed}): {history}")
        exact = 1.0 if worst <= 1e-9 else 1.0 - worst
        ratio_line("chargeback_soak_exact", exact, 1.0, fmt="%.9f")
        return 0 if worst <= 1e-9 else 1
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
