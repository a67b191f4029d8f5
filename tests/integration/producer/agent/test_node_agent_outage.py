"""The node agent while Kafka is unreachable: XIDs spooled then delivered, samples dropped oldest first.

The agent starts against a port where no broker listens (the broker "is down"); a second broker
(scripts/kafka-local with its own state dir) is then started on that port.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.agent.node_agent import AgentConfig
from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_producer.xid.spool_format import SPOOL_FILE
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import UUIDS, find_line, metric, node_for_fixtures, running_agent, wait_for
from tests.conftest import BROKER_START_TIMEOUT, REPO, _free_pair
from tests.integration.kafka_util import read_all

pytestmark = pytest.mark.integration


def test_xids_spooled_while_the_broker_is_down_then_delivered(tmp_path: Path) -> None:
    port = _free_pair()
    bootstrap = f"127.0.0.1:{port}"
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(tmp_path / "kafka"),
        "KAFKA_PORT": str(port),
        **BROKER_START_TIMEOUT,
    }
    script = str(REPO / "scripts" / "kafka-local")
    t_samples, t_xid = "outage." + topics.SAMPLES, "outage." + topics.XID
    fake = node_for_fixtures()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    # Short message timeout: deliveries fail fast, so the spool's retry path is what delivers.
    pub = Publisher(
        producer_config(
            bootstrap, {"message.timeout.ms": "1500", "reconnect.backoff.max.ms": "500"}, linger_ms=5
        )
    )
    cfg = AgentConfig(
        hostname="gpu-node-2",
        interval_s=0.1,
        kubelet_socket=None,
        kmsg_path=str(kmsg),
        spool_dir=str(tmp_path / "spool"),
        xid_merge_window_s=0.3,
        sample_queue_max=20,
        in_flight_limit=10,
        xid_retry_after_s=0.5,
        resolve_pids=False,
    )
    started = False
    try:
        with running_agent(cfg, pub, fake, t_samples=t_samples, t_xid=t_xid) as ra:
            reg = ra.registry
            fake.gpus[0].inject_xid(48)
            with kmsg.open("a") as f:
                f.write(find_line("xid_real.txt", "Xid (PCI:0000:91:00): 79") + "\n")
            wait_for(lambda: ra.agent.xids_sent >= 2, 10, "two XIDs")
            fake.gpus[5].lose()
            wait_for(lambda: ra.agent.xids_sent >= 3, 10, "gpu_lost")
            wait_for(
                lambda: (
                    metric(
                        reg,
                        "gpupipe_producer_records_failed_total",
                        {"topic": t_xid, "reason": "_MSG_TIMED_OUT"},
                    )
                    >= 3
                ),
                15,
                "failed XID deliveries",
            )
            assert metric(reg, "gpupipe_producer_xid_spool_depth") == 3
            wait_for(lambda: metric(reg, "gpupipe_producer_records_dropped_total") > 0, 10, "dropped samples")
            assert len(ra.agent.samples) <= 20

            # The broker comes back.
            out = subprocess.run(
                [script, "start", "--port", str(port)], env=env, capture_output=True, text=True, timeout=300
            )
            assert out.returncode == 0, out.stderr[-3000:]
            started = True
            ensure_topics(bootstrap, [topics.SAMPLES, topics.XID], prefix="outage.")
            wait_for(lambda: metric(reg, "gpupipe_producer_xid_spool_depth") == 0, 60, "spool drained")
            ra.ticks_after(3)
            ra.stop()
        assert (tmp_path / "spool" / SPOOL_FILE).stat().st_size == 0
        codec = AvroCodec()
        sent = [codec.decode(m.value()).record for m in read_all(bootstrap, t_xid, expect=3, timeout_s=30)]
        # At least once: a send whose acknowledgement was lost in the outage is sent again from the
        # spool with the same event_id (consumers de-duplicate on it); nothing may be missing.
        events = list({e["event_id"]: e for e in sent}.values())
        assert sorted((e["kind"], e["xid"], e["uuid"]) for e in events) == sorted(
            [("xid", 48, UUIDS[0]), ("xid", 79, UUIDS[2]), ("gpu_lost", None, UUIDS[5])]
        )
        (x79,) = [e for e in events if e["xid"] == 79]
        assert x79["source"] == "kmsg" and x79["message"] == "GPU has fallen off the bus."
        samples = read_all(bootstrap, t_samples, expect=None, timeout_s=20)
        assert samples, "samples flow once the broker is back"
    finally:
        if started:
            subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)
