"""NVML GPU Operational Events watcher (driver R615+ preview): one event set and thread per GPU.

The threads, back-off, rebuild, drain and stop of :class:`~gpupipe_producer.nvml.events.XidEventWatcher`
(see its docstring), with a different set-up, wait and delivery:

* **set-up**: ``nvmlEventSetRegisterGpuOperationalEvents_v1(set, c_nvmlGpuOperationalEventConfig_v1_t(
  uuid=<the GPU>, minLogLevel, minSeverity))``. Feature detection, never a crash: a binding without the
  call (nvidia-ml-py before 13.615), ``NVMLError_FunctionNotFound`` (a driver before R615: the library
  lacks the symbol) or ``NVMLError_NotSupported`` (a GPU older than Turing, or not Linux) make the GPU
  *unsupported*: its thread ends, ``on_support(gpu, reason)`` says why (``supported`` once it registers),
  and the first such GPU is logged once for the node (the others at DEBUG); when no GPU of the node
  registers, ``start()`` stops the watcher again and gives NVML back;
* **wait**: ``nvmlEventSetWait_v3(set, c_nvmlEventSetWait_v3_t(timeoutMs=...))``, which fills the
  structure; a record whose ``dataType`` is not ``NVML_EVENT_DATA_TYPE_GPU_OPERATIONAL_EVENT`` is ignored;
* **attribution**: by the UUID the record names (NVML's "device UUID and attribution"), never by the set
  that delivered it, counted ``own_set`` / ``other_set`` / ``unresolved`` as legacy events are;
* **contexts**: read right after the wait on the same thread (NVML keeps the last event's contexts per
  set): count, info, then the legacy Xid of a legacy-Xid context, or the raw bytes (at most
  ``MAX_CONTEXT_BYTES``) of a type not decoded here; a context NVML refuses is skipped.

Each event is handed over as ``{"type": "operational", "uuid", "pci_bus_id", "gpu_index",
"gpu_instance_id", "compute_instance_id", "legacy_xid", "set_gpu_index", "timestamp_ms",
"operational": <the XidEvent.operational record>}``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

from gpupipe.domain.pci import canonical
from gpupipe_producer.nvml.events import NO_INSTANCE, XidEventWatcher, _Channel, _Gpu
from gpupipe_producer.nvml.identity import text
from gpupipe_schemas.operational_events import category_name

log = logging.getLogger("gpupipe.nvml.operational")

REGISTER = "nvmlEventSetRegisterGpuOperationalEvents_v1"
WAIT = "nvmlEventSetWait_v3"
#: NVML_EVENT_DATA_TYPE_GPU_OPERATIONAL_EVENT
OPERATIONAL_DATA = 1
#: NVML_GPU_OPERATIONAL_EVENT_CONTEXT_TYPE_LEGACY_XID
CONTEXT_LEGACY_XID = 1
MAX_CONTEXTS = 32
MAX_CONTEXT_BYTES = 4096

SupportHook = Callable[[int, str], None]


def _opt(value: Any) -> int | None:
    v = int(value)
    return None if v == NO_INSTANCE else v


def operational_record(data: Any, contexts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``XidEvent.operational`` record of one filled ``c_nvmlEventSetWait_v3_t``."""
    legacy = next((c["legacy_xid"] for c in contexts if c["legacy_xid"] is not None), None)
    return {
        "module_signature": text(data.sourceModule),
        "module_event_code": int(data.moduleEventCode),
        "category_id": int(data.categoryId),
        "category": category_name(data.categoryId),
        "severity": int(data.severity),
        "log_level": int(data.logLevel),
        "scope": int(data.scope),
        "originator": int(data.originator),
        "attributes": int(data.attributes),
        "module_instance": int(data.moduleInstance),
        "chiplet_id": int(data.chipletId),
        "trace_id": _signed64(data.traceId),
        "instance_id": _signed64(data.instanceId),
        "group_cursor": _signed64(data.groupCursor),
        "group_size": int(data.groupSize),
        "group_index": int(data.groupIndex),
        "group_attributes": int(data.groupAttributes),
        "driver_timestamp_us": _signed64(data.timestampUsec),
        "legacy_xid": legacy,
        "legacy_sources": [],
        "contexts": contexts,
    }


def _signed64(value: Any) -> int:
    """An unsigned 64-bit NVML value as Avro's signed long (same bits)."""
    v = int(value) & 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


