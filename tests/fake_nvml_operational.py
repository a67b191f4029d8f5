"""The GPU Operational Events part of the fake NVML module (``tests/fake_nvml.py``), split out by role.

What it models (nvml.h R615+, nvidia-ml-py 13.615.71 signatures; the fields of NVIDIA's "GPU
Operational Event Formats", R620: ``tests/fixtures/nvml/goe_r620_events.json`` names the sources):

* **an older driver**: ``FakeNvml(operational_events=False)`` (the default for a driver before 615)
  makes every operational call raise ``NVMLError_FunctionNotFound``, as pynvml does when the library
  lacks the symbol;
* ``nvmlEventSetRegisterGpuOperationalEvents_v1(set, c_nvmlGpuOperationalEventConfig_v1_t)``: the
  real structure only (anything else: InvalidArgument); the UUID names one GPU (unknown: NotFound;
  empty: InvalidArgument, the double's choice: nvml.h was not read on it); a GPU older than Turing
  answers NotSupported ("For Turing or newer", cuda-python); a lost GPU GpuIsLost. Events below the
  configured ``minLogLevel`` / ``minSeverity`` are not delivered to that set;
* ``nvmlEventSetWait_v3(set, c_nvmlEventSetWait_v3_t)``: fills the structure in place (``timeoutMs``
  is read from it) or raises Timeout; legacy events queued on the set come out with ``dataType`` 0,
  operational ones with ``dataType`` 1; the v2 wait never returns an operational event (it cannot
  say one). Errors, freed sets, lost GPUs and stuck waits behave as for the v2 wait
  (``tests/fake_nvml_events.py``); ``event_delivery="any-set"`` hands an operational event to any
  waiting set, as for legacy events;
* the context calls (count, info, data, legacy Xid) answer for the event the last v3 wait on that set
  returned; ``nvmlEventSetGetContextData_v1`` with a buffer too small raises InsufficientSize.

Scripting: :meth:`OperationalEventsMixin.inject_operational` (one structured event) and
:meth:`OperationalEventsMixin.inject_incident` (the legacy Xid event and the structured event of one
incident, as NVIDIA says a driver may report it), both from :func:`goe_event` specs.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pynvml as _real

if TYPE_CHECKING:
    from tests.fake_nvml import FakeGpu
    from tests.fake_nvml_events import _EventSet

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nvml" / "goe_r620_events.json"
NO_INSTANCE = 0xFFFFFFFF
LEGACY_XID_CONTEXT = _real.NVML_GPU_OPERATIONAL_EVENT_CONTEXT_TYPE_LEGACY_XID


def _err(code: int) -> _real.NVMLError:
    return _real.NVMLError(code)


@dataclass(frozen=True)
class GoeEvent:
    """One structured event as the driver would publish it (NVML's field meanings)."""

    module: str
    code: int
    category: int
    severity: int
    log_level: int
    scope: int = 1
    originator: int = 1
    legacy_xid: int | None = None
    attributes: int = 0
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    #: Contexts of types this double does not decode: (type, source type, format version, bytes).
    raw_contexts: tuple[tuple[int, int, int, bytes], ...] = ()

    def contexts(self) -> list[tuple[int, int, int, Any]]:
        out: list[tuple[int, int, int, Any]] = []
        if self.legacy_xid is not None:
            out.append((LEGACY_XID_CONTEXT, 0, 1, int(self.legacy_xid)))
        out.extend(self.raw_contexts)
        return out


def goe_event(name: str, **overrides: Any) -> GoeEvent:
    """A named event of the fixture (``sparing_event``, ``fallen_off_bus``, ``unknown_code_memory``)."""
    spec = dict(json.loads(FIXTURE.read_text(encoding="utf-8"))["events"][name])
    raw = tuple(
        (int(c["type"]), int(c["source_type"]), int(c["format_version"]), bytes.fromhex(c["hex"]))
        for c in spec.pop("raw_contexts", [])
    )
    return GoeEvent(**{**spec, "raw_contexts": raw, **overrides})


@dataclass
class _OpSet:
    """What one event set holds for operational events."""

    regs: dict[int, tuple[int, int]] = field(default_factory=dict)  # gpu -> (min log level, min severity)
    queue: deque[tuple[FakeGpu, GoeEvent, int]] = field(default_factory=deque)
    last: list[tuple[int, int, int, Any]] = field(default_factory=list)  # contexts of the last event


class OperationalEventsMixin:
    """GPU Operational Event calls of :class:`tests.fake_nvml.FakeNvml`."""

    if TYPE_CHECKING:  # provided by FakeNvml / EventSetsMixin
        _lock: Any
        _sets: dict[int, _EventSet]
        gpus: list[FakeGpu]
        calls: Any
        event_delivery: str
        operational_events: bool
        clock: Any
        _op_sets: dict[int, _OpSet]
        _op_ever: set[int]
        _op_pending_any: deque[tuple[FakeGpu, GoeEvent, int]]
        _op_trace: int

        def _check_init(self) -> None: ...
        def _event_set(self, es: Any) -> _EventSet: ...
        def _failing(self, st: _EventSet) -> int | None: ...
        def _stuck_in_driver(self, eventSet: Any, timeoutms: int) -> None: ...
        @staticmethod
        def _addr(ptr: Any) -> int | None: ...

    # -- scripting ------------------------------------------------------------------------------
    def inject_operational(self, gpu: int, event: GoeEvent) -> int:
        """A structured event on GPU ``gpu``; returns its trace id."""
        g = self.gpus[gpu]
        with self._lock:
            self._op_trace += 1
            trace = self._op_trace
            if self.event_delivery == "any-set":
                if g.index in self._op_ever:
                    self._op_pending_any.append((g, event, trace))
            else:
                for addr, op in self._op_sets.items():
                    st = self._sets.get(addr)
                    if st is not None and not st.freed and _wanted(op, g.index, event):
                        op.queue.append((g, event, trace))
            self._lock.notify_all()
        return trace

    def inject_incident(self, gpu: int, event: GoeEvent, structured_first: bool = False) -> int:
        """One incident reported twice: the legacy NVML Xid event and the structured event."""
        if event.legacy_xid is None:
            raise ValueError("an incident reported twice needs an event with a legacy Xid")
        if structured_first:
            trace = self.inject_operational(gpu, event)
            self.gpus[gpu].inject_xid(event.legacy_xid, event.gpu_instance_id, event.compute_instance_id)
            return trace
        self.gpus[gpu].inject_xid(event.legacy_xid, event.gpu_instance_id, event.compute_instance_id)
        return self.inject_operational(gpu, event)

    # -- module surface -------------------------------------------------------------------------
    def _goe_call(self, name: str) -> None:
        self._check_init()
        if not self.operational_events:
            raise _err(_real.NVML_ERROR_FUNCTION_NOT_FOUND)  # pynvml: the library lacks the symbol
        self.calls[(name, None)] += 1

    def _op_set(self, eventSet: Any) -> _OpSet:
        self._event_set(eventSet)  # InvalidArgument for a freed or unknown set
        return self._op_sets.setdefault(self._addr(eventSet), _OpSet())  # type: ignore[arg-type]

    def nvmlEventSetRegisterGpuOperationalEvents_v1(self, eventSet: Any, config: Any) -> None:
        self._goe_call("nvmlEventSetRegisterGpuOperationalEvents_v1")
        if not isinstance(config, _real.c_nvmlGpuOperationalEventConfig_v1_t):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        uuid = config.uuid.decode() if isinstance(config.uuid, bytes) else str(config.uuid)
        if not uuid:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = next((g for g in self.gpus if g.uuid == uuid), None)
        if gpu is None:
            raise _err(_real.NVML_ERROR_NOT_FOUND)
        if gpu.lost:
            raise _err(_real.NVML_ERROR_GPU_IS_LOST)
        if gpu.arch < _real.NVML_DEVICE_ARCH_TURING:
            raise _err(_real.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            st = self._event_set(eventSet)
            op = self._op_set(eventSet)
            op.regs[gpu.index] = (int(config.minLogLevel), int(config.minSeverity))
            # Listed among the set's GPUs (no legacy type): its loss or stuck channel fails the wait.
            st.registrations.setdefault(gpu.index, 0)
            self._op_ever.add(gpu.index)

    def nvmlEventSetWait_v3(self, eventSet: Any, params: Any) -> None:
        self._goe_call("nvmlEventSetWait_v3")
        if not isinstance(params, _real.c_nvmlEventSetWait_v3_t):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        timeoutms = int(params.timeoutMs)
        self._stuck_in_driver(eventSet, timeoutms)
        with self._lock:
            st = self._event_set(eventSet)
            op = self._op_set(eventSet)
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
                    if st.queue:
                        gpu, etype, edata, gi, ci = st.queue.popleft()
                        _fill_legacy(params, gpu, etype, edata, gi, ci)
                        op.last = []
                        return
                    claimed = self._claim_op(op)
                    if claimed is not None:
                        gpu, event, trace = claimed
                        self._fill_operational(params, gpu, event, trace)
                        op.last = event.contexts()
                        return
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise _err(_real.NVML_ERROR_TIMEOUT)
                    self._lock.wait(remaining)
            finally:
                st.waiting -= 1

    def _claim_op(self, op: _OpSet) -> tuple[FakeGpu, GoeEvent, int] | None:
        if self.event_delivery == "own-set":
            return op.queue.popleft() if op.queue else None
        others = any(
            o is not op and self._sets[a].waiting and not self._sets[a].freed
            for a, o in self._op_sets.items()
            if a in self._sets
        )
        for k, item in enumerate(self._op_pending_any):
            if item[0].index not in op.regs or not others:
                del self._op_pending_any[k]
                return item
        return None

    def _fill_operational(self, p: Any, gpu: FakeGpu, ev: GoeEvent, trace: int) -> None:
        p.dataType = _real.NVML_EVENT_DATA_TYPE_GPU_OPERATIONAL_EVENT
        p.uuid = gpu.uuid.encode()
        p.sourceModule = ev.module.encode()[:15]
        p.eventType = 0
        p.eventData = 0
        p.groupCursor = trace
        p.instanceId = trace
        p.timestampUsec = int(self.clock() * 1_000_000)
        p.traceId = 0xA000_0000_0000_0000 | trace  # the top bit set: a full 64-bit value
        p.gpuInstanceId = NO_INSTANCE if ev.gpu_instance_id is None else ev.gpu_instance_id
        p.computeInstanceId = NO_INSTANCE if ev.compute_instance_id is None else ev.compute_instance_id
        p.severity = ev.severity
        p.categoryId = ev.category
        p.moduleEventCode = ev.code
        p.scope = ev.scope
        p.originator = ev.originator
        p.moduleInstance = 0
        p.chipletId = 0
        p.logLevel = ev.log_level
        p.attributes = ev.attributes
        p.groupCperSize = 0
        p.groupAttributes = 0
        p.groupSize = 1
        p.groupIndex = 0

    def _last_context(self, eventSet: Any, index: int) -> tuple[int, int, int, Any]:
        with self._lock:
            last = self._op_set(eventSet).last
        if not 0 <= index < len(last):
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        return last[index]

    def nvmlEventSetGetContextCount_v1(self, eventSet: Any, params: Any) -> None:
        self._goe_call("nvmlEventSetGetContextCount_v1")
        with self._lock:
            params.count = len(self._op_set(eventSet).last)

    def nvmlEventSetGetContextInfo_v1(self, eventSet: Any, params: Any) -> None:
        self._goe_call("nvmlEventSetGetContextInfo_v1")
        ctype, source, version, payload = self._last_context(eventSet, int(params.index))
        params.nvmlGpuOperationalEventContextType = ctype if ctype == LEGACY_XID_CONTEXT else 0
        params.sourceEventContextType = source if ctype != LEGACY_XID_CONTEXT else ctype
        params.dataSize = 4 if ctype == LEGACY_XID_CONTEXT else len(payload)
        params.dataFormatVersion = version

    def nvmlEventSetGetContextData_v1(self, eventSet: Any, params: Any) -> None:
        self._goe_call("nvmlEventSetGetContextData_v1")
        ctype, _source, _version, payload = self._last_context(eventSet, int(params.index))
        raw = int(payload).to_bytes(4, "little") if ctype == LEGACY_XID_CONTEXT else bytes(payload)
        if int(params.dataSize) < len(raw) or not params.data:
            raise _err(_real.NVML_ERROR_INSUFFICIENT_SIZE)
        ctypes.memmove(params.data, raw, len(raw))

    def nvmlEventSetGetGpuOperationalEventContextLegacyXid_v1(self, eventSet: Any, params: Any) -> None:
        self._goe_call("nvmlEventSetGetGpuOperationalEventContextLegacyXid_v1")
        ctype, _source, _version, payload = self._last_context(eventSet, int(params.index))
        if ctype != LEGACY_XID_CONTEXT:
            raise _err(_real.NVML_ERROR_INVALID_ARGUMENT)
        params.xidCode = int(payload)


def _wanted(op: _OpSet, gpu: int, ev: GoeEvent) -> bool:
    if gpu not in op.regs:
        return False
    min_level, min_severity = op.regs[gpu]
    return ev.log_level >= min_level and ev.severity >= min_severity


def _fill_legacy(p: Any, gpu: FakeGpu, etype: int, edata: int, gi: int, ci: int) -> None:
    p.dataType = _real.NVML_EVENT_DATA_TYPE_NVML_EVENT
    p.uuid = gpu.uuid.encode()
    p.eventType, p.eventData = etype, edata
    p.gpuInstanceId, p.computeInstanceId = gi, ci
