"""Bounded state in the metrics consumer: the GPU-key cap and the XID reader's contract check (pure).

Any GPU node may write an XidEvent or a GpuSample for a UUID that does not exist. Before, each one
became a "GPU" with some 10 KB of label text, kept for an hour: 60k forged UUIDs took a consumer
from 53 MB to 1 GB with nothing in its log. And the XID reader, which decodes on its own, skipped
the contract check the shared consume loop applies, so an XID dated 2100, codes -1 and 2**31-1 and
a 200 KB hostname were all taken.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpupipe_consumers.metrics.service import MetricsHandler, XidReader
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.metrics.test_store import T_MS, blank, lines_of, xid


def test_gpu_keys_are_capped_and_drops_counted_and_logged(caplog: Any) -> None:
    store = SeriesStore(max_gpus=100, drop_log_interval_s=60.0)
    store.apply_sample(blank("GPU-real"), 0, 100.0)
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        for i in range(1000):  # a flood of XIDs for made-up GPUs, over 10 s
            store.apply_xid(xid(13, uuid=f"GPU-forged-{i}"), 0, 100.0 + i / 100)
        # a new real GPU's sample still gets in: it displaces the oldest made-up XID-only GPU (a cap
        # must not turn a flood into blindness for an hour)
        store.apply_sample(blank("GPU-new"), 0, 110.0)
    assert store.gpu_count() == 100
    keys = set(store.keys())
    assert "GPU-real" in keys and "GPU-new" in keys and "GPU-forged-0" not in keys
    text = store.render(110.0).decode()
    assert lines_of(text, "gpupipe_metrics_gpus_dropped_total") == [
        'gpupipe_metrics_gpus_dropped_total{kind="sample"} 0',
        'gpupipe_metrics_gpus_dropped_total{kind="xid"} 901',
    ]
    warnings = [r for r in caplog.records if "--max-gpus" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # at most once a minute
    # a known GPU still takes its XIDs and samples at the cap
    assert store.apply_xid(xid(79, uuid="GPU-real", ts=T_MS + 1), 0, 111.0)
    store.apply_sample(blank("GPU-real", timestamp_ms=T_MS + 1000, gpu_temp_c=61.0), 0, 111.0)
    text = store.render(111.0).decode()
    assert any(ln.endswith(" 61") for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP") if "GPU-real" in ln)
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        store.apply_xid(xid(13, uuid="GPU-forged-late"), 0, 170.0)  # a minute later: warned again
    assert len([r for r in caplog.records if "--max-gpus" in r.getMessage()]) == 2


def test_expired_gpus_free_their_bus_entries() -> None:
    """The (node, bus id) map that attributes UUID-less XIDs shrinks with the store, not only grows."""
    store = SeriesStore()
    for i in range(50):
        store.apply_sample(blank(f"GPU-{i}", pci_bus_id=f"00000000:{i:02X}:00.0"), 0, 100.0)
    store.apply_sample(blank("GPU-beat", hostname="node-9", interval_ms=3_600_000), 0, 200.0)
    assert store.expire(200.0) == 50
    assert list(store._by_bus.values()) == ["GPU-beat"]


class _Msg:
    def __init__(self, value: bytes, key: bytes, ts_ms: int, topic: str = "gpu.xid.v1") -> None:
        self._value, self._key, self._ts, self._topic = value, key, ts_ms, topic

    def error(self) -> None:
        return None

    def value(self) -> bytes:
        return self._value

    def headers(self) -> None:
        return None

    def key(self) -> bytes:
        return self._key

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 1

    def timestamp(self) -> tuple[int, int]:
        return (1, self._ts)


class _Counter:
    def labels(self, *_: Any) -> _Counter:
        return self

    def inc(self, _n: int = 1) -> None:
        pass


class _Loop:
    def __init__(self) -> None:
        self.dead: list[tuple[bytes, str, str]] = []
        self.metrics = type("M", (), {"consumed": _Counter()})()

    def dead_letter(self, msg: _Msg, reason: str, detail: str) -> None:
        self.dead.append((msg.key(), reason, detail))


def _reader() -> tuple[XidReader, MetricsHandler, _Loop]:
    store = SeriesStore()
    handler = MetricsHandler(store, samples_topic="gpu.samples.v1", xid_topic="gpu.xid.v1")
    handler.samples_partitions = 1
    handler.on_assign([("gpu.samples.v1", 0)])  # this instance owns every key
    loop = _Loop()
    reader = XidReader(
        bootstrap="unused:9092",
        topic="gpu.xid.v1",
        samples_topic="gpu.samples.v1",
        handler=handler,
        codec=AvroCodec(),
        loop=loop,  # type: ignore[arg-type]
        consumer_factory=lambda _cfg: object(),
    )
    return reader, handler, loop


def test_xid_reader_dead_letters_out_of_range_events() -> None:
    reader, handler, loop = _reader()
    enc = AvroCodec().encoder("XidEvent")
    now_ms = int(time.time() * 1000)
    events = {
        b"GPU-ok": {"xid": 13},
        b"GPU-neg": {"xid": -1},
        b"GPU-huge": {"xid": 2**31 - 1},
        b"GPU-2100": {"xid": 79, "timestamp_ms": 4_102_444_800_000},  # 2100-01-01
        b"GPU-longhost": {"xid": 13, "hostname": "h" * 200_000},
    }
    msgs = []
    for key, over in events.items():
        ev = xid(13, uuid=key.decode(), ts=now_ms)
        ev.update(over)
        msgs.append(_Msg(enc.encode(ev), key, now_ms))
    reader.process(msgs)
    assert sorted((k, r) for k, r, _ in loop.dead) == sorted(
        (k, "out-of-range") for k in events if k != b"GPU-ok"
    ), loop.dead
    assert handler.store.keys() == ["GPU-ok"]
    assert handler.xid_results["rejected"] == 4 and handler.xid_results["applied"] == 1
    text = handler.store.render().decode()
    assert 'xid="-1"' not in text and 'xid="2147483647"' not in text


def test_xid_reader_leaves_another_owners_bad_event_to_it() -> None:
    reader, handler, loop = _reader()
    handler.on_revoke([("gpu.samples.v1", 0)])  # the key's samples partition is another instance's
    ev = xid(13, uuid="GPU-neg", ts=int(time.time() * 1000))
    ev["xid"] = -1
    reader.process([_Msg(AvroCodec().encoder("XidEvent").encode(ev), b"GPU-neg", int(time.time() * 1000))])
    assert loop.dead == [] and handler.xid_results["other_owner"] == 1


def test_xid_reader_waits_for_the_samples_groups_first_assignment() -> None:
    """Before it, every XID looked like another instance's and was skipped for good."""
    store = SeriesStore()
    handler = MetricsHandler(store, samples_topic="gpu.samples.v1", xid_topic="gpu.xid.v1")
    reader = XidReader(
        bootstrap="unused:9092",
        topic="gpu.xid.v1",
        samples_topic="gpu.samples.v1",
        handler=handler,
        codec=AvroCodec(),
        loop=_Loop(),  # type: ignore[arg-type]
        consumer_factory=lambda _cfg: object(),
    )
    reader._parts = {0}
    assert not reader.ready()
    handler.on_assign([])  # assigned, none of it: another instance owns every key
    assert reader.ready()
