"""The otlp service: consume-loop handler that exports each batch and returns only once it is taken.

The consume loop stores a batch's offsets after :meth:`OtlpService.handle` returns, so ``handle``
returns only when the collector acknowledged every request built from the batch: a collector outage
holds the batch (one batch: memory stays bounded) and retries it with capped exponential backoff,
and nothing is committed meanwhile. A stop while the batch is unsent raises :class:`ExportAbandoned`,
which leaves its offsets unstored: a restart exports it again. A request the collector refuses as bad
data is dead-lettered (reason ``otlp-rejected``), not retried forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpupipe.logs import fields
from gpupipe.startup import Backoff
from gpupipe_consumers.consume_loop import InRecord, Rejected
from gpupipe_consumers.otlp import mapping
from gpupipe_consumers.otlp.export import ExportError, Signal, Transport

log = logging.getLogger("gpupipe.otlp")

#: Records per export request: 256 samples make about 4,000 data points, well under the 4 MiB a
#: collector's receiver takes by default.
RECORDS_PER_REQUEST = 256


class ExportAbandoned(Exception):
    """Stopped while a batch was not yet acknowledged: its offsets must not be stored."""


class OtlpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.exports = Counter(
            "gpupipe_otlp_exports",
            "OTLP export requests by signal and outcome (ok, retry, rejected).",
            ["signal", "outcome"],
            registry=registry,
        )
        self.items = Counter(
            "gpupipe_otlp_items",
            "Data points (metrics) and log records (logs) the collector acknowledged.",
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


class OtlpService:
    """Handler: GpuSample -> metrics requests, XidEvent -> logs requests, each acknowledged before return."""

    def __init__(
        self,
        transport: Transport,
        registry: CollectorRegistry,
        *,
        backoff: Callable[[], Backoff] = lambda: Backoff(first_s=0.5, cap_s=30.0),
        stop: threading.Event | None = None,
    ) -> None:
        self.transport = transport
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
                for i in range(0, len(group), RECORDS_PER_REQUEST):
                    chunk = group[i : i + RECORDS_PER_REQUEST]
                    refused = self._send(signal, encode([r.value for r in chunk]))  # type: ignore[arg-type]
                    if refused is not None:
                        rejected += [(r, "otlp-rejected", refused) for r in chunk]
        finally:
            self.held_records = 0
        return rejected

    def _send(self, signal: Signal, request: mapping.Encoded) -> str | None:
        """Export until acknowledged; the collector's reason when it refused the data as bad."""
        wait = self.backoff().next
        while True:
            try:
                partial = self.transport.export(signal, request.payload)
            except ExportError as exc:
                if not exc.retryable:
                    self.metrics.exports.labels(signal, "rejected").inc()
                    log.error("collector refused the data", extra=fields(signal=signal, error=str(exc)))
                    self._recovered()
                    return str(exc)
                self.metrics.exports.labels(signal, "retry").inc()
                self._failed(signal, str(exc))
                if self.stop.wait(wait()):
                    raise ExportAbandoned(f"stopped while {signal} exports fail: {exc}") from exc
                continue
            self.metrics.exports.labels(signal, "ok").inc()
            self.metrics.items.labels(signal).inc(request.items)
            self.exported[signal] += request.items
            if partial.rejected:
                self.metrics.partial_rejected.labels(signal).inc(partial.rejected)
                log.warning(
                    "collector refused part of an export",
                    extra=fields(signal=signal, rejected=partial.rejected, error=partial.message),
                )
            self._recovered()
            return None

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
