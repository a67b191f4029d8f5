"""The GPU-hours recipes (docs/recipes/gpu-hours.md) bill what chargeback bills, to 1e-9.

One input over a real broker, in the raw framing with lz4: an hour of a simulated fleet with whole,
MIG and time-sliced GPUs (`gpupipe produce`), and beside it, on a node of their own, GPUs through
every case of the shared-GPU split and MIG GPUs' own records with uncovered capacity. `gpupipe
chargeback` bills it; the plain-Avro recipe reads the topic, and DuckDB's own iceberg extension
reads the samples table `gpupipe lake write` made of it. Each must give chargeback's GPU-seconds
per (hour, namespace). The Spark recipe is checked the same way in
tests/integration/consumers/lake/test_spark.py; Flink's in test_flink_gpu_hours.py, which `make
recipe-check` runs (a minute or more of Flink: not in `make test`).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe_consumers.chargeback.accounting import gpu_fraction
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import RAW, AvroCodec
from gpupipe_schemas.meaning import sample_kafka_key
from tests import hygiene
from tests.conftest import free_port
from tests.integration.chargeback_util import (
    Progress,
    new_id,
    past_hour_ms,
    read_output,
    start_service,
    stop_service,
)
from tests.integration.consumers.lake.test_spark import _dra_shared, _time_sliced
from tests.integration.kafka_util import GPUPIPE, gpupipe
from tests.integration.metrics_helpers import http_get
from tests.paths import REPO

pytestmark = pytest.mark.integration

RECIPES = REPO / "docs" / "recipes"
HOUR_MS = 3_600_000
INTERVAL_MS = 10_000
#: (window start ms, namespace) -> GPU-seconds
Bill = dict[tuple[int, str], float]


def edge_samples(start_ms: int) -> list[dict[str, Any]]:
    """An hour of one MIG node of its own: two whole GPUs turned into a time-sliced GPU through
    every case of the split and a DRA-shared one, and its two MIG slices with their GPU's own
    record (2/7 of it unconfigured: uncovered capacity)."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=1,
            gpus_per_node=4,
            interval_ms=INTERVAL_MS,
            mig_node_ratio=0,
            shared_node_ratio=0,
            mig_nodes=(0,),
            seed=77,
            hostname_prefix="edge",
        )
    )
    out = []
    for i in range(HOUR_MS // INTERVAL_MS):
        samples, _ = fleet.tick(start_ms + i * INTERVAL_MS)
        assert [bool(s["mig"]) for s in samples] == [False, False, True, True]
        _time_sliced(samples[0], i * 4)  # every case in 48 samples
        for proc in samples[0]["processes"]:  # a ratio over 1 is refused on input: at most 1
            if proc["sm_util_ratio"] is not None:
                proc["sm_util_ratio"] = min(proc["sm_util_ratio"], 1.0)
        _dra_shared(samples[1], i * 6)
        for s in samples[2:]:
            s["mig_enabled"] = True
        parent = dict(samples[2], mig=None, mig_enabled=True, allocations=[], processes=[])
        parent["mig_configured_fraction"] = 5 / 7
        out += [*samples, parent]
    return out


def produce_edges(kafka: str, topic: str, samples: list[dict[str, Any]]) -> None:
    enc = AvroCodec().encoder("GpuSample", topic, framing=RAW)
    p = Producer({"bootstrap.servers": kafka, "compression.type": "lz4", "linger.ms": 20})
    for s in samples:
        p.produce(topic, enc.encode(s), sample_kafka_key(s), headers=enc.headers)
    assert p.flush(30) == 0


@pytest.fixture(scope="module")
def fleet(kafka: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    prefix = f"recipes-{new_id()}."
    start_ms = past_hour_ms(3)
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    res = gpupipe(
        *("produce", "--source", "simulated", "--nodes", "3", "--gpus-per-node", "4"),
        *("--mig-nodes", "1", "--shared-nodes", "2", "--interval", "10s", "--duration", "1h"),
        *("--start-time", start_iso, "--speed", "max", "--xid-rate", "0"),
        *("--framing", "samples=raw", "--compression", "lz4", "--create-topics"),
        *("--bootstrap-servers", kafka, "--topic-prefix", prefix, "--log-level", "warning"),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    edges = edge_samples(start_ms)
    produce_edges(kafka, prefix + topics.SAMPLES, edges)
    # Every key samples each 10 s for the hour: its fraction of a GPU for 3600 s; the MIG-mode
    # GPU's own record its uncovered 2/7.
    first, _ = SimulatedFleet(
        FleetConfig(nodes=3, gpus_per_node=4, interval_ms=INTERVAL_MS, mig_nodes=(1,), shared_nodes=(2,))
    ).tick(start_ms)
    fractions = sum(map(gpu_fraction, first)) + sum(map(gpu_fraction, edges[:4])) + 2 / 7
    return {
        "prefix": prefix,
        "samples": 3 * 4 * 360 + len(edges),
        "observed_s": fractions * 3600.0,
        "dir": tmp_path_factory.mktemp("recipes"),
    }


@pytest.fixture(scope="module")
def chargeback(kafka: str, fleet: dict[str, Any]) -> Bill:
    """What `gpupipe chargeback` billed, every window closed (the idle partitions' event time moves
    to broker time), each record once."""
    prefix, group = fleet["prefix"], f"recipes-cb-{new_id()}"
    log = fleet["dir"] / "chargeback.log"
    proc = start_service(
        kafka,
        prefix,
        log,
        *("--window", "1h", "--grace", "5m", "--idle-timeout", "2s", "--commit-interval", "200ms"),
        *("--group-id", group, "--create-topics"),
    )
    prog = Progress(kafka, group, prefix + topics.SAMPLES)
    bill: Bill = defaultdict(float)
    try:
        prog.wait_done(90, [proc])
        # Then every window closes (--idle-timeout moves the idle partitions' event time to broker
        # time): until the rows add up to the GPU-seconds observed (the invariant), each record once.
        deadline = time.monotonic() + 60
        while True:
            bill.clear()
            seen = set()
            for r in read_output(kafka, prefix + topics.CHARGEBACK):
                if r["record_id"] not in seen:
                    seen.add(r["record_id"])
                    bill[(r["window_start_ms"], r["namespace"])] += r["allocated_gpu_seconds"]
            if abs(sum(bill.values()) - fleet["observed_s"]) < 1e-6:
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{sum(bill.values())} of {fleet['observed_s']} GPU-s billed"
            time.sleep(0.5)
    finally:
        prog.close()
        assert stop_service(proc) == 0, log.read_text()[-3000:]
    return dict(bill)


def recipe_bill(stdout: str) -> Bill:
    """A recipe's ``window_ms<TAB>namespace<TAB>gpu_hours`` lines as GPU-seconds."""
    out: Bill = {}
    for line in stdout.splitlines():
        window, ns, hours = line.split("\t")
        out[(int(window), ns)] = float(hours) * 3600.0
    return out


def assert_agrees(got: Bill, want: Bill) -> None:
    # __mig_shared__ rows carry energy alone (a MIG-mode GPU's energy without per-slice counters)
    want = {k: v for k, v in want.items() if v != 0.0}
    assert {ns for _, ns in want} >= {
        "__unallocated__",
        "__unattributed__",
        "tenant-alone",
        "tenant-guest",
        "tenant-dra-e",
    }
    wrong = [
        (k, got.get(k), v)
        for k, v in sorted(want.items())
        if k not in got or abs(got[k] - v) > 1e-9 * max(abs(v), 1e-300)
    ]
    assert not wrong, "differ (key, recipe, chargeback): " + "; ".join(map(str, wrong[:10]))
    assert set(got) == set(want)


def run(argv: list[str], cwd: Path, timeout: float = 180) -> str:
    proc = hygiene.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        hygiene.stop_group(proc)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_plain_avro_recipe_bills_as_chargeback(kafka: str, fleet: dict[str, Any], chargeback: Bill) -> None:
    recipe = RECIPES / "avro_gpu_hours.py"
    imported = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(ast.parse(recipe.read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert imported - sys.stdlib_module_names == {"fastavro", "confluent_kafka", "gpu_shares"}
    avsc = REPO / "schemas" / "GpuSample.avsc"
    out = run([sys.executable, str(recipe), kafka, str(avsc), fleet["prefix"] + topics.SAMPLES], fleet["dir"])
    assert_agrees(recipe_bill(out), chargeback)


def test_duckdb_iceberg_recipe_over_the_lake_bills_as_chargeback(
    kafka: str, fleet: dict[str, Any], chargeback: Bill
) -> None:
    tmp = fleet["dir"]
    (tmp / "warehouse").mkdir()
    port = free_port()
    log = open(tmp / "lake.log", "w")  # noqa: SIM115 (the process' lifetime)
    lake = hygiene.popen(
        [
            *GPUPIPE,
            *("lake", "write", "--tables", "samples", "--catalog-uri", f"sqlite:///{tmp}/catalog.db"),
            *("--warehouse", str(tmp / "warehouse"), "--flush-interval", "300ms"),
            *("--bootstrap-servers", kafka, "--topic-prefix", fleet["prefix"]),
            *("--group-id", f"recipes-lake-{new_id()}", "--listen", f"127.0.0.1:{port}"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert lake.poll() is None, (tmp / "lake.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp / "lake.log").read_text()[-3000:]
            try:
                text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
            except OSError:
                text = ""
            m = re.search(r'gpupipe_lake_rows_total\{table="samples"\} (\S+)', text)
            if m and float(m.group(1)) >= fleet["samples"]:
                break
            time.sleep(0.3)
    finally:
        assert hygiene.stop_group(lake) == 0, (tmp / "lake.log").read_text()[-3000:]
    table = tmp / "warehouse" / "gpupipe" / "samples"
    hint = (table / "metadata" / "version-hint.text").read_text()
    assert (table / "metadata" / f"{hint}.metadata.json").is_file()
    python, ext_dir = (
        subprocess.run(
            [str(REPO / "scripts" / "duckdb-iceberg")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        .stdout.splitlines()[-1]
        .split(" ")
    )
    recipe = RECIPES / "duckdb_gpu_hours.py"
    out = run([python, str(recipe), str(table), "--extension-directory", ext_dir], tmp)
    assert_agrees(recipe_bill(out), chargeback)
