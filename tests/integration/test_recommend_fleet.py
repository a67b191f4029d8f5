"""Idle-GPU recommendations end to end: simulated fleet -> Kafka -> `gpupipe recommend` -> report idle.

Six simulated hours of 4 nodes x 4 GPUs at one sample a minute (5,760 samples, seed 1). The expected
recommendations are computed from the simulator's own ground truth (which pods held which GPU, and
when), not from the detector: every notebook that held its GPU for at least --idle-after (2 h) and
nothing else; a pod still holding its GPU at the end reports its waste as of its last update
(fired at since + 2 h, then every 15 min).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from consumers.chargeback.prices import load_price_table
from producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.conftest import free_port
from tests.integration.chargeback_util import past_hour_ms, stop_service
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe

pytestmark = pytest.mark.integration

NODES, GPUS, INTERVAL_MS, SEED, HOURS = 4, 4, 60_000, 1, 6
IDLE_AFTER_MS, UPDATE_MS = 2 * 3_600_000, 900_000
PRICES = REPO / "deploy" / "prices.example.yaml"


def ground_truth(start_ms: int) -> tuple[dict[tuple[str, str], dict[str, Any]], set[str]]:
    """Per (namespace, pod): first and last sample holding a GPU, model, fraction; and the busy kinds seen."""
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=NODES, gpus_per_node=GPUS, interval_ms=INTERVAL_MS, seed=SEED, xid_rate_per_gpu_hour=0
        )
    )
    held: dict[tuple[str, str], dict[str, Any]] = {}
    for i in range(HOURS * 3_600_000 // INTERVAL_MS):
        ts = start_ms + i * INTERVAL_MS
        samples, _ = fleet.tick(ts)
        for s in samples:
            for a in s["allocations"]:
                h = held.setdefault(
                    (a["namespace"], a["pod"]),
                    {
                        "first": ts,
                        "model": s["model_name"],
                        "mig": s["mig"],
                        "alloc": a,
                        "n": len(s["allocations"]),
                    },
                )
                h["last"] = ts
    return held, {p.split("-")[0] for _, p in held}


def expected(start_ms: int) -> dict[str, dict[str, Any]]:
    held, kinds = ground_truth(start_ms)
    assert {"train", "serve", "notebook"} <= kinds  # busy pods were there to be (not) reported
    end_ms = start_ms + HOURS * 3_600_000
    prices = load_price_table(PRICES)
    out = {}
    for (ns, pod), h in held.items():
        span = h["last"] - h["first"] + INTERVAL_MS
        if not pod.startswith("notebook-") or span < IDLE_AFTER_MS:
            continue
        if h["last"] + INTERVAL_MS < end_ms:  # ended: resolved with its whole span
            idle_ms, status = span, "resolved"
        else:  # still held: the last revision is the last update
            fired = h["first"] + IDLE_AFTER_MS - INTERVAL_MS
            last_update = fired + (h["last"] - fired) // UPDATE_MS * UPDATE_MS
            idle_ms, status = last_update - h["first"] + INTERVAL_MS, "firing"
        fraction = h["mig"]["slice_fraction"] if h["mig"] else 1.0 / h["n"]
        hours = idle_ms / 3_600_000 * fraction
        out[pod] = {
            "namespace": ns,
            "status": status,
            "gpu_hours": hours,
            "cost": hours * prices.gpu_price(h["model"]).per_gpu_hour,
            "owner": f"{ns}/{h['alloc']['owner_kind']}/{h['alloc']['owner_name']}",
            "team": h["alloc"]["labels"]["team"],
        }
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_idle_notebooks_and_nothing_else(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    start_ms = past_hour_ms(HOURS + 1)
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start_ms / 1000))
    want = expected(start_ms)
    assert len(want) == 4 and {w["status"] for w in want.values()} == {"firing", "resolved"}
    common = ["--bootstrap-servers", kafka, "--topic-prefix", topic_prefix, "--log-format", "text"]
    p = gpupipe(
        "produce", "--source", "simulated", "--nodes", str(NODES), "--gpus-per-node", str(GPUS),
        "--interval", "60s", "--duration", f"{HOURS}h", "--start-time", start_iso, "--speed", "max",
        "--seed", str(SEED), "--xid-rate", "0", "--log-level", "warning", *common,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    port = free_port()
    log = open(tmp_path / "recommend.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [*GPUPIPE, "recommend", "--from-beginning", "--prices", str(PRICES), "--listen", f"127.0.0.1:{port}",
         "--group-id", f"rec-{topic_prefix}", *common],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "recommend.log").read_text()[-3000:]
            try:
                text = scrape(port)
            except OSError:
                text = ""
            if metric(text, "gpupipe_consumer_records_total") >= NODES * GPUS * HOURS * 60:
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.2)
        # Open recommendations are Prometheus series, one per idle pod and GPU.
        firing = {k: w for k, w in want.items() if w["status"] == "firing"}
        assert metric(text, "gpupipe_recommendations_open") == len(firing)
        for pod, w in firing.items():
            assert metric(
                text, "gpupipe_recommendation_cost_wasted", pod=pod, owner=w["owner"].split("/", 1)[1]
            ) == (pytest.approx(w["cost"], rel=1e-9))
        assert not re.search(r'gpupipe_recommendation_idle_seconds\{[^}]*pod="(train|serve|batch)-', text)
    finally:
        assert stop_service(proc) == 0
        log.close()

    # report idle reads the topic by itself: per pod, exact waste; per owner and team; nothing busy.
    p = gpupipe("report", "idle", "--since", "7d", "--by", "pod", "--format", "json", *common)
    assert p.returncode == 0, p.stderr
    rows = {r["group"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {f"{w['namespace']}/{pod}" for pod, w in want.items()}
    for pod, w in want.items():
        row = rows[f"{w['namespace']}/{pod}"]
        assert row["gpu_hours_idle"] == pytest.approx(w["gpu_hours"], abs=1e-6)
        assert row["cost_wasted"] == pytest.approx(w["cost"], abs=1e-6)
        assert row["open"] == (w["status"] == "firing")
        assert row["top_action"] in ("right_size_mig", "shared_gpu")
    p = gpupipe("report", "idle", "--since", "7d", "--by", "owner", "--format", "json", *common)
    owners = {r["group"]: r["cost_wasted"] for r in json.loads(p.stdout)}
    assert owners == {w["owner"]: pytest.approx(w["cost"], abs=1e-6) for w in want.values()}
    p = gpupipe("report", "idle", "--since", "7d", "--by", "namespace", *common)
    assert p.returncode == 0 and p.stdout.splitlines()[1].split()[:4] == ["notebooks", "4", "2", "4"], (
        p.stdout
    )
    total = sum(w["cost"] for w in want.values())
    assert p.stdout.splitlines()[-1].endswith(f"{total:.2f} USD wasted")
