"""Node identity (`--node-ca-file`, enforce) in every service that acts on a sample's hostname.

Every node's producer holds one Kafka principal, so without the check node-a's
credentials wrote samples naming node-b that metrics served, chargeback billed and recommend
recommended on. On a real broker, each service here is given, among node-a's own signed samples,
samples naming node-b signed with node-a's certificate (`wrong-node`) and unsigned ones
(`unsigned`); metrics also an XID naming node-b. Each refused record is dead-lettered once, reason
`node-identity` with the sub-reason, and nothing of node-b is served, billed or recommended, while
node-a's records are.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from gpupipe.domain.node_check import NodeIdentity
from gpupipe.domain.node_identity import NodeSigner
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.conftest import free_port
from tests.integration.chargeback_util import (
    Progress,
    kill_left,
    past_hour_ms,
    read_output,
    read_to_end,
    start_service,
    stop_service,
)
from tests.integration.consumers.alerts.test_service import xid_event
from tests.integration.kafka_util import GPUPIPE, REPO
from tests.integration.metrics_helpers import http_get, wait_for
from tests.pki import Pki
from tests.synthetic_fleet import blank_sample

pytestmark = pytest.mark.integration

NODE_A, NODE_B = "node-a", "node-b"
STEP_MS = 10_000
#: The refused records, by key: what each is dead-lettered with.
REFUSED = {
    b"GPU-forged": f"wrong-node: hostname {NODE_B!r}".encode(),
    b"GPU-unsigned": f"unsigned: hostname {NODE_B!r}".encode(),
}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def _sample(gpu: str, host: str, ts: int) -> dict[str, Any]:
    """An idle GPU that a pod of namespace ``ns-<gpu>`` holds (so recommend would name it)."""
    ns = gpu.lower().replace("gpu-", "ns-")
    return blank_sample(
        timestamp_ms=ts,
        hostname=host,
        gpu_index=0,
        uuid=gpu,
        pci_bus_id="00000000:10:00.0",
        model_name="NVIDIA H100 80GB HBM3",
        allocations=[
            {"namespace": ns, "pod": f"{ns}-pod", "container": "main", "resource_name": "nvidia.com/gpu"}
        ],
        interval_ms=STEP_MS,
        gpu_lost=False,
        gpu_util_ratio=0.0,
        sm_active_ratio=0.0,
        power_w=60.0,
        fb_used_bytes=1 << 20,
    )


def write_input(kafka: str, prefix: str, pki: Pki, t0: int, steps: int, *, xid: bool = False) -> None:
    """node-a's GPU every step, signed by node-a; three samples each of the forged and unsigned
    GPUs naming node-b among them; the last good sample ``steps`` later (closes a window)."""
    ensure_topics(kafka, [topics.SAMPLES, topics.XID, topics.DEADLETTER], prefix=prefix)
    signer = NodeSigner(str(pki.node("a", f"system:node:{NODE_A}")), None, NODE_A)
    enc = AvroCodec().encoder("GpuSample").encode
    # murmur2, as the node agent: the metrics XID reader finds a GPU's owner by its key
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True, "partitioner": "murmur2_random"})
    t_in = prefix + topics.SAMPLES

    def send(gpu: str, host: str, ts: int, signed: bool, topic: str = t_in, value: bytes = b"") -> None:
        value = value or enc(_sample(gpu, host, ts))
        p.produce(topic, value, gpu.encode(), headers=signer.headers(value) if signed else None)

    for k in range(steps):
        send("GPU-good", NODE_A, t0 + k * STEP_MS, True)
        if k < 3:
            send("GPU-forged", NODE_B, t0 + k * STEP_MS, True)
            send("GPU-unsigned", NODE_B, t0 + k * STEP_MS, False)
    if xid:
        event = xid_event(NODE_B, "00000000:10:00.0", 79, t0, uuid="GPU-forged", gpu_index=0)
        x = AvroCodec().encoder("XidEvent").encode(event)
        send("GPU-forged", NODE_B, t0, True, topic=prefix + topics.XID, value=x)
    send("GPU-good", NODE_A, t0 + 2 * steps * STEP_MS, True)
    assert p.flush(30) == 0


Letter = tuple[bytes, bytes, bytes, bytes]  # key, source topic, reason, detail


def dead_letters(kafka: str, prefix: str, service: str) -> Counter[Letter]:
    """How many of ``service``'s dead letters there are of each key, topic, reason and detail."""
    out: Counter[Letter] = Counter()
    for m in read_to_end(kafka, prefix + topics.DEADLETTER):
        h = dict(m.headers())
        if h["gpupipe.dlq.service"] == service.encode():
            out[(m.key(), h["gpupipe.dlq.topic"], h["gpupipe.dlq.reason"], h["gpupipe.dlq.detail"])] += 1
    return out


def expected(prefix: str, *, xid: bool = False) -> Counter[Letter]:
    """Each refused sample once (three of each GPU), and the forged XID once."""
    samples = (prefix + topics.SAMPLES).encode()
    out = Counter({(k, samples, b"node-identity", detail): 3 for k, detail in REFUSED.items()})
    if xid:
        out[(b"GPU-forged", (prefix + topics.XID).encode(), b"node-identity", REFUSED[b"GPU-forged"])] = 1
    return out


