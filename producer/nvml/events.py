"""NVML XID event watcher: one thread waiting on one NVML event set.

``start()`` initialises NVML (reference-counted, so it can share the process with
``NvmlSource``), creates an event set and registers ``nvmlEventTypeXidCriticalError`` on every GPU
that supports it. A GPU answering NotSupported is logged and skipped; the set stays usable for the
others (NVML's documented behaviour). The thread then loops on
``nvmlEventSetWait_v2(set, timeout_ms)``:

* ``NVMLError_Timeout``: nothing happened, wait again (this is how ``stop()`` is noticed);
* an event: ``on_event(dict)`` with ``xid``, ``uuid``, ``pci_bus_id``, ``gpu_index``,
  ``gpu_instance_id`` / ``compute_instance_id`` (None when NVML says 0xFFFFFFFF, i.e. not
  attributable to a MIG instance), ``mig_uuid`` (when a lookup is given and knows it) and
  ``timestamp_ms`` (wall clock when received); events of other types are ignored;
* ``NVMLError_GpuIsLost`` or any other error: reported (``on_error(kind)``, ``error_counts``),
  then the thread backs off (1 s doubling to 30 s, interrupted by ``stop()``); after
  ``rebuild_after`` errors in a row the set is freed and built again, so a GPU that fell off the
  bus cannot wedge XID reporting for the others.

``stop()`` makes the thread leave within about one wait timeout, then frees the set (never while
a wait is in flight) and shuts NVML down. Turn delivered dicts into XidEvent records with
:func:`producer.nvml.records.nvml_xid_event`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from producer.nvml.errors import NvmlInitError, NvmlSourceError
from producer.nvml.identity import text

log = logging.getLogger("gpupipe.nvml.events")

NO_INSTANCE = 0xFFFFFFFF
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
GPU_UNAVAILABLE = 0x4000
RECOVERY_ACTION = 0x8000

EventCallback = Callable[[dict[str, Any]], None]
MigLookup = Callable[[str, int | None, int | None], str | None]


def _address(handle: Any) -> int | None:
    """The pointer value of a ctypes handle (NVML hands back a new Python object per call)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class XidEventWatcher:
    """Watches NVML XID events on every GPU of the node from a background thread."""

    def __init__(
        self,
        nvml: Any,
        on_event: EventCallback,
        *,
        timeout_ms: int = 1000,
        on_error: Callable[[str], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        mig_uuid_lookup: MigLookup | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        rebuild_after: int = 3,
        thread_name: str = "nvml-xid-events",
    ) -> None:
        self._nvml = nvml
        self._on_event = on_event
        self._on_error = on_error
        self._timeout_ms = int(timeout_ms)
        self._wall_clock = wall_clock
        self._mig_lookup = mig_uuid_lookup
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._rebuild_after = max(1, rebuild_after)
        self._thread_name = thread_name
        self._xid_type = int(getattr(nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL_ERROR))
        self._recovery_type = int(getattr(nvml, "nvmlEventTypeGpuRecoveryAction", RECOVERY_ACTION))
        self._unavailable_type = int(getattr(nvml, "nvmlEventTypeGpuUnavailableError", GPU_UNAVAILABLE))
        # XIDs, plus the R570+ recovery-action and GPU-unavailable events where a GPU offers them
        # (Blackwell reports reset / reboot / drain-required through these at once).
        self._types = self._xid_type | self._recovery_type | self._unavailable_type
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self._by_address: dict[int, tuple[int, str, str]] = {}  # handle -> (index, uuid, bus id)
        self._by_uuid: dict[str, tuple[int, str]] = {}
        self.registered: list[int] = []  # GPU indices with XID events registered
        self.unsupported: list[int] = []  # GPU indices where NVML could not register them
        self.error_counts: Counter[str] = Counter()
        self.delivered = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise NVML, build the event set and start the thread."""
        if self._thread is not None:
            return
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlInitError(f"NVML init failed: {exc}") from exc
        try:
            self._build()
        except nvml.NVMLError as exc:
            self._shutdown_nvml()
            raise NvmlSourceError(f"NVML event set could not be created: {exc}") from exc
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the thread (within about one wait timeout) and free the set. True when clean."""
        thread = self._thread
        if thread is None:
            return True
        self._stop.set()
        thread.join(self._timeout_ms / 1000.0 + 2.0 if timeout_s is None else timeout_s)
        if thread.is_alive():
            log.warning("NVML event thread did not return from its wait; event set left allocated")
            return False
        self._thread = None
        self._free()
        self._shutdown_nvml()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- event set ------------------------------------------------------------------------------
    def _build(self) -> None:
        nvml = self._nvml
        self._set = nvml.nvmlEventSetCreate()
        self.registered, self.unsupported = [], []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = text(nvml.nvmlDeviceGetUUID(h))
                bus = text(nvml.nvmlDeviceGetPciInfo(h).busId)
            except nvml.NVMLError as exc:
                self._report(type(exc).__name__)
                log.warning("GPU %d: cannot identify it for XID events: %s", index, exc)
                continue
            addr = _address(h)
            if addr is not None:
                self._by_address[addr] = (index, uuid, bus)
            self._by_uuid[uuid] = (index, bus)
            try:
                mask = self._types & int(nvml.nvmlDeviceGetSupportedEventTypes(h))
                if mask:
                    nvml.nvmlDeviceRegisterEvents(h, mask, self._set)
            except nvml.NVMLError_NotSupported:
                mask = 0
            except nvml.NVMLError as exc:
                self.unsupported.append(index)
                self._report(type(exc).__name__)
                log.warning("GPU %d: XID event registration failed: %s", index, exc)
                continue
            if mask:
                self.registered.append(index)
            else:  # NVML: the set stays usable, nothing registered for this GPU
                self.unsupported.append(index)
                log.warning("GPU %d does not support XID events through NVML (kernel log still works)", index)

    def _free(self) -> None:
        if self._set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(self._set)
        except Exception as exc:
            log.debug("nvmlEventSetFree failed: %s", exc)
        self._set = None

    def _shutdown_nvml(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    # -- the thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        nvml = self._nvml
        failures = 0
        backoff = self._backoff_initial
        while not self._stop.is_set():
            try:
                if self._set is None:
                    self._build()
                data = nvml.nvmlEventSetWait_v2(self._set, self._timeout_ms)
            except nvml.NVMLError_Timeout:
                failures, backoff = 0, self._backoff_initial
                continue
            except Exception as exc:  # NVML errors (GpuIsLost, Unknown...) and anything unexpected
                failures += 1
                self._report(type(exc).__name__)
                log.warning("NVML event wait failed (%d in a row): %s", failures, exc)
                if self._stop.wait(backoff):
                    break
                backoff = min(backoff * 2, self._backoff_max)
                if failures >= self._rebuild_after:
                    self._free()  # rebuilt at the top of the loop
                    failures = 0
                continue
            failures, backoff = 0, self._backoff_initial
            self._deliver(data)

    def _deliver(self, data: Any) -> None:
        etype = int(data.eventType)
        if not etype & self._types:
            return
        index, uuid, bus = self._who(data.device)
        if not etype & self._xid_type:
            kind = "recovery_action" if etype & self._recovery_type else "gpu_unavailable"
            notice = {
                "type": kind,
                "data": int(data.eventData),
                "uuid": uuid,
                "pci_bus_id": bus,
                "gpu_index": index,
                "timestamp_ms": int(self._wall_clock() * 1000),
            }
            self.delivered += 1
            try:
                self._on_event(notice)
            except Exception:
                log.exception("NVML event callback failed for %s", notice)
            return
        gi = int(data.gpuInstanceId)
        ci = int(data.computeInstanceId)
        gpu_instance_id = None if gi == NO_INSTANCE else gi
        compute_instance_id = None if ci == NO_INSTANCE else ci
        event = {
            "xid": int(data.eventData),
            "uuid": uuid,
            "pci_bus_id": bus,
            "gpu_index": index,
            "gpu_instance_id": gpu_instance_id,
            "compute_instance_id": compute_instance_id,
            "mig_uuid": None,
            "timestamp_ms": int(self._wall_clock() * 1000),
        }
        if self._mig_lookup is not None and uuid and gpu_instance_id is not None:
            try:
                event["mig_uuid"] = self._mig_lookup(uuid, gpu_instance_id, compute_instance_id)
            except Exception as exc:
                log.debug("MIG lookup failed: %s", exc)
        self.delivered += 1
        try:
            self._on_event(event)
        except Exception:
            log.exception("XID event callback failed for %s", event)

    def _who(self, handle: Any) -> tuple[int | None, str | None, str]:
        addr = _address(handle)
        if addr is not None and addr in self._by_address:
            return self._by_address[addr]
        nvml = self._nvml
        try:
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
        except Exception:
            return None, None, ""
        index, bus = self._by_uuid.get(uuid, (None, ""))
        return index, uuid, bus

    def _report(self, kind: str) -> None:
        self.error_counts[kind] += 1
        if self._on_error is not None:
            try:
                self._on_error(kind)
            except Exception as exc:
                log.debug("on_error hook failed: %s", exc)
