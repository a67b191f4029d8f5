"""The node agent's XID path: from a reader thread's queue item to a spooled XidEvent record.

Reader threads put into :class:`XidInbox`; the main loop drains it through :class:`XidPath` (merge,
build, spool and send, advance the kernel-log cursor). It never calls NVML: it reads the source's
snapshots.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from gpupipe.common.logs import fields
from gpupipe_producer.kubelet.mapping import AllocationMap
from gpupipe_producer.nvml.records import LostGpu, gpu_lost_xid_event
from gpupipe_producer.nvml.source import NvmlSource
from gpupipe_producer.podmeta.extras import AllocationExtras
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.xid.events import (
    XidContext,
    build_xid_event,
    driver_loaded_event,
    fallen_off_bus_event,
    kmsg_fields,
    nvml_fields,
    nvml_notice_event,
)
from gpupipe_producer.xid.kmsg_cursor import KmsgCursorStore, read_boot_id
from gpupipe_producer.xid.kmsg_parse import DriverLoaded, FallenOffBus, KernelXid
from gpupipe_producer.xid.lost_reported import LostReported
from gpupipe_producer.xid.operational_merge import Incident, OperationalMerger, window_for
from gpupipe_producer.xid.operational_record import operational_xid_event
from gpupipe_producer.xid.sender import XidSender
from gpupipe_producer.xid.xid_merge import XidMerger
from gpupipe_schemas.errors import EncodeError
from gpupipe_schemas.meaning import xid_kafka_key
from gpupipe_schemas.records import XidEvent

log = logging.getLogger("gpupipe.agent")

#: Events spooled and sent in one batch at most (one fsync each batch).
MAX_BATCH = 1000
#: One WARNING line per (kind, GPU, code) at most this often; the others are counted in it.
LOG_EVERY_S = 10.0

#: (kind, monotonic arrival, wall ms, payload, kernel-log seq or None); kind is ``kmsg``, ``nvml``,
#: ``notice`` or ``lost``.
InboxItem = tuple[str, float, int, Any, int | None]


class XidSettings(Protocol):
    """What the XID path reads of the agent's configuration (an ``AgentConfig`` has all of it)."""

    hostname: str
    nvml_events: bool
    kmsg_path: str | None
    xid_merge_window_s: float
    spool_dir: str
    boot_id_path: str
    extras: AllocationExtras | None


class XidInbox:
    """The queue every XID source puts into and the main loop drains.

    It exists before NVML is started: a GPU found lost while the source opens it is queued here.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # queue.Queue, not SimpleQueue: the main loop blocks here, and CPython 3.11's SimpleQueue.get
        # with a timeout can block for ever once a signal (the SIGTERM that stops the agent) lands
        # during the wait (tests/unit/producer/xid/test_inbox.py).
        self._q: queue.Queue[InboxItem] = queue.Queue()
        self._clock = clock
        self._nvml_seq = itertools.count(1)  # numbers NVML events (their event_id suffix)

    def put(self, item: InboxItem) -> None:
        """The kernel-log reader's way in (it builds the item)."""
        self._q.put(item)

    def nvml_event(self, event: dict[str, Any]) -> None:  # watcher threads
        kind = "notice" if event.get("type") in ("recovery_action", "gpu_unavailable") else "nvml"
        if event.get("type") == "operational":
            kind = "operational"
        # Numbered here (next() on itertools.count is atomic): two NVML XIDs of one code on one GPU
        # in the same millisecond must not share an event_id.
        event = {**event, "nvml_seq": next(self._nvml_seq)}
        self._q.put((kind, self._clock(), int(event["timestamp_ms"]), event, None))

    def gpu_lost(self, lost: LostGpu) -> None:  # nvml-poll thread (NvmlSource.poll), or its start
        self._q.put(("lost", self._clock(), lost.timestamp_ms, lost, None))

    def get(self, timeout: float) -> InboxItem | None:
        """The next item, waiting up to ``timeout`` (0: not at all); None when there is none."""
        try:
            return self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None


