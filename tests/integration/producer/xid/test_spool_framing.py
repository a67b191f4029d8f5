"""XIDs spooled under one ``--framing`` of the XID topic and sent after a restart under another
arrive in the new framing, decodable and signed by their node.

The spool used to keep each XID as the topic's framing wrote it then, while the schema header of
the raw framing is added per topic at send time: a single-object XID went out with a raw header
(dead-lettered, its body misread), a raw one without it (not gpupipe Avro).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gpupipe.domain.node_identity import NodeSigner, NodeVerifier
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.agent.node_agent import NodeAgent
from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.xid.kmsg_parse import parse_line
from gpupipe_schemas.codec import RAW, SINGLE_OBJECT, AvroCodec
from tests.agent_harness import node_for_fixtures
from tests.integration.kafka_util import read_all
from tests.pki import Pki
from tests.unit.producer.agent.test_node_agent import config

pytestmark = pytest.mark.integration

NODE = "node-1"  # the agent config's hostname, and the node the certificate names
XID13 = "[ 10.0] NVRM: Xid (PCI:0000:9b:00): 13, pid=7, name=python, Graphics SM Warp Exception"


def _agent(
    tmp_path: Path, kafka: str, prefix: str, framing: str, signer: NodeSigner, ready: bool
) -> NodeAgent:
    """A node agent whose XID topic is written in ``framing``, wired as ``gpupipe produce`` wires it.

    Its samples go to a topic that exists: a sample it cannot deliver holds its shutdown for the
    whole flush budget."""
    t_xid = prefix + topics.XID
    codec = AvroCodec(framings={t_xid: framing})
    publisher = Publisher(producer_config(kafka, linger_ms=5))
    if framing == RAW:
        publisher.topic_headers[t_xid] = codec.encoder("XidEvent", t_xid).headers or []
    kafka_ready = threading.Event()
    if ready:
        kafka_ready.set()
    cfg = config(tmp_path, nvml_events=False, xid_merge_window_s=0.0, signer=signer)
    return NodeAgent(
        cfg, publisher, ProducerMetrics(), codec, prefix + topics.SAMPLES, t_xid,
        nvml=node_for_fixtures(), kafka_ready=kafka_ready,
    )  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(SINGLE_OBJECT, RAW), (RAW, SINGLE_OBJECT)])
def test_spooled_xids_take_the_framing_of_the_restarted_agent(
    kafka: str, topic_prefix: str, tmp_path: Path, before: str, after: str
) -> None:
    t_xid = topic_prefix + topics.XID
    ensure_topics(kafka, [topics.XID, topics.SAMPLES], prefix=topic_prefix)
    pki = Pki(tmp_path)
    signer = NodeSigner(str(pki.node("n1", f"system:node:{NODE}")), None, NODE)
    event = parse_line(XID13)
    assert event is not None

    # The topics are not ready yet: the XID is spooled, never handed to librdkafka.
    first = _agent(tmp_path, kafka, topic_prefix, before, signer, ready=False)
    first._start()
    try:
        first.inbox.put(("kmsg", time.monotonic(), 1_767_225_600_000, event, None))
        first.xids.drain(0.0)
        first.xids.flush_held()  # no NVML event to pair it with: sent at once
        assert first.sender.depth == 1
    finally:
        first._shutdown()
    assert first.sender.depth == 1  # kept for the next start

    # Restarted with the other framing: the spool is replayed, and the shutdown flushes it.
    second = _agent(tmp_path, kafka, topic_prefix, after, signer, ready=True)
    second._start()
    second._shutdown()
    assert second.sender.depth == 0

    (msg,) = read_all(kafka, t_xid, expect=1)
    decoded = AvroCodec().decode(msg.value(), msg.headers())
    assert (decoded.framing, decoded.record["xid"], decoded.record["hostname"]) == (after, 13, NODE)
    verifier = NodeVerifier.from_file(str(pki.ca))
    assert verifier.check(NODE, msg.value(), msg.headers()) is None
