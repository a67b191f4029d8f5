"""NVML XID event watcher: one NVML event set and one waiting thread per GPU.

Why one set per GPU, not one for the node: NVML has no "unregister", and a wait on a set fails as
a whole when one of its GPUs fails (``NVMLError_GpuIsLost`` after a fall off the bus, or any error
of a broken event channel); nvml.h does not say whether the other GPUs' queued events come out
before that error. With one shared set, a failing GPU therefore held back (during the back-off)
and finally dropped (when the set was freed and rebuilt) every other GPU's XIDs, and a GPU that
could be registered again but kept failing made that cycle forever (review §2,
``nvml/events.py:193-203``). With a set per GPU, a failing GPU costs nobody else anything.

``start()`` initialises NVML (reference-counted, so it shares the process with ``NvmlSource``),
then for every GPU creates a set, registers ``nvmlEventTypeXidCriticalError`` (plus the R570+
``GpuRecoveryAction`` and ``GpuUnavailableError`` where the GPU offers them) and starts that GPU's
thread. A GPU answering NotSupported is logged and has no thread (the kernel log still reports its
XIDs). Each thread loops on ``nvmlEventSetWait_v2(set, timeout_ms)``:

* ``NVMLError_Timeout``: nothing happened, wait again (this is how ``stop()`` is noticed);
* an event: ``on_event(dict)`` with ``xid``, ``uuid``, ``pci_bus_id``, ``gpu_index``,
  ``gpu_instance_id`` / ``compute_instance_id`` (None when NVML says 0xFFFFFFFF, i.e. not
  attributable to a MIG instance), ``mig_uuid`` (when a lookup is given and knows it) and
  ``timestamp_ms`` (wall clock when received); recovery-action and GPU-unavailable events as
  ``{"type": ..., "data": ...}`` notices; events of other types are ignored;
* any error (``GpuIsLost``, ``Unknown``...): reported (``on_error(kind)``, ``error_counts``; the
  first of a run of failures logged at WARNING, the rest at DEBUG), then *this GPU's* thread backs
  off (1 s doubling to 30 s, interrupted by ``stop()``). After ``rebuild_after`` errors in a row
  the set is drained (what NVML still hands out is delivered) and freed, and the GPU is set up
  again after the next back-off; a GPU that cannot be set up (lost: no handle) is retried at the
  back-off pace and re-added when it answers. The back-off is reset only by a wait that works
  (an event or a timeout), so a GPU that registers fine and fails at once costs one attempt per
  30 s, never a busy loop.

``stop()`` makes the threads leave within about one wait timeout; each drains and frees its own
set (never while a wait is in flight: the thread that waits is the one that frees), then NVML is
shut down. Draining at stop matters when the agent re-initialises NVML (a GPU reset, a driver
release): the events the sets still hold are delivered, not dropped. Turn delivered dicts into
XidEvent records with :func:`producer.nvml.records.nvml_xid_event`.
"""

from __future__ import annotations

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
#: Events taken out of a set being freed, at most (a set holds what arrived since the last wait).
MAX_DRAIN = 10_000

EventCallback = Callable[[dict[str, Any]], None]
MigLookup = Callable[[str, int | None, int | None], str | None]


class _Channel:
    """One GPU's event set and what the thread knows about the GPU."""

    __slots__ = ("bus", "failing", "index", "set", "thread", "uuid")

    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid: str | None = None
        self.bus = ""
        self.set: Any = None
        self.thread: threading.Thread | None = None
        self.failing = False  # in a run of failures (logged once per run)


