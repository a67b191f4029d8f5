"""The event-set part of the fake NVML module (``tests/fake_nvml.py``), split out by role.

What it models (nvml.h: ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait_v2``, ``nvmlEventSetFree``):

* an event set is a queue per set; an event is put into every live set where its GPU registered
  that event type; a wait returns one event, or raises ``NVMLError_Timeout`` after ``timeoutms``;
* there is no "unregister": a GPU stays in a set until the set is freed;
* a wait on a freed set (or a set of an NVML session that was shut down) raises InvalidArgument;
* **failures**: ``fail_event_wait(code, times, gpu=...)`` makes the next ``times`` waits of the
  sets (where ``gpu`` is registered, or every set) raise ``code`` once each (a transient error);
  a GPU that is lost, or whose event channel is broken (``FakeGpu.event_wait_error``, a code),
  makes *every* wait of every set it is registered in raise (``GpuIsLost`` or that code) for as
  long as it stays so. NVML does not document the order between one GPU's error and another
  GPU's queued events in the same set; the fake takes the worst case: errors first, so a failing
  GPU hides the queued events of every other GPU of its set. A GPU whose channel is broken can
  still be registered again (the registration call succeeds), as a lost GPU whose handle NVML
  still gives would;
* **delivery** (``FakeNvml(event_delivery=...)``): ``"own-set"`` puts an event into every live set
  where its GPU registered that type, as the driver's per-client queues are usually pictured;
  ``"any-set"`` behaves as NVIDIA's mock library (k8s-test-infra ``pkg/gpu/mocknvml``,
  ``bridge/events.go``): the library holds one queue of pending events and hands each to whichever
  set's wait asks first, whatever set its GPU registered in; the event's ``device`` still names
  the GPU it happened on. The double takes the worst case of that: an event goes to a set *other*
  than its GPU's own whenever another one is waiting, so an attribution by the delivering set is
  wrong every time, not one run in eight. Several events may be pending at once, and an event of a
  GPU whose own set is freed (being rebuilt, or the GPU is lost) is still handed to another set.
  As in NVML, only a GPU that registered the event type (in any set of the session) has its
  events recorded at all;
* **a wait stuck in the driver** (a hung GPU): after ``stick_event_waits(gpu)`` every wait
  (timeout > 0) of a set where that GPU is registered blocks, ignoring its timeout, until
  ``unstick_event_waits(gpu)``; it then goes on as usual. ``stuck_waits`` counts the waits
  blocked now, so a test can wait for a thread to be in one. (A backstop of 60 s keeps a failed
  test from leaving a thread blocked for ever.)

``FakeNvml`` inherits :class:`EventSetsMixin`; the attributes it uses (``_lock``, ``_keep``,
``calls``...) are the fake's own.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import pynvml as _real

if TYPE_CHECKING:
    from tests.fake_nvml import FakeGpu


STUCK_BACKSTOP_S = 60.0


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


class _EventSet:
    __slots__ = ("buf", "errors", "freed", "queue", "registrations", "waiting")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.registrations: dict[int, int] = {}  # gpu index -> event type mask
        self.queue: deque[tuple[FakeGpu, int, int, int, int]] = deque()
        self.errors: deque[int] = deque()
        self.freed = False
        self.waiting = 0


class EventSetsMixin:
    """``nvmlEventSet*`` and ``nvmlDeviceRegisterEvents`` of :class:`tests.fake_nvml.FakeNvml`."""

    if TYPE_CHECKING:  # provided by FakeNvml
        _lock: Any
        _keep: list[Any]
        _sets: dict[int, _EventSet]
        _gpu_handle: dict[int, Any]
        gpus: list[FakeGpu]
        calls: Any
        event_delivery: str
        _pending_any: deque[tuple[FakeGpu, int, int, int, int]]
        _ever_registered: dict[int, int]
        free_while_waiting: int
        stuck_waits: int
        _stuck: dict[int, Any]

        def _check_init(self) -> None: ...
        def _pointer(self, ptr_type: Any, target: Any = None) -> Any: ...
        def _gpu(self, fn: str, handle: Any) -> FakeGpu: ...
        @staticmethod
        def _addr(ptr: Any) -> int | None: ...

    # -- scripting ------------------------------------------------------------------------------
    def fail_event_wait(self, code: int, times: int = 1, gpu: int | None = None) -> None:
        """The next ``times`` waits of every live set (where GPU ``gpu`` is registered) raise ``code``."""
        with self._lock:
            for es in self._sets.values():
                if not es.freed and (gpu is None or gpu in es.registrations):
                    es.errors.extend([code] * times)
            self._lock.notify_all()

    def stick_event_waits(self, gpu: int) -> None:
        """Waits of the sets where ``gpu`` is registered block until :meth:`unstick_event_waits`."""
        with self._lock:
            self._stuck.setdefault(gpu, threading.Event())

    def unstick_event_waits(self, gpu: int) -> None:
        with self._lock:
            released = self._stuck.pop(gpu, None)
        if released is not None:
            released.set()

    def _stuck_in_driver(self, eventSet: Any, timeoutms: int) -> None:
        with self._lock:
            st = self._sets.get(self._addr(eventSet))  # type: ignore[arg-type]
            if st is None or timeoutms <= 0:
                return
            held = [self._stuck[i] for i in st.registrations if i in self._stuck]
            if not held:
                return
            self.stuck_waits += 1
            self._lock.notify_all()
        try:
            held[0].wait(STUCK_BACKSTOP_S)
        finally:
            with self._lock:
                self.stuck_waits -= 1

    def live_event_sets(self) -> int:
        """Sets created and not freed (a test can check nothing leaks)."""
        with self._lock:
            return sum(1 for s in self._sets.values() if not s.freed)

    def _notify_events(self) -> None:
        """Wake the waits: a GPU was lost, recovered or had its event channel broken."""
        with self._lock:
            self._lock.notify_all()

    def _free_all_event_sets(self) -> None:
        """A full nvmlShutdown: every set of the session is gone."""
        with self._lock:
            for st in self._sets.values():
                st.freed = True
            self._lock.notify_all()

    # -- module surface -------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> Any:
        self._check_init()
        self.calls[("nvmlEventSetCreate", None)] += 1
        ptr = self._pointer(_real.c_nvmlEventSet_t)
        with self._lock:
            self._sets[self._addr(ptr)] = _EventSet(self._keep[-1])  # type: ignore[index]
        return ptr

    def _event_set(self, es: Any) -> _EventSet:
        st = self._sets.get(self._addr(es))  # type: ignore[arg-type]
        if st is None or st.freed:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return st

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        gpu = self._gpu("nvmlDeviceGetSupportedEventTypes", handle)
        if not gpu.events_supported:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        return gpu.supported_event_types

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu("nvmlDeviceRegisterEvents", handle)
        with self._lock:
            st = self._event_set(eventSet)
            if not gpu.events_supported or not eventTypes & gpu.supported_event_types:
                raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
            mask = eventTypes & gpu.supported_event_types
            st.registrations[gpu.index] = st.registrations.get(gpu.index, 0) | mask
            self._ever_registered[gpu.index] = self._ever_registered.get(gpu.index, 0) | mask

    def _failing(self, st: _EventSet) -> int | None:
        """The error a registered GPU makes every wait of ``st`` raise, if one does."""
        for index in sorted(st.registrations):
            gpu = self.gpus[index]
            if gpu.lost:
                return _real.NVML_ERROR_GPU_IS_LOST
            if gpu.event_wait_error is not None:
                return int(gpu.event_wait_error)
        return None

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> Any:
        self._check_init()
        self._stuck_in_driver(eventSet, timeoutms)
        with self._lock:
            self.calls[("nvmlEventSetWait_v2", None)] += 1
            st = self._event_set(eventSet)
            st.waiting += 1
            try:
                deadline = time.monotonic() + timeoutms / 1000.0
                while True:
                    if st.errors:
                        raise _err(st.errors.popleft())
                    if st.freed:
                        raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
                    failing = self._failing(st)
                    if failing is not None:
                        raise _err(failing)
                    claimed = self._claim(st)
                    if claimed is not None:
                        gpu, etype, edata, gi, ci = claimed
                        data = _real.c_nvmlEventData_t()
                        data.device = ctypes.cast(self._gpu_handle[gpu.index], _real.c_nvmlDevice_t)
                        data.eventType, data.eventData = etype, edata
                        data.gpuInstanceId, data.computeInstanceId = gi, ci
                        return data
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise _err(_real.NVML_ERROR_TIMEOUT)
                    self._lock.wait(remaining)
            finally:
                st.waiting -= 1

    def _claim(self, st: _EventSet) -> tuple[FakeGpu, int, int, int, int] | None:
        """The event a wait on ``st`` returns now, if any (called under the lock)."""
        if self.event_delivery == "own-set":
            return st.queue.popleft() if st.queue else None
        others_waiting = any(s is not st and s.waiting and not s.freed for s in self._sets.values())
        for k, event in enumerate(self._pending_any):
            if event[0].index not in st.registrations or not others_waiting:
                del self._pending_any[k]
                return event
        return None

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._check_init()
        with self._lock:
            self.calls[("nvmlEventSetFree", None)] += 1
            st = self._event_set(eventSet)
            if st.waiting:
                self.free_while_waiting += 1
            st.freed = True
            self._lock.notify_all()

    def _inject_event(self, gpu: FakeGpu, etype: int, edata: int, gi: int, ci: int) -> None:
        with self._lock:
            if self.event_delivery == "any-set":
                if not self._ever_registered.get(gpu.index, 0) & etype:
                    return
                self._pending_any.append((gpu, etype, edata, gi, ci))
                self._lock.notify_all()
                return
            for st in self._sets.values():
                if not st.freed and st.registrations.get(gpu.index, 0) & etype:
                    st.queue.append((gpu, etype, edata, gi, ci))
            self._lock.notify_all()
