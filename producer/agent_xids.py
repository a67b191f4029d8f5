"""The node agent's XID path: from a reader thread's queue item to a spooled XidEvent record.

Split out of :mod:`producer.node_agent` (which is about threads and lifecycle). Everything here
runs on the agent's main loop, except :meth:`XidPath._on_nvml_event` (the event watcher's threads)
and :meth:`XidPath._on_gpu_lost` (the polling thread), which only put into the queue. The main loop
never calls NVML, so a hung GPU cannot delay an XID (review finding 1.6).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpupipe.logs import fields
from producer.lost_reported import LostReported
from producer.nvml.records import LostGpu, gpu_lost_xid_event
from producer.xid.kmsg_cursor import read_boot_id
from producer.xid.kmsg_parse import DriverLoaded, FallenOffBus, KernelXid
from producer.xid_events import (
    XidContext,
    build_xid_event,
    driver_loaded_event,
    fallen_off_bus_event,
    kmsg_fields,
    nvml_fields,
    nvml_notice_event,
)
from schemas.errors import EncodeError

if TYPE_CHECKING:
    from producer.agent_config import AgentConfig
    from producer.delivery import XidSender
    from producer.kubelet.mapping import AllocationMap
    from producer.nvml.source import NvmlSource
    from producer.self_metrics import ProducerMetrics
    from producer.xid.kmsg_cursor import KmsgCursorStore
    from producer.xid.xid_merge import XidMerger

log = logging.getLogger("gpupipe.agent")

#: Events spooled and sent in one batch at most (one fsync each batch).
MAX_BATCH = 1000
#: One WARNING line per (kind, GPU, code) at most this often; the others are counted in it.
LOG_EVERY_S = 10.0


class XidPath:
    """Mixed into :class:`producer.node_agent.NodeAgent`, which provides the attributes below."""

    if TYPE_CHECKING:
        config: AgentConfig
        metrics: ProducerMetrics
        source: NvmlSource | None
        sender: XidSender | None
        merger: XidMerger
        cursor: KmsgCursorStore | None
        xid_merged: int
        encode_errors: int
        xids_sent: int
        boot_id: str | None
        _events: queue.SimpleQueue[tuple[str, float, int, Any, int | None]]
        _slices: dict[str, list[str]]
        _tick_amap: AllocationMap
        _lost_reported: LostReported | None
        _enc_xid: Any
        _xid_log: dict[tuple[Any, ...], list[Any]]
        _nvml_seq: Iterator[int]

        @property
        def allocations(self) -> AllocationMap: ...

    def _on_nvml_event(self, event: dict[str, Any]) -> None:  # watcher threads
        kind = "notice" if event.get("type") in ("recovery_action", "gpu_unavailable") else "nvml"
        # Numbered here (next() on itertools.count is atomic): two NVML XIDs of one code on one GPU in
        # the same millisecond must not share an event_id (review §2 records.py:80-81).
        event = {**event, "nvml_seq": next(self._nvml_seq)}
        self._events.put((kind, time.monotonic(), int(event["timestamp_ms"]), event, None))

    def _drain_events(self, timeout: float) -> None:
        """Handle what the reader threads queued; the events built are spooled and sent together
        (one fsync per batch: an XID storm costs per batch, not per event)."""
        try:
            item = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        batch = _Batch()
        while True:
            self._handle(item, batch)
            if len(batch.events) >= MAX_BATCH:
                self._flush(batch)
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                break
        self._flush(batch)

    def _handle(self, item: tuple[str, float, int, Any, int | None], batch: _Batch) -> None:
        kind, at, seen_ms, payload, seq = item
        if kind == "lost":
            event = self._lost_event(payload)
            if event is not None:
                batch.add(event)
            return
        if kind == "notice":
            batch.add(nvml_notice_event(payload, batch.context(self._context)))
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
        held = self.merger.held_field_min("kmsg_seq")
        if held is not None:
            seq = min(seq, held - 1)
        self.cursor.save(seq)

    def _context(self) -> XidContext:
        src = self.source
        assert src is not None
        return XidContext(
            self.config.hostname,
            src.bus_id_map(),
            self.allocations,
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
        ctx = batch.context(self._context)
        for m in merged:
            if m.get("source") == "nvml+kmsg":
                self.xid_merged += 1
            batch.add(build_xid_event(m, ctx), m.get("kmsg_seq"))

    def _flush(self, batch: _Batch) -> None:
        """Encode, spool (one write and fsync), send; then count, log and advance the cursor once,
        past the newest kernel-log record now spooled."""
        if not batch.events:
            return
        items: list[tuple[bytes, bytes]] = []
        sent: list[dict[str, Any]] = []
        for event in batch.events:
            # The boot the event belongs to: a later boot id on the same host tells the alerts the
            # node rebooted in between (evidence of recovery for faults that need a reboot).
            event.setdefault("boot_id", self.boot_id)
            if self.config.extras is not None:
                self.config.extras.decorate(event)
            try:
                value = self._enc_xid(event)
            except EncodeError as exc:
                self.encode_errors += 1
                log.error("XID event could not be encoded: %s", exc, extra=fields(event=repr(event)[:500]))
                continue
            # node-wide events (no GPU: driver_loaded) are keyed by their host
            ident = event["mig_uuid"] or event["uuid"] or event["pci_bus_id"] or event["hostname"]
            key = (ident or "unknown").encode()
            items.append((key, value))
            sent.append(event)
        assert self.sender is not None
        if items:
            self.sender.send_many(items)
        for event in sent:
            self.xids_sent += 1
            self.metrics.xid_events.labels(event["kind"]).inc()
            if event["kind"] == "xid" and event["gpu_index"] is not None and self.source is not None:
                self.source.record_xid(event["gpu_index"], event["xid"], event["gpu_instance_id"])
            self._log_event(event)
        seqs = [q for q in batch.seqs if q is not None]
        batch.clear()
        if seqs:
            self._advance_cursor(max(seqs))

    def _log_event(self, event: dict[str, Any]) -> None:
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
        now = time.monotonic()
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

    def _on_gpu_lost(self, lost: LostGpu) -> None:  # nvml-poll thread (NvmlSource.poll)
        self._events.put(("lost", time.monotonic(), lost.timestamp_ms, lost, None))

    def _lost_event(self, lost: LostGpu) -> dict[str, Any] | None:  # main loop
        if self._lost_reported is None:
            self._lost_reported = LostReported(self.config.spool_dir, read_boot_id(self.config.boot_id_path))
        if not self._lost_reported.should_report(lost):
            log.info("GPU lost at start was reported earlier this boot", extra=fields(uuid=lost.gpu.uuid))
            return None
        self._lost_reported.record(lost)
        event = gpu_lost_xid_event(lost, self.config.hostname)
        ctx = XidContext(self.config.hostname, {}, self._tick_amap, slices=self._slices)
        event["allocations"] = ctx.allocations(event["uuid"], None, lost.gpu)
        return event


class _Batch:
    """Events built during one pass of the main loop, spooled and sent together."""

    __slots__ = ("_ctx", "events", "seqs")

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.seqs: list[int | None] = []  # the kernel-log record of each event, if any
        self._ctx: XidContext | None = None

    def add(self, event: dict[str, Any], seq: int | None = None) -> None:
        self.events.append(event)
        self.seqs.append(seq)

    def context(self, make: Any) -> XidContext:
        """One attribution context per batch (the kubelet map and slices as of this pass)."""
        if self._ctx is None:
            self._ctx = make()
        return self._ctx

    def clear(self) -> None:
        self.events.clear()
        self.seqs.clear()