class XidPath:
    """The main loop's XID work: merge, build, spool and send, count, log, advance the cursor.

    Built at the agent's start, once the source is started and the spool opened. Everything here
    runs on the main loop except :meth:`poll_began` and :meth:`poll_ended` (the polling thread,
    single assignments).
    """

    def __init__(
        self,
        config: XidSettings,
        metrics: ProducerMetrics,
        inbox: XidInbox,
        source: NvmlSource,
        sender: XidSender,
        encode: Callable[[XidEvent], bytes],
        *,
        cursor: KmsgCursorStore | None,
        allocations: Callable[[], AllocationMap],
        boot_id: str | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.inbox = inbox
        self.source = source
        self.sender = sender
        self.cursor = cursor
        self._encode = encode
        self._allocations = allocations
        self.boot_id = boot_id
        self._clock = clock
        # Pairing only makes sense with both sources on; with one, holding an XID for the window
        # would only add latency to the alert.
        both = config.nvml_events and config.kmsg_path is not None
        self.merger = XidMerger(config.xid_merge_window_s if both else 0.0)
        # Then a legacy Xid and the operational event of the same incident become one record; which
        # GPUs registered for operational events is set by the agent once its watcher runs.
        self.goe = OperationalMerger(window_for(self.merger.window_s))
        self.xid_merged = 0
        self.encode_errors = 0
        self.sent = 0
        # What the newest poll saw: MIG slices per GPU, and the kubelet map it began with.
        self._slices: dict[str, list[str]] = {}
        self._poll_amap = AllocationMap.empty()
        self._lost_reported: LostReported | None = None
        self._xid_log: dict[tuple[Any, ...], list[Any]] = {}  # (kind, gpu, code) -> [last line, held]

    # -- fed by the polling thread --------------------------------------------------------------
    def poll_began(self, amap: AllocationMap) -> None:
        self._poll_amap = amap

    def poll_ended(self, slices: dict[str, list[str]]) -> None:
        self._slices = slices

    # -- the main loop --------------------------------------------------------------------------
    def holding(self) -> bool:
        """True while the merger holds a sighting waiting for its pair."""
        return len(self.merger) > 0 or len(self.goe) > 0

    def expire(self) -> None:
        """Send what the merger held past its window."""
        now = self._clock()
        self._emit_all(self.merger.expire(now))
        self._emit_incidents(self.goe.expire(now))

    def flush_held(self) -> None:
        """Send everything the merger holds (shutdown)."""
        self._emit_all(self.merger.flush(self._clock()))
        self._emit_incidents(self.goe.flush())

    def drain(self, timeout: float) -> None:
        """Handle what the reader threads queued; the events built are spooled and sent together
        (one fsync per batch: an XID storm costs per batch, not per event)."""
        item = self.inbox.get(timeout)
        batch = _Batch()
        while item is not None:
            self._handle(item, batch)
            if len(batch.events) >= MAX_BATCH:
                self._flush(batch)
            item = self.inbox.get(0.0)
        self._flush(batch)

    def _handle(self, item: InboxItem, batch: _Batch) -> None:
        kind, at, seen_ms, payload, seq = item
        if kind == "lost":
            event = self._lost_event(payload)
            if event is not None:
                batch.add(event)
            return
        if kind == "notice":
            batch.add(nvml_notice_event(payload, batch.context(self._context)))
            return
        if kind == "operational":
            if payload.get("gpu_instance_id") is not None and payload.get("uuid") not in self._slices:
                payload = {**payload, "gpu_instance_id": None, "compute_instance_id": None}
            self._add_incidents(self.goe.operational(payload, at), batch)
            return
        if kind == "nvml":
            if payload.get("gpu_instance_id") is not None and payload.get("uuid") not in self._slices:
                # GI/CI only mean something on a GPU in MIG mode (NVIDIA's mock reports 0/0 on
                # every GPU): never attribute an XID to "instance 0" of a whole GPU.
                payload = {**payload, "gpu_instance_id": None, "compute_instance_id": None, "mig_uuid": None}
            released = self.merger.add(
                "nvml", payload.get("pci_bus_id") or "", payload["xid"], at, nvml_fields(payload)
            )
        elif isinstance(payload, FallenOffBus):
            batch.add(fallen_off_bus_event(payload, seen_ms, batch.context(self._context)), seq)
            return
        elif isinstance(payload, DriverLoaded):
            batch.add(driver_loaded_event(payload, seen_ms, batch.context(self._context), seq), seq)
            return
        else:
            ev: KernelXid = payload
            f = kmsg_fields(ev, seen_ms)
            f["kmsg_seq"] = seq
            released = self.merger.add("kmsg", ev.pci_bus_id, ev.xid, at, f)
        self._add_released(released, batch)

    def _advance_cursor(self, seq: int | None) -> None:
        """Persist the kernel-log cursor past ``seq`` (its event is spooled), but never past a
        kernel-log sighting the merger still holds (it is not spooled yet)."""
        if seq is None or self.cursor is None:
            return
        holds = (self.merger.held_field_min("kmsg_seq"), self.goe.held_field_min("kmsg_seq"))
        held = min((h for h in holds if h is not None), default=None)
        if held is not None:
            seq = min(seq, held - 1)
        self.cursor.save(seq)

    def _context(self) -> XidContext:
        src = self.source
        return XidContext(
            self.config.hostname,
            src.bus_id_map(),
            self._allocations(),
            slices=self._slices,
            mig_lookup=src.mig_uuid_for,
            ids=src.device_ids(),
        )

    def _emit_all(self, merged: list[dict[str, Any]]) -> None:
        """Spool and send what the merger released (expired or flushed), as one batch."""
        batch = _Batch()
        self._add_released(merged, batch)
        self._flush(batch)

    def _add_released(self, merged: list[dict[str, Any]], batch: _Batch) -> None:
        if not merged:
            return
        for m in merged:
            if m.get("source") == "nvml+kmsg":
                self.xid_merged += 1
            self._add_incidents(self.goe.legacy(m, m.get("first_seen_s") or self._clock()), batch)

    def _emit_incidents(self, incidents: list[Incident]) -> None:
        batch = _Batch()
        self._add_incidents(incidents, batch)
        self._flush(batch)

    def _add_incidents(self, incidents: list[Incident], batch: _Batch) -> None:
        for inc in incidents:
            legacy = inc.legacy or {}
            if inc.operational is None:
                batch.add(build_xid_event(legacy, batch.context(self._context)), legacy.get("kmsg_seq"))
            else:
                batch.add(operational_xid_event(inc, batch.context(self._context)), legacy.get("kmsg_seq"))

    def _flush(self, batch: _Batch) -> None:
        """Encode, spool (one write and fsync), send; then count, log and advance the cursor once,
        past the newest kernel-log record now spooled."""
        if not batch.events:
            return
        items: list[tuple[bytes, bytes]] = []
        sent: list[XidEvent] = []
        for event in batch.events:
            # The boot the event belongs to: a later boot id on the same host tells the alerts the
            # node rebooted in between (evidence of recovery for faults that need a reboot).
            event.setdefault("boot_id", self.boot_id)
            if self.config.extras is not None:
                self.config.extras.decorate(cast(dict[str, Any], event))  # fills its allocations
            try:
                value = self._encode(event)
            except EncodeError as exc:
                self.encode_errors += 1
                log.error("XID event could not be encoded: %s", exc, extra=fields(event=repr(event)[:500]))
                continue
            items.append((xid_kafka_key(event), value))
            sent.append(event)
        if items:
            self.sender.send_many(items)
        for event in sent:
            self.sent += 1
            self.metrics.xid_events.labels(event["kind"]).inc()
            if event["kind"] == "xid" and event["gpu_index"] is not None and event["xid"] is not None:
                self.source.record_xid(event["gpu_index"], event["xid"], event["gpu_instance_id"])
            self._log_event(event)
        seqs = [q for q in batch.seqs if q is not None]
        batch.clear()
        if seqs:
            self._advance_cursor(max(seqs))

    def _log_event(self, event: XidEvent) -> None:
        """One WARNING per event, but at most one per (kind, GPU, code) every LOG_EVERY_S: a storm of
        thousands of Xid 13 is one line now and one line with the count every 10 s (every event is
        still published and counted in gpupipe_producer_xid_events_total)."""
        if event["kind"] == "driver_loaded":  # a boot or a driver reload: no error
            log.info(
                "NVIDIA driver loaded",
                extra=fields(
                    kind=event["kind"], driver=event["driver_version"], message=event["message"][:200]
                ),
            )
            return
        key = (event["kind"], event["gpu_index"], event["xid"])
        now = self._clock()
        seen = self._xid_log.get(key)
        if seen is not None and now - seen[0] < LOG_EVERY_S:
            seen[1] += 1
            return
        held = seen[1] if seen is not None else 0
        if len(self._xid_log) >= 1024:
            self._xid_log.clear()
        self._xid_log[key] = [now, 0]
        log.warning(
            "GPU error event" if not held else f"GPU error event ({held} more like it since the last line)",
            extra=fields(
                kind=event["kind"],
                xid=event["xid"],
                gpu=event["gpu_index"],
                uuid=event["uuid"],
                pci_bus_id=event["pci_bus_id"],
                source=event["source"],
                pid=event["pid"],
                process=event["process_name"],
                message=event["message"][:200],
                pods=[f"{a['namespace']}/{a['pod']}" for a in event["allocations"]],
            ),
        )

    def _lost_event(self, lost: LostGpu) -> XidEvent | None:  # main loop
        if self._lost_reported is None:
            self._lost_reported = LostReported(self.config.spool_dir, read_boot_id(self.config.boot_id_path))
        if not self._lost_reported.should_report(lost):
            log.info("GPU lost at start was reported earlier this boot", extra=fields(uuid=lost.gpu.uuid))
            return None
        self._lost_reported.record(lost)
        event = gpu_lost_xid_event(lost, self.config.hostname)
        ctx = XidContext(self.config.hostname, {}, self._poll_amap, slices=self._slices)
        event["allocations"] = ctx.allocations(event["uuid"], None, lost.gpu)
        return event


class _Batch:
    """Events built during one pass of the main loop, spooled and sent together."""

    __slots__ = ("_ctx", "events", "seqs")

    def __init__(self) -> None:
        self.events: list[XidEvent] = []
        self.seqs: list[int | None] = []  # the kernel-log record of each event, if any
        self._ctx: XidContext | None = None

    def add(self, event: XidEvent, seq: int | None = None) -> None:
        self.events.append(event)
        self.seqs.append(seq)

    def context(self, make: Callable[[], XidContext]) -> XidContext:
        """One attribution context per batch (the kubelet map and slices as of this pass)."""
        if self._ctx is None:
            self._ctx = make()
        return self._ctx

    def clear(self) -> None:
        self.events.clear()
        self.seqs.clear()
