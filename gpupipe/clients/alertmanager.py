"""Alertmanager v2 client: a bounded state of alerts, sent by a background thread, retried until delivered.

:meth:`AlertmanagerSender.update` only takes a lock and writes a dict entry (the sender's ``shape``
makes an :class:`AmState` of a record), so a slow or dead Alertmanager never blocks the Kafka path.
A daemon thread posts changes at once, re-sends firing alerts each ``resend_interval_ms`` and backs
off on failures, keeping everything queued. The state is keyed by label set and bounded by
``max_alerts``; a firing entry is never dropped.
More: docs/architecture.md, "Module notes", ``clients/alertmanager.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpupipe.common.logs import fields

__all__ = ["AlertmanagerFanout", "AlertmanagerMetrics", "AlertmanagerSender", "PostFn", "http_post"]

log = logging.getLogger("gpupipe.alerts.alertmanager")

PostFn = Callable[[str, bytes, float], int]
"""(url, JSON body, timeout seconds) -> HTTP status; raises OSError (incl. timeouts) when no answer."""


@dataclass(frozen=True)
class AmState:
    """A record as Alertmanager sees it: labels are its identity there, annotations its text."""

    alert_id: str
    status: str  # "firing" or "resolved"
    labels: dict[str, str]
    annotations: dict[str, str]
    first_seen_ms: int
    resolved_at_ms: int | None = None
    keep_earlier: bool = False
    """Labels that change while the alert fires (an escalation of severity or cause) add a label set and
    keep the earlier ones firing until the alert resolves, instead of resolving them: the new set is
    routed by its new labels, the earlier one sends no false RESOLVED (the receiving config inhibits it
    under the newer one)."""


Shape = Callable[[dict[str, Any]], AmState]


def iso_ms(ms: int) -> str:
    """RFC 3339 with milliseconds, UTC (what Alertmanager's API expects)."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def am_alert(
    labels: dict[str, str],
    annotations: dict[str, str],
    starts_at_ms: int,
    ends_at_ms: int,
    generator_url: str = "",
) -> dict[str, Any]:
    """One element of the ``POST /api/v2/alerts`` body."""
    out: dict[str, Any] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": iso_ms(starts_at_ms),
        "endsAt": iso_ms(ends_at_ms),
    }
    if generator_url:
        out["generatorURL"] = generator_url
    return out


def http_post(url: str, body: bytes, timeout_s: float) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


class AlertmanagerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "gpupipe_alerts_alertmanager_requests",
            "POSTs to Alertmanager by result (ok; rejected: HTTP 400; http_error; error: no answer).",
            ["url", "result"],
            registry=reg,
        )
        self.alerts_sent = Counter(
            "gpupipe_alerts_alertmanager_alerts_sent",
            "Alerts accepted by Alertmanager, by status sent (firing, resolved).",
            ["url", "status"],
            registry=reg,
        )
        self.dropped = Counter(
            "gpupipe_alerts_alertmanager_dropped",
            "Resolved alerts dropped from the send queue because it was full (firing ones never are).",
            ["url"],
            registry=reg,
        )
        self.over_limit = Gauge(
            "gpupipe_alerts_alertmanager_over_limit",
            "Firing alerts held beyond --alertmanager-max-alerts (kept and re-sent, never dropped).",
            ["url"],
            registry=reg,
        )
        self.queued = Gauge(
            "gpupipe_alerts_alertmanager_queue",
            "Label sets held for Alertmanager (firing ones are re-sent; pending ones wait for delivery).",
            ["url", "state"],
            registry=reg,
        )
        self.seconds = Histogram(
            "gpupipe_alerts_alertmanager_request_duration_seconds",
            "Time of one POST to Alertmanager.",
            ["url"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0),
            registry=reg,
        )


@dataclass(slots=True)
class _Entry:
    alert_id: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_ms: int
    ends_ms: int | None  # None while firing
    dirty: bool = True
    version: int = 0
    last_sent_ms: int | None = None

    @property
    def resolved(self) -> bool:
        return self.ends_ms is not None


