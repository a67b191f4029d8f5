"""Consume-loop handler of the otlp service: exports each batch and returns only once it is taken.

The consume loop stores a batch's offsets after :meth:`OtlpHandler.handle` returns, so ``handle``
returns only when the collector acknowledged every request built from the batch: a collector outage
holds the batch (one batch: memory stays bounded) and retries it with capped exponential backoff,
and nothing is committed meanwhile. A stop while the batch is unsent raises :class:`ExportAbandoned`,
which leaves its offsets unstored: a restart exports it again. A request the collector refuses as bad
data is dead-lettered (reason ``otlp-rejected``), not retried forever.

Size: a request holds at most 256 records and ``max_request_bytes`` encoded, records being encoded one
by one and packed. A record over the bound alone is dead-lettered (reason ``otlp-too-large``) and the
records behind it go on; a request the collector refuses for its size is sent as two halves, down to
a record alone, dead-lettered the same way.

Timeouts: OTLP has no idempotency key, so a request that timed out after it was sent may be at the
collector already. Its resend gets a timeout four times longer (up to ``MAX_TIMEOUT_S``), kept until
an export is answered within the configured timeout again: a slow collector gets one extra copy per
slow spell (one per fourfold step beyond), not one per attempt.

Counters count what the collector accepted: a 2xx, less the items a partial success rejected.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpupipe.common.logs import fields
from gpupipe.kafka.ready import Backoff
from gpupipe_consumers.otlp import mapping
from gpupipe_consumers.otlp.export import ExportError, Signal, Transport
from gpupipe_consumers.otlp.settings import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TIMEOUT_S
from gpupipe_consumers.plumbing.consume_loop import InRecord, Rejected

log = logging.getLogger("gpupipe.otlp")

#: Records per export request (at most: ``max_request_bytes`` may make it fewer). 256 ordinary
#: samples make about 4,000 data points, well under the byte bound.
RECORDS_PER_REQUEST = 256
#: After a timeout the next attempt waits this many times longer, up to MAX_TIMEOUT_S (or the
#: configured timeout when that is longer): 10 s, 40 s, 160 s, 300 s.
TIMEOUT_GROWTH = 4.0
MAX_TIMEOUT_S = 300.0

TOO_LARGE = "otlp-too-large"
REJECTED = "otlp-rejected"


class ExportAbandoned(Exception):
    """Stopped while a batch was not yet acknowledged: its offsets must not be stored."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the collector will not take a request as it is: dead-letter reason and its detail."""

    reason: str  # REJECTED or TOO_LARGE
    detail: str


class OtlpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.exports = Counter(
            "gpupipe_otlp_exports",
            "OTLP export requests by signal and outcome (ok; retry; timeout: sent, unanswered in time, "
            "resent; too_large: refused for its size, split; rejected: dead-lettered).",
            ["signal", "outcome"],
            registry=registry,
        )
        self.items = Counter(
            "gpupipe_otlp_items",
            "Data points (metrics) and log records (logs) the collector accepted (2xx, less what a "
            "partial success rejected).",
            ["signal"],
            registry=registry,
        )
        self.timed_out_items = Counter(
            "gpupipe_otlp_timed_out_items",
            "Items of requests that timed out after they were sent: the collector may have taken them, "
            "so their resend may duplicate them.",
            ["signal"],
            registry=registry,
        )
        self.partial_rejected = Counter(
            "gpupipe_otlp_partial_rejected",
            "Items the collector refused inside an accepted request (partial success; not retried).",
            ["signal"],
            registry=registry,
        )
        self.failing = Gauge(
            "gpupipe_otlp_export_failing",
            "1 while exports fail and a batch is held (its input offsets are not committed).",
            registry=registry,
        )


