"""A pause of the input on a real broker: `gpupipe metrics` keeps every GPU's series through it.

Samples stop for 8 s, well past the 3 s (3 x the 1 s interval) after which a GPU's series used to
go, while the consumer keeps running and is scraped every half second. A whole-pipeline stall (a
paused broker, a cut producer link) looks the same to the consumer: nothing arrives. Every scrape
must still carry every GPU, with the pipeline delay growing, and the series must not have been
expired and re-created. Then one GPU stops while the others go on: that one goes, as before.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from tests.integration.metrics_helpers import CraftedProducer, http_get, parse_exposition, wait_for

pytestmark = pytest.mark.integration

PAUSE_S = 8.0  # > the 3 s after which series went, judged by the clock


def temps(text: str) -> set[str]:
    return {lab["UUID"] for n, lab, _ in parse_exposition(text) if n == "DCGM_FI_DEV_GPU_TEMP"}


def value(text: str, name: str) -> float | None:
    vals = [v for n, _, v in parse_exposition(text) if n == name]
    return vals[0] if vals else None


def test_series_outlive_a_pause_of_the_input(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    samples_topic = topic_prefix + "gpu.samples.v1"
    svc = MetricsService(
        MetricsConfig(
            bootstrap=kafka,
            topic_prefix=topic_prefix,
            group_id=f"metrics-{uuid.uuid4().hex[:8]}",
            host="127.0.0.1",
            port=0,
            from_beginning=True,
        )
    ).start()
    try:
        wait_for(lambda: svc.health()[0] and svc.handler.assigned, 60, "the service to be assigned")
        fleet = SimulatedFleet(
            FleetConfig(
                nodes=2, gpus_per_node=2, xid_rate_per_gpu_hour=0, mig_node_ratio=0, shared_node_ratio=0
            )
        )
        tag = uuid.uuid4().hex[:8]
        out = CraftedProducer(kafka)

        def publish(only: set[str] | None = None) -> set[str]:
            recs, _ = fleet.tick(int(time.time() * 1000))
            sent = set()
            for r in recs:
                r = {
                    **r,
                    "mig": None,
                    "uuid": f"GPU-{tag}-{r['hostname']}-{r['gpu_index']}",
                    "interval_ms": 1000,
                }
                if only is None or r["uuid"] in only:
                    out.sample(samples_topic, r)
                    sent.add(r["uuid"])
            out.flush()
            return sent

        gpus = publish()
        assert len(gpus) == 4
        wait_for(lambda: gpus <= temps(http_get(svc.url + "/metrics").decode()), 30, "every GPU served")
        for _ in range(4):  # the input runs at its 1 s interval
            time.sleep(1.0)
            publish()
        text = wait_for(
            lambda: (t := http_get(svc.url + "/metrics").decode()) and gpus <= temps(t) and t,
            10,
            "every GPU served",
        )
        expired_before = value(text, "gpupipe_metrics_expired_total")

        # -- the pause: the consumer runs and is scraped, nothing arrives --------------------------
        paused_at = time.monotonic()
        seen: list[tuple[float, set[str], float | None]] = []
        while time.monotonic() - paused_at < PAUSE_S:
            text = http_get(svc.url + "/metrics").decode()
            seen.append(
                (
                    time.monotonic() - paused_at,
                    gpus - temps(text),
                    value(text, "gpupipe_metrics_pipeline_delay_seconds"),
                )
            )
            time.sleep(0.5)
        missing = [(round(t, 1), sorted(m)) for t, m, _ in seen if m]
        assert not missing, f"GPU series gone during the pause: {missing}"
        assert value(text, "gpupipe_metrics_expired_total") == expired_before
        delay = seen[-1][2]
        assert delay is not None and delay >= PAUSE_S - 1.5, seen[-3:]
        ages = [
            v for n, lab, v in parse_exposition(text) if n == "gpupipe_metrics_node_last_sample_age_seconds"
        ]
        assert len(ages) >= 2 and all(a >= PAUSE_S - 1.5 for a in ages), ages

        # -- the input resumes; then one GPU stops while the others go on: that one goes ----------
        quiet = sorted(gpus)[0]
        rest = gpus - {quiet}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            publish(rest)
            text = http_get(svc.url + "/metrics").decode()
            if quiet not in temps(text):
                break
            time.sleep(1.0)
        assert quiet not in temps(text), "a GPU that stopped while the others went on was not expired"
        assert rest <= temps(text)
        assert (value(text, "gpupipe_metrics_pipeline_delay_seconds") or 0) < 3
    finally:
        svc.stop()
