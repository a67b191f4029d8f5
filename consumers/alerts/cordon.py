"""Cordon nodes through the Kubernetes API when an alert says the node must be drained -- safely.

Off by default. ``--cordon`` enables it; ``--dry-run`` evaluates every decision (rate limit included) and
logs and records what it would do, without calling the API. Only alerts with ``drain_node`` (Xid 79 and
74 escalations, uncontained memory errors... per :mod:`gpupipe_consumers.alerts.rules.classify`) lead here.

Rules and reasons in full: docs/alerts.md, "Module notes", ``cordon.py``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe.clients.kube import STRATEGIC_MERGE_PATCH, KubeApiError, KubeClient
from gpupipe.common.logs import fields

__all__ = [
    "HOUR_MS",
    "CordonResult",
    "Cordoner",
    "KubeNodeApi",
    "SlidingWindowLimiter",
]

log = logging.getLogger("gpupipe.alerts.cordon")

HOUR_MS = 3_600_000
PATCH_CONTENT_TYPE = STRATEGIC_MERGE_PATCH
ANNOTATION_PREFIX = "gpupipe.io/"
_RELEASE = "__release__"  # queue item: uncordon our nodes that are not in the item's list


class KubeNodeApi:
    """The node calls cordoning needs, over the shared client."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    @staticmethod
    def _path(name: str) -> str:
        return f"/api/v1/nodes/{urllib.parse.quote(name, safe='')}"

    def get_node(self, name: str) -> dict[str, Any]:
        return self.client.get(self._path(name))

    def cordon(self, name: str, annotations: Mapping[str, str]) -> dict[str, Any]:
        patch = {"metadata": {"annotations": dict(annotations)}, "spec": {"unschedulable": True}}
        return self.client.patch(self._path(name), patch, PATCH_CONTENT_TYPE)

    def uncordon(self, name: str, annotations: Iterable[str]) -> dict[str, Any]:
        """Schedulable again; ``annotations`` are removed (a null in a merge patch deletes the key)."""
        patch = {"metadata": {"annotations": dict.fromkeys(annotations)}, "spec": {"unschedulable": False}}
        return self.client.patch(self._path(name), patch, PATCH_CONTENT_TYPE)

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node (``GET /api/v1/nodes``): the cluster-side ledger and the share circuit breaker."""
        return list(self.client.get("/api/v1/nodes").get("items") or [])


class SlidingWindowLimiter:
    """At most ``limit`` events in any ``window_ms`` (pure; times are passed in)."""

    def __init__(self, limit: int, window_ms: int = HOUR_MS) -> None:
        if limit < 0 or window_ms <= 0:
            raise ValueError("limit must be >= 0 and window positive")
        self.limit = limit
        self.window_ms = window_ms
        self._times: deque[int] = deque()

    def _prune(self, now_ms: int) -> None:
        while self._times and self._times[0] <= now_ms - self.window_ms:
            self._times.popleft()

    def count(self, now_ms: int) -> int:
        self._prune(now_ms)
        return len(self._times)

    def allow(self, now_ms: int) -> bool:
        return self.count(now_ms) < self.limit

    def record(self, at_ms: int) -> None:
        self._times.append(at_ms)
        if len(self._times) > 1 and self._times[-2] > at_ms:
            self._times = deque(sorted(self._times))

    def forget(self, at_ms: int) -> None:
        """Take back one event recorded at ``at_ms`` (an attempt known to have had no effect)."""
        with contextlib.suppress(ValueError):  # not recorded (it left the window meanwhile)
            self._times.remove(at_ms)

    def next_free_ms(self, now_ms: int) -> int | None:
        """When the next slot frees up (None if one is free now)."""
        if self.allow(now_ms):
            return None
        return self._times[0] + self.window_ms


@dataclass(frozen=True, slots=True)
class CordonResult:
    node: str
    outcome: str  # cordoned | already_cordoned | dry_run | rate_limited | failed
    dry_run: bool
    detail: str
    at_ms: int
    record: dict[str, Any]
    """The alert record that asked for it."""


class Cordoner:
    """Decides and performs cordons (see module doc)."""

    def __init__(
        self,
        api: KubeNodeApi | None,
        *,
        dry_run: bool,
        max_per_hour: int,
        on_result: Callable[[CordonResult], None],
        instance: str = "",
        clock: Callable[[], float] = time.time,
        window_ms: int = HOUR_MS,
        max_share: float = 0.5,
        uncordon: bool = False,
        retry_min_ms: int = 5_000,
        retry_max_ms: int = 300_000,
    ) -> None:
        if api is None and not dry_run:
            raise ValueError("a real cordoner needs an API client")
        if not 0 < max_share <= 1:
            raise ValueError("max_share must be in (0, 1]")
        self.api = api
        self.dry_run = dry_run
        self.max_share = max_share
        self.uncordon_enabled = uncordon
        self.retry_min_ms = retry_min_ms
        self.retry_max_ms = retry_max_ms
        self._retry: dict[str, tuple[int, int]] = {}  # node -> (failed attempts, not before ms)
        self._counted: set[tuple[str, int]] = set()  # (node, at_ms) in the limiter: no double count
        self._release_queued = False
        self.limiter = SlidingWindowLimiter(max_per_hour, window_ms)
        self.on_result = on_result
        self.instance = instance
        self._clock = clock
        self._decided: dict[str, int] = {}  # node -> when it was decided (cordoned / refused / dry run)
        self._queued: set[str] = set()
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=10_000)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.outcomes: dict[str, int] = {}

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def restore(self, action_records: Iterable[dict[str, Any]], now_ms: int | None = None) -> int:
        """Replay decisions published on gpu.alerts.v1 within the window; returns how many counted."""
        now_ms = self._now_ms() if now_ms is None else now_ms
        counted = 0
        for rec in action_records:
            rem = rec.get("remediation") or {}
            if rec.get("status") != "action" or rem.get("kind") != "cordon":
                continue
            at = int(rem.get("at_ms") or 0)
            if at <= now_ms - self.limiter.window_ms:
                continue
            outcome, node = rem.get("outcome"), rem.get("node") or ""
            if bool(rem.get("dry_run")) != self.dry_run:
                continue  # a dry run's decisions never count against real cordons, nor the reverse
            if outcome in ("cordoned", "dry_run") and self._count(node, at):
                counted += 1
            if outcome in ("cordoned", "dry_run", "already_cordoned", "rate_limited") and node:
                self._decided[node] = max(at, self._decided.get(node, 0))
        return counted

    def _count(self, node: str, at_ms: int) -> bool:
        """Count one cordon in the rate limit unless this (node, time) was counted already."""
        if (node, at_ms) in self._counted:
            return False
        self._counted.add((node, at_ms))
        self.limiter.record(at_ms)
        if len(self._counted) > 2 * max(self.limiter.limit, 8):
            # a pair out of the window is never offered again (restores skip what is older), so
            # the guard keeps the window's pairs only, not one per cordon for the process' life
            horizon = max(t for _, t in self._counted) - self.limiter.window_ms
            self._counted = {e for e in self._counted if e[1] > horizon}
        return True

    def _uncount(self, node: str, at_ms: int) -> None:
        if (node, at_ms) in self._counted:
            self._counted.discard((node, at_ms))
            self.limiter.forget(at_ms)

    def restore_from_cluster(self, now_ms: int | None = None) -> int:
        """Count the cordons the cluster itself records: nodes carrying our ``cordoned-at`` annotation
        within the window. Authoritative and durable: it survives a lost action record, a
        crash between the PATCH and the record, and ``--restore-lookback 0``. Returns how many it added."""
        if self.api is None:
            return 0
        now_ms = self._now_ms() if now_ms is None else now_ms
        added = 0
        for node in self.api.list_nodes():
            meta = node.get("metadata") or {}
            ann = meta.get("annotations") or {}
            if not str(ann.get(ANNOTATION_PREFIX + "cordoned-by", "")).startswith("gpupipe-alerts"):
                continue
            try:
                at = int(ann.get(ANNOTATION_PREFIX + "cordoned-at", ""))
            except ValueError:
                continue
            name = meta.get("name") or ""
            if at > now_ms - self.limiter.window_ms and name:
                added += self._count(name, at)
                with self._lock:
                    self._decided[name] = max(at, self._decided.get(name, 0))
        return added

    def reconcile(self, drain_records: Iterable[dict[str, Any]], keep: Iterable[str] = ()) -> int:
        """Desired state: every node with an open drain alert is cordoned (or decided). Request what is
        missing -- after a restart, a failover, a failed call (with backoff) -- and, with ``uncordon``,
        release nodes we cordoned whose faults have all recovered. ``keep``: nodes never released though
        no record names them (their drain alerts were evicted from memory, not recovered). Idempotent;
        returns requests queued."""
        queued = 0
        wanted: set[str] = set(keep)
        for rec in drain_records:
            wanted.add(rec.get("hostname") or "")
            queued += self.request(rec)
        if self.uncordon_enabled and self.api is not None and not self.dry_run and not self._release_queued:
            self._release_queued = True  # listed and patched by the worker thread, never by the caller
            try:
                self._queue.put_nowait({_RELEASE: sorted(wanted)})
            except queue.Full:
                self._release_queued = False
        return queued

    def _release(self, wanted: set[str]) -> None:
        try:
            nodes = self.api.list_nodes() if self.api is not None else []
        except KubeApiError as exc:
            log.warning("cannot list nodes to uncordon", extra=fields(error=str(exc)))
            return
        for node in nodes:
            meta = node.get("metadata") or {}
            name = meta.get("name") or ""
            ann = meta.get("annotations") or {}
            ours = str(ann.get(ANNOTATION_PREFIX + "cordoned-by", "")).startswith("gpupipe-alerts")
            if not name or name in wanted or not ours or not (node.get("spec") or {}).get("unschedulable"):
                continue
            keys = [k for k in ann if k.startswith(ANNOTATION_PREFIX + "cordon")]
            try:
                assert self.api is not None
                self.api.uncordon(name, keys)
            except KubeApiError as exc:
                log.warning("uncordon failed", extra=fields(node=name, error=str(exc)))
                continue
            with self._lock:
                self._decided.pop(name, None)
                self.outcomes["uncordoned"] = self.outcomes.get("uncordoned", 0) + 1
            log.warning("uncordoned: its faults recovered", extra=fields(node=name))

    def request(self, record: dict[str, Any]) -> bool:
        """Queue a cordon of the record's node unless it was decided within the window; never blocks."""
        node = record.get("hostname") or ""
        if not node:
            return False
        now = self._now_ms()
        with self._lock:
            when = self._decided.get(node)
            if when is not None and now - when < self.limiter.window_ms:
                return False
            if node in self._queued:
                return False
            retry = self._retry.get(node)
            if retry is not None and now < retry[1]:
                return False  # backing off after a failed call
            self._queued.add(node)
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self._queued.discard(node)
            log.error("cordon queue full; request dropped", extra=fields(node=node))
            return False
        return True

    def process(self, record: dict[str, Any]) -> CordonResult:
        """Decide and (unless dry run) perform one cordon; synchronous. Used by the worker thread."""
        node = record["hostname"]
        now = self._now_ms()
        try:
            result = self._decide(node, record, now)
        finally:
            with self._lock:
                self._queued.discard(node)
        with self._lock:
            if result.outcome != "failed":
                self._decided[node] = result.at_ms
                self._retry.pop(node, None)
            else:  # retried by the next reconcile once the backoff has passed
                attempts = self._retry.get(node, (0, 0))[0] + 1
                delay = min(self.retry_max_ms, self.retry_min_ms * 2 ** (attempts - 1))
                self._retry[node] = (attempts, result.at_ms + delay)
            self.outcomes[result.outcome] = self.outcomes.get(result.outcome, 0) + 1
        level = logging.WARNING if result.outcome in ("cordoned", "failed", "rate_limited") else logging.INFO
        log.log(
            level,
            f"cordon {result.outcome}" + (" (dry run)" if result.dry_run else ""),
            extra=fields(
                node=node, outcome=result.outcome, alert_id=record.get("alert_id"), detail=result.detail
            ),
        )
        try:
            self.on_result(result)
        except Exception:  # the record sink must not kill the worker
            log.exception("cordon result callback failed")
        return result

    def _decide(self, node: str, record: dict[str, Any], now: int) -> CordonResult:
        lim = self.limiter
        used = lim.count(now)
        window = f"{used}/{lim.limit} cordons in the last {lim.window_ms // 60_000} min"
        if not self.dry_run:
            assert self.api is not None
            try:
                current = self.api.get_node(node)
            except KubeApiError as exc:
                return CordonResult(node, "failed", False, f"GET node: {exc}", now, record)
            if (current.get("spec") or {}).get("unschedulable"):
                return CordonResult(
                    node, "already_cordoned", False, "node was unschedulable already", now, record
                )
            ann = (current.get("metadata") or {}).get("annotations") or {}
            if ann.get(ANNOTATION_PREFIX + "cordon-alert-id") == str(record.get("alert_id", "")):
                # we cordoned it for this very alert and a person uncordoned it: their call stands
                return CordonResult(
                    node, "already_cordoned", False, "uncordoned by a person after our cordon", now, record
                )
            refusal = self._share_refusal(node)
            if refusal:
                return CordonResult(node, "rate_limited", False, refusal, now, record)
        if not lim.allow(now):
            free = lim.next_free_ms(now)
            wait = f"; next slot in {max(0, (free or now) - now) // 60_000} min" if free else ""
            return CordonResult(
                node,
                "rate_limited",
                self.dry_run,
                f"{window}: limit reached (--cordon-max-per-hour){wait}; cordon by hand if needed",
                now,
                record,
            )
        if self.dry_run:
            self._count(node, now)
            return CordonResult(
                node, "dry_run", True, f"would PATCH spec.unschedulable=true ({window} before)", now, record
            )
        annotations = {
            ANNOTATION_PREFIX + "cordoned-by": f"gpupipe-alerts/{self.instance}"
            if self.instance
            else "gpupipe-alerts",
            ANNOTATION_PREFIX + "cordon-alert-id": str(record.get("alert_id", "")),
            ANNOTATION_PREFIX + "cordon-reason": str(record.get("summary", ""))[:500],
            ANNOTATION_PREFIX + "cordoned-at": str(now),
        }
        # Intent is counted before the call: a PATCH that times out may still have been applied (an
        # overloaded API server during a mass fault), and its retry then finds the node cordoned.
        self._count(node, now)
        try:
            assert self.api is not None
            self.api.cordon(node, annotations)
        except KubeApiError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                self._uncount(node, now)  # the server answered no: nothing changed
                return CordonResult(node, "failed", False, f"PATCH node: {exc}", now, record)
            return CordonResult(
                node, "failed", False, f"PATCH node: {exc}; counted, it may have taken effect", now, record
            )
        return CordonResult(
            node, "cordoned", False, f"spec.unschedulable=true ({window} before)", now, record
        )

    def _share_refusal(self, node: str) -> str:
        """Circuit breaker as a share of the cluster (as NVSentinel's): refuse when cordoning this node
        would make more than ``max_share`` of all nodes unschedulable. '' when allowed."""
        assert self.api is not None
        try:
            nodes = self.api.list_nodes()
        except KubeApiError as exc:
            return f"cannot list nodes for the cluster-share limit ({exc}): refusing, fail closed"
        total = len(nodes)
        down = sum(1 for n in nodes if (n.get("spec") or {}).get("unschedulable"))
        if total and (down + 1) / total > self.max_share:
            return (
                f"{down} of {total} nodes are unschedulable already: cordoning {node} would exceed "
                f"--cordon-max-share {self.max_share:g}; cordon by hand if needed"
            )
        return ""

    # ----------------------------------------------------------------------------------------- thread

    def start(self) -> Cordoner:
        self._thread = threading.Thread(target=self._run, name="cordon", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._run_one(item)
            except Exception:
                log.exception("cordon worker failed on a request")

    def _run_one(self, item: dict[str, Any]) -> None:
        if _RELEASE in item:
            self._release_queued = False
            self._release(set(item[_RELEASE]))
        else:
            self.process(item)

    def idle(self) -> bool:
        with self._lock:
            return not self._queued and self._queue.empty()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
