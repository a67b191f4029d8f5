"""The producer's stop with the broker gone: what is undelivered is purged, counted per topic, and
named in one line (real librdkafka client aimed at a port where nothing listens)."""

from __future__ import annotations

from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_producer.service import _dropped_line
from tests.conftest import free_port


def test_drop_pending_counts_per_topic_and_reaches_the_callbacks() -> None:
    seen: list[str] = []
    pub = Publisher(
        producer_config(f"127.0.0.1:{free_port()}", {"reconnect.backoff.max.ms": "100"}, linger_ms=5),
        on_delivery=lambda err, msg: seen.append(err.name()),
    )
    tracked: list[str] = []
    for i in range(3):
        pub.produce("s", f"k{i}".encode(), b"sample")
    pub.produce_tracked("x", b"gpu", b"xid", lambda err, msg: tracked.append(err.name()))
    assert pub.flush(0.3) == 4  # nothing can be delivered
    dropped = pub.drop_pending()
    assert dropped == {"s": 3, "x": 1}
    assert len(seen) == 3 and all(n.startswith("_PURGE") for n in seen)
    assert tracked and tracked[0].startswith("_PURGE")  # a spooled XID learns it was not sent
    assert pub.failed == 3  # tracked records stay the spool's business
    assert len(pub) == 0


def test_dropped_line_names_samples_and_xids() -> None:
    line = _dropped_line(
        {"p.gpu.samples.v1": 120, "p.gpu.xid.v1": 2}, "p.gpu.samples.v1", "p.gpu.xid.v1", False
    )
    assert line == "stopped with records undelivered: 120 samples dropped, 2 XIDs dropped"
    line = _dropped_line({"p.gpu.xid.v1": 2}, "p.gpu.samples.v1", "p.gpu.xid.v1", spooled=True)
    assert line.endswith("0 samples dropped, 2 XIDs kept in the spool for the next start")
