"""The metrics consumer's state: the latest rendered series per GPU, joined at scrape (pure).

:class:`SeriesStore` keeps per GPU key (GPU or MIG device UUID) the line list of its latest sample,
renders it lazily at scrape, expires GPUs that went silent and joins the families into the body.
Thread-safe under one lock. How it stays fast and bounded: docs/inside-metrics.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from gpupipe.domain import pci
from gpupipe_consumers.metrics import derived, gcpolicy
from gpupipe_consumers.metrics.collectors_csv import CounterSet, default_counters
from gpupipe_consumers.metrics.gpu_families import BodyJoiner
from gpupipe_consumers.metrics.labels import GpuView
from gpupipe_consumers.metrics.layout import merge_parent
from gpupipe_consumers.metrics.readings import PENDING, Kept, complete
from gpupipe_consumers.metrics.render import Renderer, RenderOptions
from gpupipe_consumers.metrics.self_families import (
    OWN_METRICS,
    health_not_run_text,
    own_text,
    registry_text,
    unsupported_text,
)

XID_RESULTS = ("counted", "duplicate", "ignored", "unattributed")
DROP_KINDS = ("sample", "xid")
#: GPU keys one store holds: 20k GPUs are some 200 MB of label text and a 60 MB scrape, past what one
#: instance serves in a scrape interval (scale out by partitions instead); a flood of forged UUIDs
#: stops here instead of at the memory limit.
DEFAULT_MAX_GPUS = 20_000

log = logging.getLogger("gpupipe.metrics")

_IDENTITY_FIELDS = ("timestamp_ms", "hostname", "gpu_index", "uuid", "pci_bus_id", "model_name")


class UnusableSample(ValueError):
    """A GpuSample the store cannot apply: no identity fields (wrong topic or schema?) or malformed parts."""


class _Gpu:
    __slots__ = (
        "bus",
        "clock_prev",
        "clock_totals",
        "clock_win",
        "health",
        "hidden",
        "host",
        "ident",
        "key",
        "lines",
        "parent",
        "partition",
        "pending",
        "prev",
        "rec",
        "seen_s",
        "stale_s",
        "ts_ms",
        "view",
        "xid_counts",
        "xid_last",
        "xid_last_ts",
        "xid_partition",
        "xid_seen_s",
        "xid_win",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.ident: tuple | None = None  # identity of the sample the view was made from
        self.view: GpuView | None = None
        self.lines: list[bytes] = []  # the line list (head, value per family; see render.py)
        self.partition: Any = None
        self.host: str | None = None  # the node of its latest sample (None: XID only)
        self.bus: tuple[str, str] | None = None  # its (node, bus id) entry in the store's map
        self.seen_s = 0.0  # the input's running time (see SeriesStore) at its last sample
        self.stale_s = 0.0
        self.ts_ms: int | None = None  # sample time of the last sample; None: no sample (XID only)
        self.xid_counts: dict[int, int] = {}
        self.xid_last: int | None = None
        self.xid_last_ts = -1
        self.xid_partition: Any = None
        self.xid_seen_s = 0.0
        self.xid_win: derived.WindowCounts | None = None  # XIDs in the --xid-count-window-size window
        self.clock_win: derived.WindowCounts | None = None  # samples per clock-event bit in the window
        self.clock_totals: dict[int, int] = {}  # rising edges per clock-event bit
        self.clock_prev = 0
        self.health: derived.Health | None = None  # from the latest sample
        self.rec: Mapping[str, Any] | None = None  # latest sample (MIG parents and instances only)
        self.parent: str | None = None  # a MIG instance's parent GPU UUID
        self.hidden = False  # a MIG-mode parent in the "instances" layout: no series of its own
        self.pending: Mapping[str, Any] | None = None  # latest sample, not rendered yet
        self.prev: Kept | None = None  # the last render from readings, to reuse value text from


class SeriesStore:
    """Latest series per GPU for the partitions this instance holds; renders ``/metrics``."""

    def __init__(
        self,
        counters: CounterSet | None = None,
        *,
        options: RenderOptions | None = None,
        registry: Any | None = None,
        stale_after_s: float | None = None,
        stale_intervals: float = 3.0,
        fallback_interval_s: float = 30.0,
        xid_only_stale_after_s: float = 3600.0,
        max_event_ids: int = 100_000,
        max_expired_views: int = 20_000,
        expired_view_ttl_s: float = 600.0,
        flush_chunk: int = 256,
        max_gpus: int = DEFAULT_MAX_GPUS,
        drop_log_interval_s: float = 60.0,
    ) -> None:
        self.renderer = Renderer(counters if counters is not None else default_counters(), options)
        self.families = self.renderer.families
        self._registry = registry
        self._stale_after_s = stale_after_s
        self._stale_intervals = stale_intervals
        self._fallback_interval_s = fallback_interval_s
        self._xid_only_stale_after_s = xid_only_stale_after_s
        self._max_event_ids = max_event_ids
        self._flush_chunk = flush_chunk
        self._lock = threading.Lock()
        self._flight = threading.Condition()  # one scrape build at a time; others take its result
        self._building = False
        self._built: list[bytes] | None = None
        self._built_gen = 0
        self._gpus: dict[str, _Gpu] = {}
        self._max_gpus = max_gpus
        self._xid_only: dict[str, None] = {}  # keys made by an XID, oldest first (some sampled since)
        self._dropped = dict.fromkeys(DROP_KINDS, 0)
        self._drop_log_interval_s = drop_log_interval_s
        self._drop_logged_s = float("-inf")
        self._drop_logged_n = 0
        self._progress_s = float("-inf")  # ingest wall time of the newest sample: the input's progress
        # The input's running time: ingest wall time with every gap between two ingests cut to one
        # sample interval. Staleness is measured on it, so a stall (nothing arrives) counts as one
        # interval, and after it the partitions that resume first do not make the others look stale.
        self._active_s = 0.0
        self._nodes: dict[str, int] = {}  # node -> newest sample time (ms) of its GPUs here
        self._by_bus: dict[tuple[str, str], str] = {}  # (hostname, NVML bus id) -> GPU UUID
        self._event_ids: dict[str, None] = {}  # recent XID event ids, oldest first
        self._invalid: dict[tuple[str, str], int] = {}
        self._xid_results = dict.fromkeys(XID_RESULTS, 0)
        self._expired = 0
        self._version = 0
        self._body: tuple[bytes, ...] = ()  # the GPU families of version _body_version, per family
        self._body_version = -1
        self._joiner = BodyJoiner(self.families)
        self._own_names = frozenset((*(f.name for f in self.families), *OWN_METRICS))
        self._n = len(self.families)
        r = self.renderer
        o = r.options
        self._instances = o.mig_layout == "instances"
        self._children: dict[str, set[str]] = {}  # MIG parent UUID -> instance keys
        self._windowed: set[str] = set()  # keys with XIDs in their window (pruned at scrape)
        self._want_xid_win = r.has_xid_count or r.has_health
        self._want_exp = r.has_xid_count or r.has_health or r.has_clock_count or r.has_clock_total
        self._unsupported_text = unsupported_text(r.counters) + (
            health_not_run_text(derived.NOT_RUN_WATCHES) if r.has_health else ""
        )
        # keys sampled since the last scrape (rendered by _flush); g.pending is not None for them
        self._dirty: set[str] = set()
        # label views of GPUs expired in the last expired_view_ttl_s, oldest first: a GPU that comes
        # back (its samples were only late: a consumer behind by more than the staleness limit)
        # costs no label rendering, so falling behind does not make catching up dearer
        self._expired_views: dict[str, tuple[tuple, GpuView, float]] = {}
        self._max_expired_views = max_expired_views
        self._expired_view_ttl_s = expired_view_ttl_s
        self._identity = r.identity_getter()
        self._node_label = o.host_label or "Hostname"

    # -- ingest ----------------------------------------------------------------------------------
    def apply_sample(self, record: Mapping[str, Any], partition: Any, now_s: float) -> str:
        """Take the GPU's latest sample; returns the GPU key.

        Labels, MIG bookkeeping and the exporter-derived state are updated here; the value text is
        rendered at the next scrape, once, from the GPU's latest sample (see :meth:`_flush`)."""
        with self._lock:
            return self._apply_locked(record, partition, now_s)

    def apply_samples(
        self, items: Iterable[tuple[Mapping[str, Any], Any]], now_s: float
    ) -> list[tuple[int, Exception]]:
        """:meth:`apply_sample` for a consumed batch of ``(record, partition)``, under one hold of
        the lock: a scrape rendering in chunks then delays a batch at most once, not each of its
        samples. Returns ``(index, exception)`` for the records that failed (the rest are in)."""
        failed: list[tuple[int, Exception]] = []
        apply = self._apply_locked
        with self._lock:
            for i, (record, partition) in enumerate(items):
                try:
                    apply(record, partition, now_s)
                except Exception as exc:  # UnusableSample, or a poison record: the caller decides
                    failed.append((i, exc))
        return failed

    def _apply_locked(self, record: Mapping[str, Any], partition: Any, now_s: float) -> str:
        mig = record.get("mig")
        try:
            key = mig["mig_uuid"] if mig else record["uuid"]
        except (KeyError, TypeError) as exc:
            raise UnusableSample(f"GpuSample without uuid/mig_uuid: {exc}") from exc
        g = self._gpus.get(key)
        new = g is None
        if g is None:
            if len(self._gpus) >= self._max_gpus and not self._displace_xid_only():
                self._drop("sample", key, now_s)
                return key
            g = _Gpu(key)
            kept = self._expired_views.pop(key, None)
            if kept is not None:  # back after expiring (a consumer that fell behind): same labels
                g.ident, g.view, _ = kept
        try:
            try:
                self._accept(g, record)
            except KeyError:  # a projected or hand-made record: missing fields are null
                record = _complete(record)
                self._accept(g, record)
        except (KeyError, TypeError, AttributeError) as exc:  # e.g. an allocation without a pod
            raise UnusableSample(f"GpuSample {key}: {type(exc).__name__}: {exc}") from exc
        if new:
            self._gpus[key] = g
        g.pending = record
        self._dirty.add(key)
        g.partition = partition
        iv = record.get("interval_ms")
        interval_s = iv / 1000.0 if iv else self._fallback_interval_s
        if now_s > self._progress_s:
            if self._progress_s > float("-inf"):
                self._active_s += min(now_s - self._progress_s, interval_s)
            self._progress_s = now_s
        g.seen_s = self._active_s
        ts = g.ts_ms = record["timestamp_ms"]
        host = record["hostname"]
        if host != g.host:
            if g.host is not None:
                self._prune_nodes()  # the GPU moved: its old node may have no GPU left
            g.host = host
        if ts > self._nodes.get(host, -(2**63)):
            self._nodes[host] = ts
        if self._stale_after_s is not None:
            g.stale_s = self._stale_after_s
        else:
            g.stale_s = self._stale_intervals * interval_s
        if g.hidden:  # its instances take its device-wide readings again
            self._dirty.update(self._children.get(key, ()))
        self._version += 1
        return key

    def _accept(self, g: _Gpu, record: Mapping[str, Any]) -> None:
        """Labels, MIG layout and exporter-derived state for one sample (no value text yet).

        Raises KeyError when the record lacks an identity or label field (the caller completes it
        with nulls, or finds it invalid), TypeError/AttributeError for a malformed one. Missing
        metric fields are completed at render (:meth:`_render`): checking ~50 keys per sample was
        most of ingest's apply time."""
        r = self.renderer
        ident = self._identity(record)
        if ident != g.ident:
            g.view = r.view(record)
            g.ident = ident
            g.bus = (record["hostname"], pci.nvml_form(record["pci_bus_id"]))
            self._by_bus[g.bus] = record["uuid"]
        if self._instances:
            if record["mig"] is not None:
                g.parent = record["uuid"]
                g.rec = record
                self._children.setdefault(g.parent, set()).add(g.key)
                if self._want_exp:
                    parent = self._gpus.get(g.parent)
                    if parent is not None and parent.rec is not None:
                        record = merge_parent(complete(record), complete(parent.rec))
                    self._sample_exp_state(g, record)
                return
            if record.get("mig_enabled"):
                g.hidden = True
                g.rec = record
                g.health = derived.sample_health(record) if r.has_health else None
                return
            g.hidden = False
        if self._want_exp:
            self._sample_exp_state(g, record)

    def _flush(self, dirty: Iterable[str]) -> None:
        """Render these GPUs (sampled since the last scrape), each from its latest sample only: the
        work of a scrape is proportional to the GPUs that changed, and samples a scrape never
        showed are never rendered."""
        for key in dirty:
            g = self._gpus.get(key)
            if g is None or g.ts_ms is None or g.view is None:
                continue
            try:
                if g.hidden:
                    g.lines = self._hidden_lines(g)
                    g.pending = None
                    continue
                rec = g.rec if g.parent is not None else g.pending
                if rec is None:
                    continue
                if g.parent is not None:
                    parent = self._gpus.get(g.parent)
                    if parent is not None and parent.rec is not None:
                        rec = merge_parent(complete(rec), complete(parent.rec))
                g.lines = self._render(g, rec)
                g.pending = None
            except Exception:  # never let one odd record break every scrape
                log.exception("metrics: cannot render GPU %s; its previous series stay", key)

    def _render(self, g: _Gpu, record: Mapping[str, Any]) -> list[bytes]:
        xid_last = g.xid_last
        if xid_last is None and g.parent is not None:
            parent = self._gpus.get(g.parent)
            if parent is not None:
                xid_last = parent.xid_last
        if xid_last is None:
            xid_last = record.get("last_xid")
            if xid_last is None:
                xid_last = 0
        counts = self._xid_counts(g)
        invalid: dict[tuple[str, str], int] = {}
        view = g.view
        try:
            lines = self.renderer.render(record, view, xid_last, counts, invalid, g.prev)
        except KeyError:  # a projected or hand-made record: missing metric fields are null
            invalid = {}  # counted once, from the completed record
            record = _complete(complete(record))
            lines = self.renderer.render(record, view, xid_last, counts, invalid)
        # value text to reuse next time: only from a single-series render of pending readings
        readings = record.get(PENDING)
        g.prev = None if readings is None or view is None or view.multi else readings.kept(lines)
        for k, n in invalid.items():
            self._invalid[k] = self._invalid.get(k, 0) + n
        if self._want_exp:
            self._fill_exp(g, lines, sampled=True)
        return lines

    def _hidden_lines(self, g: _Gpu) -> list[bytes]:
        """A MIG-mode parent in the instances layout: its health (dcgm-exporter watches whole GPUs
        only), and the XID counters of its own events only while none of its instances is here to
        carry them."""
        kids = any(k in self._gpus for k in self._children.get(g.key, ()))
        lines = self.renderer.render_xid_only(g.view, None, None if kids else g.xid_counts)
        if g.health is not None:
            xw = g.xid_win.counts if g.xid_win is not None else {}
            self.renderer.render_exp(g.view, lines, health=derived.with_fatal_xids(g.health, xw))
        return lines

    def _mig_parent(self, g: _Gpu) -> _Gpu | None:
        return self._gpus.get(g.parent) if g.parent is not None else None

    def _xid_counts(self, g: _Gpu) -> Mapping[int, int]:
        """XIDs since start per code; a MIG instance adds its GPU's (GPU-wide XIDs are the XIDs of
        each of its instances, as DCGM reports its GPU-level fields for them)."""
        parent = self._mig_parent(g)
        return g.xid_counts if parent is None else derived.add_counts(g.xid_counts, parent.xid_counts)

    def _rerender_children(self, parent_key: str) -> None:
        """A MIG parent changed (its XID): its instances are rendered again at the next scrape."""
        self._dirty.update(self._children.get(parent_key, ()))

    def _sample_exp_state(self, g: _Gpu, record: Mapping[str, Any]) -> None:
        r = self.renderer
        o = r.options
        ts = record["timestamp_ms"]
        if r.has_clock_count or r.has_clock_total:
            bits = derived.clock_bits(record.get("clock_event_reasons"))
            if r.has_clock_count:
                if g.clock_win is None:
                    g.clock_win = derived.WindowCounts(o.clock_window_ms)
                g.clock_win.push(ts, bits)
                g.clock_win.prune(ts)
            if r.has_clock_total:
                prev = g.clock_prev
                for b in bits:
                    if not prev & b:
                        g.clock_totals[b] = g.clock_totals.get(b, 0) + 1
                g.clock_prev = sum(bits)
        if r.has_health:  # dcgm-exporter watches the health of whole GPUs only: none on an instance
            g.health = None if record.get("mig") is not None else derived.sample_health(record)

    def _fill_exp(self, g: _Gpu, lines: list[bytes], *, sampled: bool) -> None:
        """Fill the DCGM_EXP_* window/clock/health families of a line list from ``g``'s state."""
        xw: Mapping[int, int] = g.xid_win.counts if g.xid_win is not None else {}
        parent = self._mig_parent(g)
        if parent is not None and parent.xid_win is not None:
            xw = derived.add_counts(xw, parent.xid_win.counts)
        health = derived.with_fatal_xids(g.health, xw) if (sampled and g.health is not None) else None
        self.renderer.render_exp(
            g.view,
            lines,
            xid_window=xw,
            clock_window=(g.clock_win.counts if g.clock_win is not None else {}) if sampled else None,
            clock_totals=g.clock_totals if sampled else None,
            health=health,
        )

    def apply_xid(self, event: Mapping[str, Any], partition: Any, now_s: float) -> bool:
        """Count one gpu.xid event; True when it was counted."""
        code = event.get("xid")
        if event.get("kind") != "xid" or code is None or code == 0:
            with self._lock:
                self._xid_results["ignored"] += 1
            return False
        r = self.renderer
        with self._lock:
            eid = event.get("event_id")
            if eid:
                if eid in self._event_ids:
                    self._xid_results["duplicate"] += 1
                    return False
                self._event_ids[eid] = None
                if len(self._event_ids) > self._max_event_ids:
                    del self._event_ids[next(iter(self._event_ids))]
            uuid = event.get("uuid")
            if not uuid:
                bus = event.get("pci_bus_id") or ""
                uuid = self._by_bus.get((event.get("hostname") or "", pci.nvml_form(bus)))
            if not uuid:
                self._xid_results["unattributed"] += 1
                return False
            mig_uuid = event.get("mig_uuid")
            key = mig_uuid if mig_uuid and mig_uuid in self._gpus else uuid
            g = self._gpus.get(key)
            if g is None:
                if len(self._gpus) >= self._max_gpus:
                    self._drop("xid", key, now_s)
                    return False
                g = self._gpus[key] = _Gpu(key)
                self._xid_only[key] = None
                g.view = r.event_view(event, uuid)
                g.lines = r.render_xid_only(g.view, None, None)
            g.xid_counts[code] = g.xid_counts.get(code, 0) + 1
            ts = event.get("timestamp_ms") or 0
            if ts >= g.xid_last_ts:
                g.xid_last, g.xid_last_ts = code, ts
            g.xid_partition = partition
            g.xid_seen_s = now_s
            if self._want_xid_win:
                if g.xid_win is None:
                    g.xid_win = derived.WindowCounts(r.options.xid_window_ms)
                if g.xid_win.push(ts, (code,), int(now_s * 1000)):
                    self._windowed.add(key)
            if g.pending is not None:
                pass  # sampled since its last render: rendered at the next scrape, with this XID
            elif g.hidden:
                g.lines = self._hidden_lines(g)
                self._rerender_children(key)
            else:
                lines = g.lines.copy()  # a scrape may hold the old list: replace, never mutate
                r.render_xid(g.view, g.xid_last, g.xid_counts, lines)
                if self._want_exp:
                    self._fill_exp(g, lines, sampled=g.ts_ms is not None)
                g.lines = lines
            self._xid_results["counted"] += 1
            self._version += 1
        return True

    # -- removal ---------------------------------------------------------------------------------
    def drop_partitions(self, partitions: Iterable[Any]) -> int:
        """Forget what came from these (revoked) partitions; returns the GPU keys removed."""
        ps = set(partitions)
        removed = 0
        with self._lock:
            for key, g in list(self._gpus.items()):
                sample_gone = g.ts_ms is not None and g.partition in ps
                xid_gone = bool(g.xid_counts) and g.xid_partition in ps
                if not (sample_gone or xid_gone):
                    continue
                if xid_gone:
                    g.xid_counts = {}
                    g.xid_last, g.xid_last_ts, g.xid_partition = None, -1, None
                if xid_gone:
                    g.xid_win = None
                if sample_gone:
                    self._dirty.discard(key)
                    g.pending = None
                    g.ts_ms, g.ident, g.partition, g.rec, g.health = None, None, None, None, None
                    g.host = None
                    g.prev = None
                    g.clock_win, g.clock_totals, g.clock_prev, g.hidden = None, {}, 0, False
                if g.ts_ms is None and not g.xid_counts:
                    del self._gpus[key]
                    self._xid_only.pop(key, None)
                    self._forget_bus(g)
                    removed += 1
                elif g.ts_ms is None:  # XIDs stay: counters without the pod labels of a sample
                    g.view = self.renderer.base_view(g.view)
                    g.lines = self.renderer.render_xid_only(g.view, g.xid_last, g.xid_counts)
                    if self._want_exp:
                        self._fill_exp(g, g.lines, sampled=False)
                elif g.pending is not None:
                    pass  # rendered at the next scrape
                elif g.hidden:
                    g.lines = self._hidden_lines(g)
                else:  # the sample stays; its next sample shows its own last_xid again
                    g.lines = g.lines.copy()
                    self.renderer.render_xid(g.view, g.xid_last, g.xid_counts, g.lines)
                    if self._want_exp:
                        self._fill_exp(g, g.lines, sampled=True)
                self._version += 1
            self._prune_nodes()
        return removed

    def expire(self, now_s: float) -> int:
        """Remove GPUs not seen within their staleness limit; returns how many."""
        with self._lock:
            return self._expire_locked(now_s)

    def _expire_locked(self, now_s: float) -> int:
        gone = []
        xid_ttl = self._xid_only_stale_after_s
        progress = self._active_s
        for key, g in self._gpus.items():
            if g.ts_ms is not None:
                if progress - g.seen_s > g.stale_s:
                    gone.append(key)
            elif now_s - g.xid_seen_s > xid_ttl:
                gone.append(key)
        kept = self._expired_views
        for key in gone:
            self._xid_only.pop(key, None)
            g = self._gpus.pop(key)
            if g.ident is not None and g.view is not None:
                kept[key] = (g.ident, g.view, now_s)
            self._forget_bus(g)
        # a view is some 10 KB (a label head per family): keep them for a lag episode, not forever
        while kept and (
            len(kept) > self._max_expired_views
            or now_s - next(iter(kept.values()))[2] > self._expired_view_ttl_s
        ):
            del kept[next(iter(kept))]
        if gone:
            self._expired += len(gone)
            self._version += 1
            self._prune_nodes()
        return len(gone)

    def _displace_xid_only(self) -> bool:
        """At the cap: remove the longest-held GPU known only from XIDs (not a MIG parent), so that a
        sampled GPU takes its place; False when there is none."""
        while self._xid_only:
            key = next(iter(self._xid_only))
            del self._xid_only[key]
            g = self._gpus.get(key)
            if g is None or g.ts_ms is not None or key in self._children:
                continue  # expired or sampled since
            del self._gpus[key]
            self._forget_bus(g)
            self._windowed.discard(key)
            self._expired += 1
            self._version += 1
            return True
        return False

    def _prune_nodes(self) -> None:
        """Forget the nodes none of whose GPUs is held any more (their freshness gauge goes)."""
        live = {g.host for g in self._gpus.values() if g.host is not None}
        for host in [h for h in self._nodes if h not in live]:
            del self._nodes[host]

    def _forget_bus(self, g: _Gpu) -> None:
        """Drop the (node, bus id) entry of a removed whole GPU, so the map stays as small as the store."""
        if g.bus is not None and self._by_bus.get(g.bus) == g.key:
            del self._by_bus[g.bus]

    def _drop(self, kind: str, key: str, now_s: float) -> None:
        """Count a GPU key refused at the cap; warn at most once per ``drop_log_interval_s``."""
        self._dropped[kind] += 1
        total = sum(self._dropped.values())
        if now_s - self._drop_logged_s >= self._drop_log_interval_s:
            log.warning(
                "metrics: %d GPU keys held, the most --max-gpus allows; %d new ones dropped since the "
                "last warning (latest %s from a %s), counted in gpupipe_metrics_gpus_dropped_total",
                len(self._gpus),
                total - self._drop_logged_n,
                key[:128],
                kind,
            )
            self._drop_logged_s, self._drop_logged_n = now_s, total

    def _slide_windows(self, now_ms: int) -> None:
        """XIDs leaving the window: re-render the window families of those GPUs only."""
        for key in list(self._windowed):
            g = self._gpus.get(key)
            if g is None or g.xid_win is None:
                self._windowed.discard(key)
                continue
            if g.xid_win.prune(now_ms):
                if g.hidden:
                    g.lines = self._hidden_lines(g)
                for k in (key, *self._children.get(key, ())):  # a MIG GPU's window is its instances' too
                    c = self._gpus.get(k)
                    if c is not None and not c.hidden and c.view is not None and c.lines:
                        lines = c.lines.copy()
                        self._fill_exp(c, lines, sampled=c.ts_ms is not None)
                        c.lines = lines
                self._version += 1
            if not g.xid_win.events:
                self._windowed.discard(key)

    # -- inspection ------------------------------------------------------------------------------
    def gpu_count(self) -> int:
        """GPU keys held (GPUs, MIG slices, GPUs known only from XID events). No ``__len__`` on
        purpose: an empty store must not be falsy (``store or SeriesStore()`` would replace it)."""
        return len(self._gpus)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._gpus)

    def partition_of(self, key: str) -> Any:
        with self._lock:
            g = self._gpus.get(key)
            return None if g is None else g.partition

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "gpus": len(self._gpus),
                "expired": self._expired,
                "dropped": dict(self._dropped),
                "invalid": dict(self._invalid),
                "xid_events": dict(self._xid_results),
            }

    # -- scrape ----------------------------------------------------------------------------------
    def render(self, now_s: float | None = None) -> bytes:
        """The whole exposition (text format 0.0.4), in one copy."""
        chunks, tail = self._scrape(now_s)
        return b"".join((*chunks, tail))

    def render_parts(self, now_s: float | None = None) -> list[bytes]:
        """The exposition in parts: the GPUs' families, one chunk per family (the same objects
        while nothing changed, so a gzip of them can be reused), then, last, the store's and the
        registry's families. Per-family chunks, not one joined body: a scrape of 80 MB then holds
        the GIL for one family's join at a time (ingest runs between), and each chunk fits in
        memory the allocator reuses, where one 80 MB body was a fresh mapping to fault in at every
        scrape (the largest single cost of a scrape at 10k GPUs).

        Concurrent scrapes (an HA Prometheus pair, a slow client) share one build: a scrape that
        arrives while another is being built gets that one, as of at most one build earlier,
        instead of rendering and joining tens of MB again beside it."""
        if now_s is not None:  # an explicit clock (tests, tools): always its own build
            return self._render_parts(now_s)
        with self._flight:
            gen = self._built_gen
            if self._building:
                while self._building:
                    self._flight.wait()
                if self._built_gen != gen and self._built is not None:
                    return self._built
            while self._building:  # another waiter builds (the one we waited for failed)
                self._flight.wait()
            self._building = True
        parts: list[bytes] | None = None
        try:
            parts = self._render_parts(None)
            return parts
        finally:
            with self._flight:
                self._building = False
                self._built = parts
                self._built_gen += 1
                self._flight.notify_all()

    def _render_parts(self, now_s: float | None) -> list[bytes]:
        chunks, tail = self._scrape(now_s)
        return [*chunks, tail]

    def _scrape(self, now_s: float | None) -> tuple[tuple[bytes, ...], bytes]:
        now = time.time() if now_s is None else now_s
        self._flush_in_chunks()
        with self._lock:
            self._expire_locked(now)
            if self._windowed:
                self._slide_windows(int(now * 1000))
            # a GPU first sampled after this scrape began has no lines yet: in the next scrape
            gpus = [g for g in self._gpus.values() if g.lines]
            # samples taken during this scrape are not all rendered: then no later scrape may reuse
            # this body, even if nothing else changes before it
            version = self._version if not self._dirty else -2
            body = self._body if self._body_version == version else None
            lines = None if body is not None else [g.lines for g in gpus]
            stats = (len(gpus), sorted(self._invalid.items()), list(self._xid_results.items()), self._expired)
            ages = [(g.view.age_head, g.ts_ms) for g in gpus if g.ts_ms is not None]
            nodes = sorted(self._nodes.items())
            progress = self._progress_s if ages else None
            dropped = list(self._dropped.items())
        tail = own_text(
            now,
            ages,
            *stats,
            self._unsupported_text,
            nodes=nodes,
            node_label=self._node_label,
            progress_s=progress,
            dropped=dropped,
        )
        if self._registry is not None:
            tail += registry_text(self._registry, self._own_names).encode("utf-8")
        if body is None:
            body = self._joiner.join(lines or [])
            with self._lock:
                if self._body_version < version:
                    self._body, self._body_version = body, version
        return body, tail

    def _flush_in_chunks(self) -> None:
        """Render the GPUs sampled before this scrape began, a chunk per lock hold, so ingest (which
        takes the same lock per batch) waits for one chunk, not for all of them. Samples that
        arrive meanwhile are the next scrape's: before, they were rendered under the scrape's final
        hold, and at 20k GPUs/s that was thousands of GPUs (hundreds of ms) with ingest blocked."""
        chunk = self._flush_chunk
        with self._lock:
            todo, self._dirty = list(self._dirty), set()
        for i in range(0, len(todo), chunk):
            if i:
                time.sleep(0)  # let a waiting ingest thread take the lock (and the GIL)
            with self._lock:
                self._flush(todo[i : i + chunk])
            gcpolicy.after_chunk()  # the process's GC policy: no young collection walks the scrape


def _complete(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record with every GpuSample field (missing metric fields null); identity fields required."""
    missing = [f for f in _IDENTITY_FIELDS if f not in record]
    if missing:
        raise UnusableSample(f"GpuSample record lacks {', '.join(missing)}")
    from gpupipe_consumers.metrics.fields import FIELDS

    full: dict[str, Any] = dict.fromkeys((f.source for f in FIELDS if f.source), None)
    full.update(
        mig=None,
        mig_enabled=None,
        gpu_lost=False,
        driver_version=None,
        allocations=[],
        processes=[],
        interval_ms=None,
        last_xid=None,
    )
    full.update(record)
    return full