class XidEventWatcher:
    """Watches NVML XID events on every GPU of the node, one background thread per GPU."""

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
        self._lock = threading.Lock()
        self._life = threading.Lock()  # start() and stop() may come from different threads
        self._channels: list[_Channel] = []
        self._registered: set[int] = set()
        self._unsupported: set[int] = set()
        self._started = False
        self.error_counts: Counter[str] = Counter()
        self.delivered = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def registered(self) -> list[int]:
        """GPU indices whose events are registered now."""
        with self._lock:
            return sorted(self._registered)

    @property
    def unsupported(self) -> list[int]:
        """GPU indices where NVML offers none of the watched event types."""
        with self._lock:
            return sorted(self._unsupported)

    @property
    def failing(self) -> list[int]:
        """GPU indices whose thread is backing off after errors (the others are read meanwhile)."""
        return [c.index for c in self._channels if c.failing]

    @property
    def running(self) -> bool:
        return self._started and any(c.thread is not None and c.thread.is_alive() for c in self._channels)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise NVML, set every GPU up and start the threads."""
        with self._life:
            self._start()

    def _start(self) -> None:
        if self._started:
            return
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlInitError(f"NVML init failed: {exc}") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self._shutdown_nvml()
            raise NvmlSourceError(f"NVML event sets could not be created: cannot count GPUs: {exc}") from exc
        self._stop.clear()
        with self._lock:
            self._registered.clear()
            self._unsupported.clear()
        self._channels = [_Channel(i) for i in range(count)]
        for ch in self._channels:
            if self._build(ch) == "unsupported":
                continue
            ch.thread = threading.Thread(
                target=self._run, args=(ch,), name=f"{self._thread_name}-gpu{ch.index}", daemon=True
            )
        self._started = True
        for ch in self._channels:
            if ch.thread is not None:
                ch.thread.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the threads (within about one wait timeout) and free the sets. True when clean.

        A thread still blocked in NVML after ``timeout_s`` keeps its set and NVML initialised (never
        freed under a wait); the others are stopped anyway.
        """
        with self._life:
            return self._stop_threads(timeout_s)

    def _stop_threads(self, timeout_s: float | None) -> bool:
        if not self._started:
            return True
        self._stop.set()
        deadline = time.monotonic() + (self._timeout_ms / 1000.0 + 2.0 if timeout_s is None else timeout_s)
        stuck = []
        for ch in self._channels:
            if ch.thread is not None:
                ch.thread.join(max(0.0, deadline - time.monotonic()))
                if ch.thread.is_alive():
                    stuck.append(ch.index)
        if stuck:
            log.warning(
                "NVML event threads of GPUs %s did not return from their wait; sets left allocated", stuck
            )
            return False
        for ch in self._channels:  # GPUs without a thread (unsupported) may hold a set
            self._free(ch)
        self._channels = []
        self._started = False
        self._shutdown_nvml()
        return True

    # -- one GPU --------------------------------------------------------------------------------
    def _build(self, ch: _Channel) -> str:
        """Set ``ch`` up: ``"ok"``, ``"unsupported"`` (no thread needed) or ``"failed"`` (retry later)."""
        nvml = self._nvml
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(ch.index)
            ch.uuid = text(nvml.nvmlDeviceGetUUID(h))
            ch.bus = text(nvml.nvmlDeviceGetPciInfo(h).busId)
            try:
                mask = self._types & int(nvml.nvmlDeviceGetSupportedEventTypes(h))
            except nvml.NVMLError_NotSupported:
                mask = 0
            if not mask:
                return self._no_events(ch)
            es = nvml.nvmlEventSetCreate()
            try:
                nvml.nvmlDeviceRegisterEvents(h, mask, es)
            except BaseException:
                self._free_set(es)
                raise
        except nvml.NVMLError_NotSupported:
            return self._no_events(ch)
        except nvml.NVMLError as exc:
            self._failed(ch, exc, "cannot set up XID events")
            return "failed"
        ch.set = es
        with self._lock:
            self._registered.add(ch.index)
        return "ok"

    def _no_events(self, ch: _Channel) -> str:
        with self._lock:
            self._unsupported.add(ch.index)
        log.warning("GPU %d does not support XID events through NVML (kernel log still works)", ch.index)
        return "unsupported"

    def _run(self, ch: _Channel) -> None:
        nvml = self._nvml
        failures = 0
        backoff = self._backoff_initial
        try:
            while not self._stop.is_set():
                if ch.set is None and self._build(ch) != "ok":
                    if self._stop.wait(backoff):
                        break
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
                try:
                    data = nvml.nvmlEventSetWait_v2(ch.set, self._timeout_ms)
                except nvml.NVMLError_Timeout:
                    failures, backoff = 0, self._backoff_initial
                    self._recovered(ch)
                    continue
                except Exception as exc:  # NVML errors (GpuIsLost, Unknown...) and anything unexpected
                    failures += 1
                    self._failed(ch, exc, f"event wait failed ({failures} in a row)")
                    if failures >= self._rebuild_after:
                        self._drain(ch)
                        self._free(ch)  # set up again after the back-off
                        failures = 0
                    if self._stop.wait(backoff):
                        break
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
                failures, backoff = 0, self._backoff_initial
                self._recovered(ch)
                self._deliver(ch, data)
        finally:
            self._drain(ch)
            self._free(ch)

    def _drain(self, ch: _Channel) -> None:
        """Deliver what the set still holds (zero-timeout waits until NVML says timeout or fails)."""
        if ch.set is None:
            return
        nvml = self._nvml
        for _ in range(MAX_DRAIN):
            try:
                data = nvml.nvmlEventSetWait_v2(ch.set, 0)
            except Exception:
                return
            self._deliver(ch, data)

    def _free(self, ch: _Channel) -> None:
        with self._lock:
            self._registered.discard(ch.index)
        if ch.set is not None:
            self._free_set(ch.set)
            ch.set = None

    def _free_set(self, es: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(es)
        except Exception as exc:
            log.debug("nvmlEventSetFree failed: %s", exc)

    def _failed(self, ch: _Channel, exc: BaseException, what: str) -> None:
        self._report(type(exc).__name__)
        if ch.failing:
            log.debug("GPU %d: NVML %s: %s", ch.index, what, exc)
            return
        ch.failing = True
        log.warning(
            "GPU %d: NVML %s: %s; retrying with back-off, the other GPUs' events are read meanwhile",
            ch.index,
            what,
            exc,
        )

    @staticmethod
    def _recovered(ch: _Channel) -> None:
        if ch.failing:
            ch.failing = False
            log.info("GPU %d: NVML XID events work again", ch.index)

    def _shutdown_nvml(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    # -- delivery -------------------------------------------------------------------------------
    def _deliver(self, ch: _Channel, data: Any) -> None:
        etype = int(data.eventType)
        if not etype & self._types:
            return
        # The set holds this GPU only: the event is this GPU's (MIG XIDs come on the parent).
        index, uuid, bus = ch.index, ch.uuid, ch.bus
        if not etype & self._xid_type:
            kind = "recovery_action" if etype & self._recovery_type else "gpu_unavailable"
            self._hand_over(
                {
                    "type": kind,
                    "data": int(data.eventData),
                    "uuid": uuid,
                    "pci_bus_id": bus,
                    "gpu_index": index,
                    "timestamp_ms": int(self._wall_clock() * 1000),
                }
            )
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
        self._hand_over(event)

    def _hand_over(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.delivered += 1
        try:
            self._on_event(event)
        except Exception:
            log.exception("NVML event callback failed for %s", event)

    def _report(self, kind: str) -> None:
        with self._lock:
            self.error_counts[kind] += 1
        if self._on_error is not None:
            try:
                self._on_error(kind)
            except Exception as exc:
                log.debug("on_error hook failed: %s", exc)