class OtlpHandler:
    """Handler: GpuSample -> metrics requests, XidEvent -> logs requests, each acknowledged before return."""

    def __init__(
        self,
        transport: Transport,
        registry: CollectorRegistry,
        *,
        backoff: Callable[[], Backoff] = lambda: Backoff(first_s=0.5, cap_s=30.0),
        stop: threading.Event | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.max_request_bytes = max_request_bytes
        self.timeout_s = timeout_s  # the configured one
        self.attempt_timeout_s = timeout_s  # longer while the collector answers late
        self.clock = clock
        self.metrics = OtlpMetrics(registry)
        self.backoff = backoff  # a fresh one per request: each outage starts from the first wait
        self.stop = stop or threading.Event()
        self.failing: str | None = None
        self.failing_since: float | None = None
        self.held_records = 0
        self.exported = {"metrics": 0, "logs": 0}

    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        pass

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        pass

    def handle(self, records: Sequence[InRecord]) -> list[Rejected]:
        samples = [r for r in records if r.name == "GpuSample"]
        xids = [r for r in records if r.name == "XidEvent"]
        rejected: list[Rejected] = []
        self.held_records = len(records)
        try:
            for signal, group, encode in (
                ("metrics", samples, mapping.encode_metrics),
                ("logs", xids, mapping.encode_logs),
            ):
                rejected += self._export(signal, group, encode)  # type: ignore[arg-type]
        finally:
            self.held_records = 0
        return rejected

    def _export(
        self,
        signal: Signal,
        group: Sequence[InRecord],
        encode: Callable[[Sequence[dict[str, Any]]], mapping.Encoded],
    ) -> list[Rejected]:
        """Encode record by record and send, in record order, requests of at most
        RECORDS_PER_REQUEST records and ``max_request_bytes``: memory stays near one request however
        large the records. The records refused, with why."""
        rejected: list[Rejected] = []
        request: list[tuple[InRecord, mapping.Encoded]] = []
        size = 0
        for rec in group:
            one = encode([rec.value])
            n = len(one.payload)
            if n > self.max_request_bytes:
                detail = f"{n} bytes of OTLP alone, over the {self.max_request_bytes}-byte request bound"
                log.error(
                    "a record too large for one OTLP request: dead-lettered",
                    extra=fields(signal=signal, error=detail),
                )
                rejected.append((rec, TOO_LARGE, detail))
                continue
            if request and (size + n > self.max_request_bytes or len(request) >= RECORDS_PER_REQUEST):
                rejected += self._send_halving(signal, request)
                request, size = [], 0
            request.append((rec, one))
            size += n
        if request:
            rejected += self._send_halving(signal, request)
        return rejected

    def _send_halving(self, signal: Signal, parts: list[tuple[InRecord, mapping.Encoded]]) -> list[Rejected]:
        """Send ``parts`` as one request, and as two halves (in order) when the collector refuses its
        size; a record refused alone is returned. One request is the parts' bytes end to end: the
        messages of a protobuf's concatenation merge, and its repeated ``resource_metrics`` (or
        ``resource_logs``) append (a resource may then appear twice in it, which OTLP allows)."""
        rejected: list[Rejected] = []
        todo = [parts]  # a stack: the first half on top
        while todo:
            part = todo.pop()
            request = mapping.Encoded(b"".join(e.payload for _, e in part), sum(e.items for _, e in part))
            refusal = self._send(signal, request)
            if refusal is None:
                continue
            if refusal.reason == TOO_LARGE and len(part) > 1:
                half = len(part) // 2
                todo += [part[half:], part[:half]]
                continue
            if refusal.reason == TOO_LARGE:
                log.error(
                    "the collector refused a record as too large: dead-lettered",
                    extra=fields(signal=signal, error=refusal.detail),
                )
            rejected += [(r, refusal.reason, refusal.detail) for r, _ in part]
        return rejected

    def _send(self, signal: Signal, request: mapping.Encoded) -> Refusal | None:
        """Export until acknowledged; why, when the collector refused the data as bad or too large."""
        wait = self.backoff().next
        while True:
            started = self.clock()
            try:
                partial = self.transport.export(signal, request.payload, timeout_s=self.attempt_timeout_s)
            except ExportError as exc:
                if exc.too_large:
                    self.metrics.exports.labels(signal, "too_large").inc()
                    self._recovered()
                    return Refusal(TOO_LARGE, f"the collector refused {len(request.payload)} bytes: {exc}")
                if not exc.retryable:
                    self.metrics.exports.labels(signal, "rejected").inc()
                    log.error("collector refused the data", extra=fields(signal=signal, error=str(exc)))
                    self._recovered()
                    return Refusal(REJECTED, str(exc))
                if exc.maybe_delivered:
                    self._timed_out(signal, request.items)
                else:
                    self.metrics.exports.labels(signal, "retry").inc()
                    if exc.slow:  # not sent in time: only a longer timeout gets it through
                        self._lengthen(signal, "OTLP export could not be sent within the timeout")
                self._failed(signal, str(exc))
                if self.stop.wait(wait()):
                    raise ExportAbandoned(f"stopped while {signal} exports fail: {exc}") from exc
                continue
            if self.clock() - started <= self.timeout_s:
                self.attempt_timeout_s = self.timeout_s  # answered in time again
            accepted = max(0, request.items - partial.rejected)
            self.metrics.exports.labels(signal, "ok").inc()
            self.metrics.items.labels(signal).inc(accepted)
            self.exported[signal] += accepted
            if partial.rejected:
                self.metrics.partial_rejected.labels(signal).inc(partial.rejected)
                log.warning(
                    "collector refused part of an export",
                    extra=fields(signal=signal, rejected=partial.rejected, error=partial.message),
                )
            self._recovered()
            return None

    def _timed_out(self, signal: Signal, items: int) -> None:
        """A sent request unanswered in time: wait longer for its resend (it may be a duplicate)."""
        self.metrics.exports.labels(signal, "timeout").inc()
        self.metrics.timed_out_items.labels(signal).inc(items)
        self._lengthen(
            signal,
            "OTLP export timed out after it was sent; resending with a longer timeout "
            "(the collector may get it twice)",
        )

    def _lengthen(self, signal: Signal, why: str) -> None:
        longer = min(self.attempt_timeout_s * TIMEOUT_GROWTH, max(MAX_TIMEOUT_S, self.timeout_s))
        if longer > self.attempt_timeout_s:
            log.warning(
                why, extra=fields(signal=signal, timeout_s=self.attempt_timeout_s, next_timeout_s=longer)
            )
        self.attempt_timeout_s = longer

    def _failed(self, signal: Signal, error: str) -> None:
        if self.failing is None:
            self.failing_since = time.time()
            log.warning("OTLP export failing; holding the batch", extra=fields(signal=signal, error=error))
        self.failing = error
        self.metrics.failing.set(1)

    def _recovered(self) -> None:
        if self.failing is not None:
            log.info(
                "OTLP export recovered",
                extra=fields(failed_for_s=round(time.time() - (self.failing_since or time.time()), 1)),
            )
        self.failing, self.failing_since = None, None
        self.metrics.failing.set(0)

    def health_detail(self) -> dict[str, Any]:
        if self.failing is None:
            return {}
        return {
            "exports_failing": self.failing,
            "exports_failing_for_s": round(time.time() - (self.failing_since or time.time()), 1),
            "records_held": self.held_records,
        }