LabelKey = tuple[tuple[str, str], ...]


class AlertmanagerSender:
    """One Alertmanager (or HA pair member). See module doc."""

    def __init__(
        self,
        url: str,
        *,
        shape: Shape,
        resend_interval_ms: int = 60_000,
        timeout_s: float = 10.0,
        max_alerts: int = 10_000,
        batch_size: int = 500,
        batch_delay_s: float = 0.02,
        retry_min_s: float = 0.5,
        retry_max_s: float = 10.0,
        post: PostFn = http_post,
        clock: Callable[[], float] = time.time,
        metrics: AlertmanagerMetrics | None = None,
    ) -> None:
        if resend_interval_ms <= 0 or max_alerts < 1 or batch_size < 1:
            raise ValueError("resend interval, max_alerts and batch_size must be positive")
        self.url = url.rstrip("/")
        self.endpoint = self.url + "/api/v2/alerts"
        self.resend_interval_ms = resend_interval_ms
        self.timeout_s = timeout_s
        self.max_alerts = max_alerts
        self.batch_size = batch_size
        self.batch_delay_s = batch_delay_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._shape = shape
        self._post = post
        self._clock = clock
        self.metrics = metrics or AlertmanagerMetrics(None)
        self._entries: dict[LabelKey, _Entry] = {}
        self._by_id: dict[str, LabelKey] = {}
        self._earlier: dict[str, list[LabelKey]] = {}  # alert id -> label sets kept firing (keep_earlier)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.sent_ok = 0
        self.failures = 0
        self.dropped = 0
        self.over_limit = 0  # firing entries held beyond max_alerts (never dropped)
        self.last_error = ""

    # ---------------------------------------------------------------------------------- producer side

    def update(self, rec: dict[str, Any]) -> None:
        """Take the latest state of an alert (a record the shape reads); never blocks on the network."""
        if rec.get("status") not in ("firing", "resolved"):
            return
        state = self._shape(rec)
        status, labels, annotations, aid = state.status, state.labels, state.annotations, state.alert_id
        key: LabelKey = tuple(sorted(labels.items()))
        now_ms = self._now_ms()
        with self._lock:
            prev = self._by_id.get(aid)
            if prev is not None and prev != key:
                old = self._entries.get(prev)
                if old is not None and old.alert_id == aid and not old.resolved:
                    if state.keep_earlier and status == "firing":
                        self._earlier.setdefault(aid, []).append(prev)
                    else:
                        old.ends_ms = now_ms
                        self._touch(old)
            if status == "firing" and key in self._earlier.get(aid, ()):
                self._earlier[aid].remove(key)  # the current label set again
            if status != "firing":
                for k in self._earlier.pop(aid, ()):
                    e = self._entries.get(k)
                    if e is not None and e.alert_id == aid and not e.resolved:
                        e.annotations = annotations
                        e.ends_ms = state.resolved_at_ms or now_ms
                        self._touch(e)
            entry = self._entries.get(key)
            if status == "firing":
                if entry is None:
                    entry = self._entries[key] = _Entry(aid, labels, annotations, state.first_seen_ms, None)
                    self._bound()
                entry.alert_id = aid
                entry.annotations = annotations
                entry.starts_ms = state.first_seen_ms
                entry.ends_ms = None
                self._by_id[aid] = key
            else:
                if entry is not None and entry.alert_id != aid:
                    self._by_id.pop(aid, None)
                    return  # a newer alert owns this label set
                if entry is None:
                    entry = self._entries[key] = _Entry(aid, labels, annotations, state.first_seen_ms, None)
                    self._bound()
                entry.annotations = annotations
                entry.ends_ms = state.resolved_at_ms or now_ms
                self._by_id.pop(aid, None)
            self._touch(entry)
        self._wake.set()

    def forget(self, alert_id: str) -> None:
        """Stop re-sending alert ``alert_id`` without resolving it (its owner evicted it from memory to
        bound the state): Alertmanager lets it end by itself at its ``endsAt``."""
        with self._lock:
            keys = [self._by_id.pop(alert_id, None), *self._earlier.pop(alert_id, ())]
            for key in keys:
                entry = self._entries.get(key) if key is not None else None
                if entry is not None and entry.alert_id == alert_id:
                    del self._entries[key]

    def _touch(self, entry: _Entry) -> None:
        entry.dirty = True
        entry.version += 1

    def _bound(self) -> None:
        """Evict resolved entries beyond ``max_alerts``; never a firing one.

        Firing entries are bounded by the engine's open alerts; dropping one would leave Alertmanager to
        expire an alert gpupipe still has firing. The excess is counted (``over_limit``) instead."""
        over = len(self._entries) - self.max_alerts
        if over <= 0:
            if self.over_limit:
                self.over_limit = 0
                self.metrics.over_limit.labels(self.url).set(0)
            return
        victims = [k for k, e in self._entries.items() if e.resolved][:over]
        for k in victims:
            e = self._entries.pop(k)
            if self._by_id.get(e.alert_id) == k:
                del self._by_id[e.alert_id]
        self.over_limit = over - len(victims)
        self.metrics.over_limit.labels(self.url).set(self.over_limit)
        if victims:
            self.dropped += len(victims)
            self.metrics.dropped.labels(self.url).inc(len(victims))

    # ------------------------------------------------------------------------------------- sender side

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def due(self, now_ms: int) -> list[tuple[LabelKey, int, dict[str, Any]]]:
        """(label key, version, API alert) for every entry to send now."""
        out = []
        resend = self.resend_interval_ms
        with self._lock:
            for key, e in self._entries.items():
                if not (e.dirty or (not e.resolved and now_ms - (e.last_sent_ms or 0) >= resend)):
                    continue
                # A node clock ahead of ours must not make startsAt > endsAt (Alertmanager rejects it).
                starts = min(e.starts_ms, now_ms)
                ends = max(e.ends_ms, starts) if e.ends_ms is not None else now_ms + 4 * resend
                out.append((key, e.version, am_alert(e.labels, e.annotations, starts, ends)))
        return out

    def step(self, now_ms: int | None = None) -> bool:
        """Send everything due once; True when all of it was accepted (or nothing was due)."""
        now_ms = self._now_ms() if now_ms is None else now_ms
        batch = self.due(now_ms)
        for i in range(0, len(batch), self.batch_size):
            chunk = batch[i : i + self.batch_size]
            if not self._send(chunk, now_ms):
                return False
        return True

    def _send(self, chunk: Sequence[tuple[LabelKey, int, dict[str, Any]]], now_ms: int) -> bool:
        """POST one chunk. A 400 (Alertmanager validates every alert and rejects the whole request for
        one bad alert) is narrowed down by splitting the chunk; an alert rejected on its own is dropped
        (logged, counted), so it cannot hold the others back forever."""
        status = self._post_chunk(chunk, now_ms)
        if status != 400:
            return status is not None and 200 <= status < 300
        if len(chunk) == 1:
            self._reject(chunk[0])
            return True
        mid = len(chunk) // 2
        return self._send(chunk[:mid], now_ms) and self._send(chunk[mid:], now_ms)

    def _reject(self, item: tuple[LabelKey, int, dict[str, Any]]) -> None:
        key, _, alert = item
        with self._lock:
            e = self._entries.pop(key, None)
            if e is not None and self._by_id.get(e.alert_id) == key:
                del self._by_id[e.alert_id]
        self.dropped += 1
        self.metrics.dropped.labels(self.url).inc()
        log.error(
            "alertmanager rejected an alert (HTTP 400); dropped", extra=fields(url=self.url, alert=alert)
        )

    def _post_chunk(self, chunk: Sequence[tuple[LabelKey, int, dict[str, Any]]], now_ms: int) -> int | None:
        body = json.dumps([c[2] for c in chunk], separators=(",", ":")).encode()
        began = time.perf_counter()
        try:
            status = self._post(self.endpoint, body, self.timeout_s)
        except (OSError, ValueError) as exc:  # refused, reset, timeout (TimeoutError is an OSError), bad URL
            self._failed("error", f"{type(exc).__name__}: {exc}")
            return None
        finally:
            self.metrics.seconds.labels(self.url).observe(time.perf_counter() - began)
        if status == 400:
            self.metrics.requests.labels(self.url, "rejected").inc()
            return status
        if not 200 <= status < 300:
            self._failed("http_error", f"HTTP {status}")
            return status
        self.metrics.requests.labels(self.url, "ok").inc()
        firing = resolved = 0
        with self._lock:
            for key, version, _ in chunk:
                e = self._entries.get(key)
                if e is None:
                    continue
                if e.resolved:
                    resolved += 1
                else:
                    firing += 1
                if e.version != version:
                    continue  # changed while in flight: send again
                e.dirty = False
                e.last_sent_ms = now_ms
                if e.resolved:
                    del self._entries[key]
        self.sent_ok += len(chunk)
        if firing:
            self.metrics.alerts_sent.labels(self.url, "firing").inc(firing)
        if resolved:
            self.metrics.alerts_sent.labels(self.url, "resolved").inc(resolved)
        self._backoff_s = 0.0
        return status

    def _failed(self, result: str, detail: str) -> None:
        self.failures += 1
        self.last_error = detail
        self.metrics.requests.labels(self.url, result).inc()
        self._backoff_s = min(self.retry_max_s, max(self.retry_min_s, self._backoff_s * 2))
        self._retry_at = self._clock() + self._backoff_s
        log.warning(
            "alertmanager post failed; alerts stay queued",
            extra=fields(url=self.url, error=detail, retry_in_s=round(self._backoff_s, 2), queued=len(self)),
        )

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def pending(self) -> int:
        """Entries not yet accepted by Alertmanager in their latest state."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.dirty)

    def _export(self) -> None:
        with self._lock:
            firing = sum(1 for e in self._entries.values() if not e.resolved)
            pending = sum(1 for e in self._entries.values() if e.dirty)
        self.metrics.queued.labels(self.url, "firing").set(firing)
        self.metrics.queued.labels(self.url, "pending").set(pending)

    # ---------------------------------------------------------------------------------------- thread

    def start(self) -> AlertmanagerSender:
        self._thread = threading.Thread(target=self._run, name="alertmanager", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            if self._stop.is_set():
                break
            if self._wake.is_set():
                self._wake.clear()
                self._stop.wait(self.batch_delay_s)
            wait = self._retry_at - self._clock()
            if wait > 0:
                self._stop.wait(wait)
                if self._stop.is_set():
                    break
            try:
                self.step()
            except Exception:  # never let a bug kill the sender thread
                log.exception("alertmanager sender step failed")
            self._export()

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        """Stop the thread; try once more (bounded) to deliver what is pending."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 2)
        if self.pending():
            saved = self.timeout_s
            self.timeout_s = min(saved, flush_timeout_s)
            try:
                self.step()
            finally:
                self.timeout_s = saved
        self._export()


class AlertmanagerFanout:
    """Several Alertmanagers (an HA cluster is given every member's URL, as Prometheus is)."""

    def __init__(self, senders: Sequence[AlertmanagerSender]) -> None:
        self.senders = list(senders)

    def update(self, rec: dict[str, Any]) -> None:
        for s in self.senders:
            s.update(rec)

    def forget(self, alert_id: str) -> None:
        for s in self.senders:
            s.forget(alert_id)

    def start(self) -> AlertmanagerFanout:
        for s in self.senders:
            s.start()
        return self

    def stop(self, flush_timeout_s: float = 5.0) -> None:
        for s in self.senders:
            s.stop(flush_timeout_s)

    def pending(self) -> int:
        return sum(s.pending() for s in self.senders)