class OperationalEventWatcher(XidEventWatcher):
    """Watches GPU Operational Events on every GPU of the node (see the module docstring)."""

    def __init__(
        self,
        nvml: Any,
        on_event: Callable[[dict[str, Any]], None],
        *,
        on_support: SupportHook | None = None,
        min_log_level: int = 0,
        min_severity: int = 0,
        **kw: Any,
    ) -> None:
        kw.setdefault("thread_name", "nvml-operational-events")
        super().__init__(nvml, on_event, **kw)
        self._on_support = on_support
        self._min_log_level = int(min_log_level)
        self._min_severity = int(min_severity)
        self._by_uuid: dict[str, _Gpu] = {}
        self._buses: frozenset[str] = frozenset()  # bus ids of the GPUs registered now
        self._logged_unsupported = False
        #: GPU index -> ``supported`` or why not (``binding``, ``FunctionNotFound``, ``NotSupported``).
        self.support: dict[int, str] = {}

    def start(self) -> None:
        """Start as the legacy watcher does; on a node where no GPU offers operational events (an older
        driver: said once in the log), stop again at once so no NVML reference is held for nothing."""
        super().start()
        cur = self._current
        if cur is not None and cur.channels and all(c.unsupported for c in cur.channels):
            self.stop()

    def registered_bus(self, bus_id: str) -> bool:
        """Whether the GPU at ``bus_id`` (canonical form) is registered for operational events now."""
        return bus_id in self._buses

    # -- set-up ---------------------------------------------------------------------------------
    def _build(self, ch: _Channel, first: bool) -> str:
        nvml = self._nvml
        register = getattr(nvml, REGISTER, None)
        config_type = getattr(nvml, "c_nvmlGpuOperationalEventConfig_v1_t", None)
        if register is None or config_type is None or getattr(nvml, WAIT, None) is None:
            return self._unsupported(ch, "binding", f"the NVML binding has no {REGISTER}")
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(ch.index)
            ch.uuid = text(nvml.nvmlDeviceGetUUID(h))
            ch.bus = text(nvml.nvmlDeviceGetPciInfo(h).busId)
            ch.mig = self._mig_mode(h, False)
            with self._lock:
                self._by_uuid[ch.uuid] = _Gpu(ch.index, ch.uuid, ch.bus, ch.mig)
            es = nvml.nvmlEventSetCreate()
            try:
                register(es, config_type(ch.uuid, self._min_log_level, self._min_severity))
            except BaseException:
                self._free_set(es)
                raise
        except nvml.NVMLError_FunctionNotFound:
            return self._unsupported(ch, "FunctionNotFound", "the driver predates R615")
        except nvml.NVMLError_NotSupported:
            return self._unsupported(ch, "NotSupported", "NVML does not support them on this GPU")
        except Exception as exc:  # NVML errors and anything a broken binding raises: retried
            self._failed(ch, exc, "cannot register GPU operational events")
            return "failed"
        ch.set = es
        ch.unsupported = False
        self._set_support(ch, "supported")
        return "ok"

    def _unsupported(self, ch: _Channel, reason: str, why: str) -> str:
        ch.unsupported = True
        self._set_support(ch, reason)
        with self._lock:
            first, self._logged_unsupported = not self._logged_unsupported, True
        (log.warning if first else log.debug)(
            "GPU operational events unavailable (%s: %s, GPU %d); XIDs come from the legacy NVML events "
            "and the kernel log",
            reason,
            why,
            ch.index,
        )
        return "unsupported"

    def _set_support(self, ch: _Channel, state: str) -> None:
        with self._lock:
            self.support[ch.index] = state
            buses = set(self._buses)
            if state == "supported" and ch.bus:
                buses.add(_canonical(ch.bus))
            else:
                buses.discard(_canonical(ch.bus))
            self._buses = frozenset(buses)
        if self._on_support is not None:
            try:
                self._on_support(ch.index, state)
            except Exception as exc:
                log.debug("on_support hook failed: %s", exc)

    def _free(self, ch: _Channel) -> None:
        if ch.set is not None and ch.bus:
            with self._lock:
                self._buses = self._buses - {_canonical(ch.bus)}
        super()._free(ch)

    # -- wait and delivery ------------------------------------------------------------------------
    def _wait(self, es: Any, timeout_ms: int) -> Any:
        params = self._nvml.c_nvmlEventSetWait_v3_t()
        params.timeoutMs = int(timeout_ms)
        self._nvml.nvmlEventSetWait_v3(es, params)
        return params

    def _deliver(self, ch: _Channel, data: Any) -> None:
        if int(data.dataType) != OPERATIONAL_DATA:
            return
        contexts = self._contexts(ch.set)
        uuid = text(data.uuid) or None
        gpu = self._gpu_of(ch, uuid)
        record = operational_record(data, contexts)
        gi = _opt(data.gpuInstanceId) if gpu.mig else None
        ci = _opt(data.computeInstanceId) if gi is not None else None
        self._hand_over(
            {
                "type": "operational",
                "uuid": gpu.uuid or uuid,
                "pci_bus_id": gpu.bus,
                "gpu_index": gpu.index,
                "gpu_instance_id": gi,
                "compute_instance_id": ci,
                "mig_uuid": None,
                "legacy_xid": record["legacy_xid"],
                "set_gpu_index": ch.index,
                "timestamp_ms": int(self._wall_clock() * 1000),
                "operational": record,
            }
        )

    def _gpu_of(self, ch: _Channel, uuid: str | None) -> _Gpu:
        """The GPU the record's UUID names, counted by how it compares with the delivering set."""
        with self._lock:
            gpu = self._by_uuid.get(uuid) if uuid else None
        if gpu is None and uuid:
            gpu = self._ask_by_uuid(uuid)
        if gpu is None:
            delivery = "unresolved"
            log.warning(
                "an NVML operational event came through GPU %d's set naming a GPU NVML cannot identify "
                "(%r): published without a GPU",
                ch.index,
                uuid,
            )
            gpu = _Gpu(None, uuid, "", False)
        else:
            delivery = "own_set" if gpu.index == ch.index else "other_set"
        with self._lock:
            self.delivery_counts[delivery] += 1
        if self._on_delivery is not None:
            try:
                self._on_delivery(delivery)
            except Exception as exc:
                log.debug("on_delivery hook failed: %s", exc)
        return gpu

    def _ask_by_uuid(self, uuid: str) -> _Gpu | None:
        nvml = self._nvml
        try:
            h = nvml.nvmlDeviceGetHandleByUUID(uuid)
            gpu = _Gpu(
                int(nvml.nvmlDeviceGetIndex(h)),
                uuid,
                text(nvml.nvmlDeviceGetPciInfo(h).busId),
                self._mig_mode(h, False),
            )
        except Exception as exc:  # a lost GPU answers nothing
            log.debug("cannot identify an operational event's GPU %s: %s", uuid, exc)
            return None
        with self._lock:
            self._by_uuid[uuid] = gpu
        return gpu

    def _contexts(self, es: Any) -> list[dict[str, Any]]:
        """The typed context payloads of the event the last wait on ``es`` returned."""
        nvml = self._nvml
        try:
            count = nvml.c_nvmlEventSetGetContextCount_v1_t()
            nvml.nvmlEventSetGetContextCount_v1(es, count)
        except Exception as exc:
            log.debug("operational event contexts unavailable: %s", exc)
            return []
        out: list[dict[str, Any]] = []
        for index in range(min(int(count.count), MAX_CONTEXTS)):
            try:
                out.append(self._context(es, index))
            except Exception as exc:
                log.debug("operational event context %d unreadable: %s", index, exc)
        return out

    def _context(self, es: Any, index: int) -> dict[str, Any]:
        nvml = self._nvml
        info = nvml.c_nvmlEventSetGetContextInfo_v1_t()
        info.index = index
        nvml.nvmlEventSetGetContextInfo_v1(es, info)
        ctype = int(info.nvmlGpuOperationalEventContextType)
        item: dict[str, Any] = {
            "context_type": ctype,
            "source_context_type": int(info.sourceEventContextType),
            "format_version": int(info.dataFormatVersion),
            "legacy_xid": None,
            "data": None,
        }
        if ctype == CONTEXT_LEGACY_XID:
            xid = nvml.c_nvmlEventSetGetGpuOperationalEventContextLegacyXid_v1_t()
            xid.index = index
            nvml.nvmlEventSetGetGpuOperationalEventContextLegacyXid_v1(es, xid)
            item["legacy_xid"] = int(xid.xidCode)
            return item
        size = int(info.dataSize)
        if 0 < size <= MAX_CONTEXT_BYTES:
            buf = ctypes.create_string_buffer(size)
            req = nvml.c_nvmlEventSetGetContextData_v1_t()
            req.data = ctypes.cast(buf, ctypes.c_void_p)
            req.index = index
            req.dataSize = size
            nvml.nvmlEventSetGetContextData_v1(es, req)
            item["data"] = buf.raw[:size]
        return item


def _canonical(bus: str) -> str:
    try:
        return canonical(bus)
    except ValueError:
        return bus.strip().lower()
