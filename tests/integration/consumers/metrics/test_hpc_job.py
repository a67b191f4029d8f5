"""HPC jobs through Kafka and a running `gpupipe metrics`: the ``hpc_job`` label, end to end.

The producer's ``--hpc-job-mapping-dir`` turns each Slurm job holding a GPU into an allocation with
``hpc_job`` (producer/podmeta/hpc_jobs.py); docs/node-agent.md says the metrics then carry
``hpc_job="<id>"``, one series per job, as dcgm-exporter's HPC mapping (and no pod labels on those
series). The render-level
tests (tests/unit/consumers/metrics/test_hpc_job.py) check the exposition of a sample in hand; this one checks
that the attribution survives the Avro schema, the broker and the service's decoder: a GpuSample
whose allocations are two jobs is produced, /metrics shows two series for it, one per job; after the
epilog removed one job (the next sample holds only the other) its series is gone.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.podmeta.hpc_jobs import job_allocation
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.conftest import free_port
from tests.integration.metrics_helpers import (
    CraftedProducer,
    http_get,
    parse_exposition,
    promtool_check,
    start_metrics,
    wait_for,
)

pytestmark = pytest.mark.integration


def series(port: int, name: str, gpu: str) -> list[dict[str, str]]:
    """Label sets of ``name`` for GPU ``gpu`` in one scrape of /metrics."""
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    return [labels for n, labels, _ in parse_exposition(text) if n == name and labels.get("UUID") == gpu]


def test_an_hpc_job_sample_is_served_with_its_hpc_job_label(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    metrics = start_metrics(
        kafka,
        topic_prefix,
        port,
        tmp_path / "metrics.log",
        "--group-id",
        f"metrics-hpc-{uuid.uuid4().hex[:8]}",
        "--from-beginning",  # "latest" is resolved after assignment: records sent now could be skipped
    )
    out = CraftedProducer(kafka)
    try:
        tmpl = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1)).tick(int(time.time() * 1000))[0][0]
        gpu = f"GPU-hpc-{uuid.uuid4().hex[:8]}"
        topic = topic_prefix + "gpu.samples.v1"

        def publish(jobs: list[str]) -> None:
            rec: dict[str, Any] = {
                **tmpl,
                "uuid": gpu,
                "hostname": "slurm-node-1",
                "mig": None,
                "processes": [],
                "gpu_temp_c": 61,
                "interval_ms": 60_000,  # stays served while the test runs without new samples
                "timestamp_ms": int(time.time() * 1000),
                "allocations": [job_allocation(j) for j in jobs],
            }
            out.sample(topic, rec)
            out.flush()

        def temp_series() -> list[dict[str, str]]:
            assert metrics.alive(), f"metrics service exited:\n{metrics.log_tail()}"
            return series(port, "DCGM_FI_DEV_GPU_TEMP", gpu)

        # the service creates the topics it reads: produce once it serves
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz"), 60, "the metrics service up")
        publish(["4242", "4243"])
        got = wait_for(lambda: (lambda s: s if len(s) == 2 else None)(temp_series()), 30, "two job series")
        assert sorted(s["hpc_job"] for s in got) == ["4242", "4243"], got
        for s in got:  # as dcgm-exporter: the job label, no pod labels
            assert not {"pod", "namespace", "container"} & s.keys(), s
            assert s["Hostname"] == "slurm-node-1", s
        assert promtool_check(http_get(f"http://127.0.0.1:{port}/metrics")) == []

        publish(["4243"])  # job 4242's epilog removed its mapping file
        wait_for(
            lambda: [s.get("hpc_job") for s in temp_series()] == ["4243"], 20, "job 4242's series to vanish"
        )
    finally:
        out.flush()
        assert metrics.stop() == 0, metrics.log_tail()
