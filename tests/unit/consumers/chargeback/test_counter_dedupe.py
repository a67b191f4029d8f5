"""The dashboard counters count a re-emitted window once, as the report does (by record id)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gpupipe_consumers.chargeback.emitted import EmittedIdsReader, emitted_ids
from gpupipe_consumers.chargeback.prom_counters import WindowCounters
from gpupipe_schemas.codec import AvroCodec


def rec(rid: str, part: int, seconds: float = 600.0) -> dict[str, Any]:
    return {
        "record_id": rid,
        "source_partition": part,
        "namespace": "team-a",
        "team": None,
        "gpu_model": "H100",
        "allocated_gpu_seconds": seconds,
        "used_gpu_seconds": 0.0,
        "idle_gpu_seconds": 0.0,
        "energy_joules": 0.0,
        "cost_total": 1.0,
        "currency": "USD",
    }


def allocated(reg: CollectorRegistry) -> float:
    return sum(
        s.value
        for m in reg.collect()
        if m.name == "gpupipe_chargeback_allocated_gpu_seconds"
        for s in m.samples
        if s.name.endswith("_total")
    )


def test_held_records_are_counted_once_the_emitted_ids_are_known() -> None:
    reg = CollectorRegistry()
    c = WindowCounters(reg, "USD")
    c.hold(0)
    c.add([rec("w1", 0), rec("w2", 0), rec("x1", 1)])
    assert allocated(reg) == 600.0  # partition 1 counts at once; 0 waits
    assert c.held() == {0: 2}
    assert c.release(0, {"w1"}) == 1  # w1 was counted by an earlier process
    assert allocated(reg) == 1200.0
    c.add([rec("w3", 0)])  # released: counted at once
    assert allocated(reg) == 1800.0
    assert reg.get_sample_value("gpupipe_chargeback_counter_duplicates_total") == 1.0


def test_an_unknown_read_counts_everything() -> None:
    reg = CollectorRegistry()
    c = WindowCounters(reg, "USD")
    c.hold(3)
    c.add([rec("a", 3)])
    c.release(3, None)
    assert allocated(reg) == 600.0


def test_too_many_held_records_are_counted_unchecked() -> None:
    reg = CollectorRegistry()
    c = WindowCounters(reg, "USD", max_held=2)
    c.hold(0)
    c.add([rec(f"r{i}", 0) for i in range(3)])
    assert c.held() == {} and allocated(reg) == 1800.0


class _Msg:
    def __init__(self, value: bytes) -> None:
        self._v = value

    def value(self) -> bytes:
        return self._v

    def headers(self) -> None:
        return None


class _Decoded:
    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record


class _Codec(AvroCodec):
    """Records by their bytes (the real decoder is the contract's, tested with it)."""

    def decode(self, value: bytes | None, headers: Any = None) -> Any:  # type: ignore[override]
        from gpupipe_schemas.errors import DecodeError

        if value == b"not avro":
            raise DecodeError("bad", "not avro")
        rid, part = value.decode().split("@")  # type: ignore[union-attr]
        return _Decoded({"record_id": rid, "source_partition": int(part)})


def test_emitted_ids_come_from_the_output_topic_per_partition() -> None:
    codec = _Codec()
    msgs = [_Msg(b"p0-a@0"), _Msg(b"p1-a@1"), _Msg(b"not avro")]
    assert emitted_ids(msgs, codec, {0}) == {0: {"p0-a"}}
    released: list[tuple[int, Any]] = []
    reader = EmittedIdsReader(
        bootstrap="unused",
        topic="out",
        group_id="g",
        codec=codec,
        extra=None,
        release=lambda p, ids: released.append((p, ids)),
        read=lambda *a, **k: iter(msgs),
    )
    reader.start({0, 1}, 0).join(10)
    assert released == [(0, {"p0-a"}), (1, {"p1-a"})]
    failing = EmittedIdsReader(
        bootstrap="unused",
        topic="out",
        group_id="g",
        codec=codec,
        extra=None,
        release=lambda p, ids: released.append((p, ids)),
        read=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broker away")),
    )
    failing.start({5}, 0).join(10)
    assert released[-1] == (5, None)