def _scrape_with(url: str, text: str) -> str:
    body = http_get(url).decode()
    return body if text in body else ""


def test_metrics_serves_only_what_the_named_node_signed(kafka: str, topic_prefix: str, pki: Pki) -> None:
    now = int(time.time() * 1000)
    svc = MetricsService(
        MetricsConfig(
            bootstrap=kafka,
            topic_prefix=topic_prefix,
            group_id=f"metrics-{uuid.uuid4().hex[:8]}",
            host="127.0.0.1",
            port=0,
            from_beginning=True,
            node_identity=NodeIdentity(str(pki.ca), "enforce", "kubelet"),
        )
    )
    ensure_topics(kafka, [topics.SAMPLES, topics.XID, topics.DEADLETTER], prefix=topic_prefix)
    svc.start()
    try:
        wait_for(lambda: svc.health()[0] and svc.handler.assigned, 60, "the service to be assigned")
        wait_for(lambda: svc.handler.samples_partitions, 30, "the XID reader to know the samples topic")
        write_input(kafka, topic_prefix, pki, now - 60_000, 3, xid=True)
        want = expected(topic_prefix, xid=True)
        wait_for(lambda: dead_letters(kafka, topic_prefix, "metrics") == want, 60, "the refused records")
        body = wait_for(
            lambda: _scrape_with(svc.url + "/metrics", 'UUID="GPU-good"'), 30, "node-a's GPU on /metrics"
        )
    finally:
        svc.stop()
    assert 'Hostname="node-a"' in body
    assert "GPU-forged" not in body and "GPU-unsigned" not in body and NODE_B not in body
    ident = [ln for ln in body.splitlines() if ln.startswith("gpupipe_metrics_node_identity_total")]
    assert (
        'gpupipe_metrics_node_identity_total{mode="enforce",record="GpuSample",result="verified"} 4.0'
        in ident
    )
    assert any('record="XidEvent",result="wrong-node"' in ln and ln.endswith(" 1.0") for ln in ident)


def test_chargeback_bills_only_what_the_named_node_signed(
    kafka: str, topic_prefix: str, pki: Pki, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.CHARGEBACK, topics.DEADLETTER], prefix=topic_prefix)
    write_input(kafka, topic_prefix, pki, past_hour_ms(3), 60)  # ten minutes: one 10m window
    group, log = f"cb-ident-{uuid.uuid4().hex[:8]}", tmp_path / "chargeback.log"
    prog = Progress(kafka, group, topic_prefix + topics.SAMPLES)
    procs = {}
    try:
        procs["cb"] = start_service(
            kafka, topic_prefix, log, "--window", "10m", "--grace", "1m", "--commit-interval", "200ms",
            "--group-id", group, "--instance-id", "ident", "--node-ca-file", str(pki.ca),
        )  # fmt: skip
        prog.wait_done(90, list(procs.values()))
        assert stop_service(procs["cb"]) == 0, log.read_text()[-3000:]
    finally:
        prog.close()
        kill_left(procs)
    assert dead_letters(kafka, topic_prefix, "chargeback") == expected(topic_prefix)
    out = read_output(kafka, topic_prefix + topics.CHARGEBACK)
    assert {(r["namespace"], r["node"]) for r in out} == {("ns-good", NODE_A)}
    assert sum(r["allocated_gpu_seconds"] for r in out) == pytest.approx(600)


def test_recommend_names_only_what_the_named_node_signed(
    kafka: str, topic_prefix: str, pki: Pki, tmp_path: Path
) -> None:
    write_input(kafka, topic_prefix, pki, past_hour_ms(2), 30)  # five idle minutes
    port = free_port()
    log = open(tmp_path / "recommend.log", "w")  # noqa: SIM115 (closed below)
    proc = hygiene.popen(
        [*GPUPIPE, "recommend", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix,
         "--from-beginning", "--listen", f"127.0.0.1:{port}", "--idle-after", "2m",
         "--restore-lookback", "0", "--node-ca-file", str(pki.ca)],
        stdout=log, stderr=log, cwd=REPO,
    )  # fmt: skip
    t_out = topic_prefix + topics.RECOMMENDATIONS
    dec = AvroCodec().decode

    def recommended() -> set[tuple[str, str]]:
        return {
            (r["namespace"], r["hostname"])
            for r in (dec(m.value()).record for m in read_to_end(kafka, t_out))
        }

    try:
        want = expected(topic_prefix)
        wait_for(lambda: dead_letters(kafka, topic_prefix, "recommend") == want, 60, "the refused samples")
        wait_for(lambda: ("ns-good", NODE_A) in recommended(), 60, "node-a's idle GPU recommended")
        body = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(30)
        log.close()
    assert recommended() == {("ns-good", NODE_A)}, (tmp_path / "recommend.log").read_text()[-3000:]
    assert (
        'gpupipe_recommend_node_identity_total{mode="enforce",record="GpuSample",result="unsigned"} 3.0'
        in body
    )
