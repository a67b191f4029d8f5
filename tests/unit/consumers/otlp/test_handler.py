"""The otlp service's request policy on a scripted transport: requests bounded in bytes and halved
when too large, a record too large alone dead-lettered, a timed-out request resent with a longer
timeout (not blindly), counters that count only what the collector accepted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client import CollectorRegistry

from gpupipe.kafka.ready import Backoff
from gpupipe_consumers.otlp import mapping
from gpupipe_consumers.otlp.export import ExportError, PartialSuccess, Signal
from gpupipe_consumers.otlp.handler import MAX_TIMEOUT_S, TIMEOUT_GROWTH, OtlpHandler
from gpupipe_consumers.plumbing.consume_loop import InRecord
from tests.otlp_records import alloc, points, sample


def hw_ids(payload: bytes) -> list[str]:
    """The GPUs a metrics request carries, in order of first appearance."""
    out: list[str] = []
    for _, _, pa, _ in points(ExportMetricsServiceRequest.FromString(payload)):
        gpu = pa["hw.id"].split("/")[0]  # a GPU's sensors are GPU-x/temperature/...
        if gpu not in out:
            out.append(gpu)
    return out


class Scripted:
    """A transport that answers each request with ``answer(payload)`` (raise, or a PartialSuccess)."""

    def __init__(self, answer: Callable[[bytes], PartialSuccess | None] = lambda _: None) -> None:
        self.answer = answer
        self.sent: list[tuple[list[str], int, float | None]] = []  # (GPUs, bytes, timeout)

    def export(self, signal: Signal, payload: bytes, timeout_s: float | None = None) -> PartialSuccess:
        self.sent.append((hw_ids(payload), len(payload), timeout_s))
        return self.answer(payload) or PartialSuccess()

    def close(self) -> None:
        pass


def rec(uuid: str, allocations: int = 1) -> InRecord:
    allocs = [
        alloc(f"ns{i}", f"pod-{i}", labels={"k" * 250 + f"/l{j}": "v" * 63 for j in range(8)})
        for i in range(allocations)
    ]
    value = sample(uuid=uuid, allocations=allocs) if allocations > 1 else sample(uuid=uuid)
    return InRecord("gpu.samples.v1", 0, 0, None, "GpuSample", value, 0)


def service(tx: Scripted, **kw: Any) -> tuple[OtlpHandler, CollectorRegistry]:
    registry = CollectorRegistry()
    kw.setdefault("backoff", lambda: Backoff(first_s=0.0, cap_s=0.0))
    return OtlpHandler(tx, registry, **kw), registry


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, {"signal": "metrics", **labels}) or 0.0


def size(*records: InRecord) -> int:
    return len(mapping.encode_metrics([r.value for r in records]).payload)


def test_records_are_packed_into_requests_within_the_byte_bound_in_order() -> None:
    records = [rec(f"GPU-{i}") for i in range(8)]
    tx = Scripted()
    svc, registry = service(tx, max_request_bytes=3 * size(records[0]))
    assert svc.handle(records) == []
    assert [ids for ids, *_ in tx.sent] == [
        ["GPU-0", "GPU-1", "GPU-2"],
        ["GPU-3", "GPU-4", "GPU-5"],
        ["GPU-6", "GPU-7"],
    ]
    assert all(n <= svc.max_request_bytes for _, n, _ in tx.sent)
    want = mapping.encode_metrics([r.value for r in records]).items
    assert value(registry, "gpupipe_otlp_items_total") == svc.exported["metrics"] == want


def test_a_request_holds_at_most_256_records() -> None:
    tx = Scripted()
    svc, _ = service(tx)
    svc.handle([rec(f"GPU-{i}") for i in range(300)])
    assert [len(ids) for ids, *_ in tx.sent] == [256, 44]


def test_what_the_collector_refuses_for_size_is_halved_and_a_record_too_large_alone_dead_lettered() -> None:
    big = rec("GPU-big", allocations=64)
    records = [rec("GPU-0"), rec("GPU-1"), big, rec("GPU-3")]
    limit = size(big) - 1  # the collector's, under our bound

    def collector(payload: bytes) -> None:
        if len(payload) > limit:
            raise ExportError("gRPC RESOURCE_EXHAUSTED: larger than max", retryable=False, too_large=True)

    tx = Scripted(collector)
    svc, registry = service(tx)
    rejected = svc.handle(records)
    assert [(r.value["uuid"], reason) for r, reason, _ in rejected] == [("GPU-big", "otlp-too-large")]
    assert "refused" in rejected[0][2]
    delivered = [ids for ids, n, _ in tx.sent if n <= limit]
    assert delivered == [["GPU-0", "GPU-1"], ["GPU-3"]]  # everything behind the big one went on
    assert (
        value(registry, "gpupipe_otlp_exports_total", outcome="too_large") == 3
    )  # all four, its half, it alone
    assert svc.failing is None


def test_a_record_over_the_bound_alone_is_dead_lettered_without_being_sent() -> None:
    big, small = rec("GPU-big", allocations=64), rec("GPU-1")
    tx = Scripted()
    svc, _ = service(tx, max_request_bytes=size(big) - 1)
    rejected = svc.handle([big, small])
    assert [(r.value["uuid"], reason) for r, reason, _ in rejected] == [("GPU-big", "otlp-too-large")]
    assert "bound" in rejected[0][2]
    assert [ids for ids, *_ in tx.sent] == [["GPU-1"]]


def test_a_timed_out_request_is_resent_with_a_longer_timeout_until_answers_are_quick() -> None:
    now = [0.0]
    answers = iter(["timeout", 15.0, 15.0, 1.0, 1.0])  # a delay, or a timeout

    def collector(payload: bytes) -> None:
        a = next(answers)
        if a == "timeout":
            raise ExportError("gRPC DEADLINE_EXCEEDED", retryable=True, maybe_delivered=True)
        now[0] += float(a)

    tx = Scripted(collector)
    svc, registry = service(tx, timeout_s=10.0, clock=lambda: now[0])
    for i in range(4):
        svc.handle([rec(f"GPU-{i}")])
    longer = 10.0 * TIMEOUT_GROWTH
    # the resend waits longer, and so do requests while the collector answers late; a quick
    # answer brings the configured timeout back
    assert [t for *_, t in tx.sent] == [10.0, longer, longer, longer, 10.0]
    assert value(registry, "gpupipe_otlp_exports_total", outcome="timeout") == 1
    assert (
        value(registry, "gpupipe_otlp_timed_out_items_total")
        == mapping.encode_metrics([rec("x").value]).items
    )
    assert value(registry, "gpupipe_otlp_exports_total", outcome="retry") == 0


def test_a_request_that_cannot_be_sent_in_time_gets_a_longer_timeout_and_no_duplicate_count() -> None:
    # A 3 MiB request over a slow link timed out uploading at every attempt: export halted.
    answers = iter(["slow", "slow", None])

    def collector(payload: bytes) -> None:
        if next(answers) == "slow":
            raise ExportError("HTTP: <urlopen error timed out>", retryable=True, slow=True)

    tx = Scripted(collector)
    svc, registry = service(tx, timeout_s=10.0)
    svc.handle([rec("GPU-0")])
    longer = 10.0 * TIMEOUT_GROWTH
    assert [t for *_, t in tx.sent] == [10.0, longer, longer * TIMEOUT_GROWTH]
    assert value(registry, "gpupipe_otlp_timed_out_items_total") == 0  # nothing was delivered
    assert value(registry, "gpupipe_otlp_exports_total", outcome="retry") == 2


def test_the_timeout_grows_to_a_cap() -> None:
    calls = [0]

    def collector(payload: bytes) -> None:
        calls[0] += 1
        if calls[0] <= 6:
            raise ExportError("HTTP: timed out", retryable=True, maybe_delivered=True)

    tx = Scripted(collector)
    svc, _ = service(tx, timeout_s=10.0)
    svc.handle([rec("GPU-0")])
    assert [t for *_, t in tx.sent] == [
        10.0,
        40.0,
        160.0,
        MAX_TIMEOUT_S,
        MAX_TIMEOUT_S,
        MAX_TIMEOUT_S,
        MAX_TIMEOUT_S,
    ]


def test_counters_count_what_the_collector_accepted() -> None:
    tx = Scripted(lambda _: PartialSuccess(rejected=5, message="dropped"))
    svc, registry = service(tx)
    svc.handle([rec("GPU-0")])
    items = mapping.encode_metrics([rec("GPU-0").value]).items
    assert value(registry, "gpupipe_otlp_items_total") == svc.exported["metrics"] == items - 5
    assert value(registry, "gpupipe_otlp_partial_rejected_total") == 5
