"""The alerts service's sample decoder against the shared codec: the same records to the contract
check, the same alerts, the same dead-letter reasons (gpupipe_consumers.alerts.sample_decode)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpupipe.kafka import topics
from gpupipe_consumers.alerts.admission import device_of
from gpupipe_consumers.alerts.engine.health_signals import HealthTracker
from gpupipe_consumers.alerts.engine.recovery_policy import sample_healthy
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.alerts.sample_decode import SAMPLE_FIELDS, AlertsDecoder
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.validate import violation
from tests.integration.test_poison_suite import _catalogue, _non_utf8

NOW = 1_790_000_000_000
CODEC = AvroCodec()
ENCODE = CODEC.encoder("GpuSample").encode


def _samples() -> list[dict[str, Any]]:
    """Ten seconds of 16 simulated GPUs, with every fault the health signals read on some of them."""
    fleet = SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=8, seed=3))
    out: list[dict[str, Any]] = []
    for s in range(10):
        samples, _ = fleet.tick(NOW - 60_000 + s * 1000)
        for i, r in enumerate(samples):
            if s >= 3 and i == 0:
                r["ecc_dbe_volatile_total"] = s  # grows: an ECC DBE occurrence each sample
            if s >= 4 and i == 1:
                r["row_remap_pending"] = True
            if s == 5 and i == 2:
                r["gpu_lost"] = True  # and back: reset evidence
            if 5 <= s <= 6 and i == 3:
                r["gpu_recovery_action"] = 2
            if s >= 2 and i == 4:
                r["clock_event_reasons"] = 0x40  # thermal slowdown, sustained
            if s == 7 and i == 5:
                r["total_energy_mj"] = 0  # the energy counter restarted
        out.extend(samples)
    return out


def _outcome(decode: Any, payload: bytes | None) -> tuple[Any, ...]:
    """What the consume loop does with ``payload``: dead-letter it (reason, detail) or pass the record."""
    try:
        d = decode(payload)
    except DecodeError as exc:
        return ("dead-letter", exc.reason, exc.detail)
    bad = violation(d.name, d.record, NOW, NOW)
    return ("dead-letter", "out-of-range", bad) if bad else ("record", d.name, d.record)


def _alerts(decode: Any, payloads: list[bytes]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Published alert records and rejections of a service fed ``payloads`` (contract check skipped:
    what the service itself makes of every decodable sample, hostile ones included)."""
    sink = ListSink()
    svc = AlertsHandler(sink=sink, clock=lambda: NOW / 1000)
    recs = []
    for i, p in enumerate(payloads):
        d = decode(p)
        recs.append(InRecord(topics.SAMPLES, 0, i, None, d.name, d.record, NOW, None))
    rejected = svc.handle(recs)
    svc.flush()
    return sink.records, [(reason, detail) for _, reason, detail in rejected]


@pytest.fixture(scope="module")
def hostile() -> list[tuple[bytes, bytes | None]]:
    """The poison suite's catalogue for the sample topic (key, value)."""
    good = _samples()[0]
    more = [  # faults in fields alerts itself does not read: the contract's and the codec's still count
        (b"non-utf8-serial", _non_utf8(ENCODE, {**good, "serial": "QQQQQQQQ"})),
        (b"power-over-limit", ENCODE({**good, "power_w": 900.0, "power_limit_w": 100.0})),
        (b"energy-negative", ENCODE({**good, "module_energy_mj": -1})),
    ]
    return [(k, v) for k, v, _ in _catalogue(CODEC, good, NOW)[topics.SAMPLES]] + more


def test_the_fast_path_gives_the_codec_fields_and_the_same_alerts() -> None:
    payloads = [ENCODE(s) for s in _samples()]
    fast = AlertsDecoder(CODEC)
    for p in payloads:
        whole, ours = CODEC.decode(p).record, fast.decode(p).record
        assert set(ours) == SAMPLE_FIELDS
        assert ours == {k: whole[k] for k in SAMPLE_FIELDS}
    published, rejected = _alerts(fast.decode, payloads)
    assert (published, rejected) == _alerts(CODEC.decode, payloads)
    signals = {r["signal"] for r in published}
    assert {"ecc_dbe", "row_remap_pending", "recovery_action"} <= signals  # the faults alerted


def test_every_hostile_sample_gets_the_same_verdict_and_reason(
    hostile: list[tuple[bytes, bytes | None]],
) -> None:
    fast = AlertsDecoder(CODEC)
    more = hostile[-3:]
    for key, value in hostile:
        ours, theirs = _outcome(fast.decode, value), _outcome(CODEC.decode, value)
        assert ours == theirs, key  # a record that passes is another type's (an XID on samples)
    refused = {k for k, v in hostile if _outcome(fast.decode, v)[0] == "dead-letter"}
    assert {
        b"power-nan",
        b"long-ns",
        b"non-utf8-ns",
        b"trailing",
        b"truncated",
        *(k for k, _ in more),
    } <= refused


def test_decodable_hostile_samples_make_the_same_alerts(hostile: list[tuple[bytes, bytes | None]]) -> None:
    fast = AlertsDecoder(CODEC)
    decodable = []
    for _, value in hostile:
        try:
            if CODEC.decode(value).name == "GpuSample":
                decodable.append(value)
        except DecodeError:
            continue
    assert len(decodable) >= 10
    assert _alerts(fast.decode, decodable) == _alerts(CODEC.decode, decodable)


class _Reads(dict):
    """A sample that records which fields are read."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)


def test_the_projection_holds_every_field_alerts_reads() -> None:
    tracker = HealthTracker()
    for s in _samples()[:40]:
        r = _Reads(copy.deepcopy(s))
        ident, _ = tracker.observe(r)
        sample_healthy(r)
        device_of(r)
        r.get("hostname")  # the node check's
        assert ident is not None
        tracker.health(ident.hostname, ident.device)
        for st in tracker._gpus.values():  # health() reads the stored samples
            if isinstance(st.sample, _Reads):
                r.read |= st.sample.read
        assert r.read <= SAMPLE_FIELDS, r.read - SAMPLE_FIELDS
        checked = _Reads(copy.deepcopy(s))
        violation("GpuSample", checked, NOW, NOW)  # the contract check's fields: the same verdict
        assert checked.read <= SAMPLE_FIELDS, checked.read - SAMPLE_FIELDS
