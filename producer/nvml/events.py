"""NVML XID event watcher: one NVML event set and one waiting thread per GPU.

``start()`` sets up each GPU's set on its own thread (bounded by ``setup_timeout_s``); each event is
handed to ``on_event(dict)`` attributed to the GPU the event names, each error to ``on_error(kind)``
with a per-GPU back-off and rebuild, so a failing GPU costs the others nothing. ``stop()`` drains and
frees the sets; a wait stuck in NVML leaves an orphan listed in :attr:`stuck`, never a hang.
More: docs/producer.md, "The NVML event watcher".
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpupipe_producer.nvml.errors import NvmlInitError, NvmlSourceError
from gpupipe_producer.nvml.identity import text

log = logging.getLogger("gpupipe.nvml.events")

NO_INSTANCE = 0xFFFFFFFF
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
GPU_UNAVAILABLE = 0x4000
RECOVERY_ACTION = 0x8000
#: Events taken out of a set being freed, at most (a set holds what arrived since the last wait).
MAX_DRAIN = 10_000

#: How an event reached the watcher, as counted in ``delivery_counts`` (see the module doc).
DELIVERIES = ("own_set", "other_set", "unresolved")

EventCallback = Callable[[dict[str, Any]], None]
MigLookup = Callable[[str, int | None, int | None], str | None]


@dataclass(frozen=True, slots=True)
class _Gpu:
    """What an event's device resolved to."""

    index: int | None
    uuid: str | None
    bus: str
    mig: bool  # in MIG mode when last asked: only then do instance ids name a MIG instance


_UNRESOLVED = _Gpu(None, None, "", False)


def _address(handle: Any) -> int | None:
    """The address behind an NVML device handle (``c_nvmlDevice_t``), the same for every copy."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


class _Channel:
    """One GPU's event set and what its thread knows about the GPU."""

    __slots__ = (
        "built",
        "bus",
        "devices",
        "died",
        "done",
        "failing",
        "index",
        "mig",
        "set",
        "thread",
        "unsupported",
        "uuid",
    )

    def __init__(self, index: int, devices: dict[int, _Gpu]) -> None:
        self.index = index
        self.devices = devices  # handle address -> GPU, shared by the channels of one start
        self.uuid: str | None = None
        self.bus = ""
        self.mig = False
        self.set: Any = None
        self.thread: threading.Thread | None = None
        self.failing = False  # in a run of failures (logged once per run)
        self.unsupported = False  # NVML offers none of the watched event types
        self.built = threading.Event()  # the first set-up was tried (start() waits for it)
        self.done = False  # the thread has returned and freed its set
        self.died = False  # the thread ended on an unexpected exception


class _Start:
    """What one ``start()`` set going: its threads, their own stop event, its NVML reference.

    Own stop event: a thread that outlives ``stop()`` (stuck in NVML) must never see a later
    start's ``clear()`` and loop on with a set nobody frees.
    """

    __slots__ = ("channels", "nvml_held", "orphaned", "stop")

    def __init__(self, count: int) -> None:
        devices: dict[int, _Gpu] = {}
        self.channels = [_Channel(i, devices) for i in range(count)]
        self.stop = threading.Event()
        self.nvml_held = True  # this start's nvmlInit reference, given back exactly once
        self.orphaned = False  # stop() gave up waiting: its last thread gives the reference back


def _finished(ch: _Channel) -> bool:
    t = ch.thread
    return ch.done or t is None or t.ident is None  # never started: nothing to wait for


class XidEventWatcher:
    """Watches NVML XID events on every GPU of the node, one background thread per GPU."""

    def __init__(
        self,
        nvml: Any,
        on_event: EventCallback,
        *,
        timeout_ms: int = 1000,
        on_error: Callable[[str], None] | None = None,
        on_delivery: Callable[[str], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
        mig_uuid_lookup: MigLookup | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        rebuild_after: int = 3,
        thread_name: str = "nvml-xid-events",
        setup_timeout_s: float = 2.0,
        stop_timeout_s: float | None = None,
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
        self._setup_timeout = max(0.0, setup_timeout_s)
        self._stop_timeout = self._timeout_ms / 1000.0 + 2.0 if stop_timeout_s is None else stop_timeout_s
        self._xid_type = int(getattr(nvml, "nvmlEventTypeXidCriticalError", XID_CRITICAL_ERROR))
        self._recovery_type = int(getattr(nvml, "nvmlEventTypeGpuRecoveryAction", RECOVERY_ACTION))
        self._unavailable_type = int(getattr(nvml, "nvmlEventTypeGpuUnavailableError", GPU_UNAVAILABLE))
        # XIDs, plus the R570+ recovery-action and GPU-unavailable events where a GPU offers them
        # (Blackwell reports reset / reboot / drain-required through these at once).
        self._types = self._xid_type | self._recovery_type | self._unavailable_type
        self._lock = threading.Lock()
        self._life = threading.Lock()  # start() and stop() may come from different threads
        self._current: _Start | None = None
        self._orphans: list[_Start] = []  # stopped starts with a thread still stuck in NVML
        self._stops = 0  # stop() calls: a start() that a stop overtook starts nothing
        self.error_counts: Counter[str] = Counter()
        #: Events by how they reached the watcher (``DELIVERIES``); each counted once.
        self.delivery_counts: Counter[str] = Counter({d: 0 for d in DELIVERIES})
        self._on_delivery = on_delivery
        self.delivered = 0

    # -- state ------------------------------------------------------------------------------------
    def _channels(self) -> list[_Channel]:
        cur = self._current
        return list(cur.channels) if cur is not None else []

    @property
    def registered(self) -> list[int]:
        """GPU indices whose events are registered now."""
        return sorted(c.index for c in self._channels() if c.set is not None)

    @property
    def unsupported(self) -> list[int]:
        """GPU indices where NVML offers none of the watched event types."""
        return sorted(c.index for c in self._channels() if c.unsupported)

    @property
    def failing(self) -> list[int]:
        """GPU indices whose thread is backing off after errors (the others are read meanwhile)."""
        return [c.index for c in self._channels() if c.failing]

    @property
    def stuck(self) -> list[int]:
        """GPU indices whose thread of a stopped start is still blocked in an NVML wait: until it
        returns, the watcher holds that session's NVML reference (NVML cannot be released)."""
        with self._lock:
            return sorted(c.index for s in self._orphans for c in s.channels if not _finished(c))

    @property
    def dead(self) -> list[int]:
        """GPU indices whose thread ended on an unexpected exception (not watched any more)."""
        return [c.index for c in self._channels() if c.died]

    @property
    def started(self) -> bool:
        """True between a successful ``start()`` and the next ``stop()``."""
        return self._current is not None

    @property
    def running(self) -> bool:
        return any(c.thread is not None and c.thread.is_alive() for c in self._channels())

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Initialise NVML and start one thread per GPU; wait (``setup_timeout_s`` at most) until
        each has tried to set its GPU up. Works again after an unclean ``stop()``."""
        with self._life:
            cur = self._start()
        if cur is None:
            return
        deadline = time.monotonic() + self._setup_timeout
        for ch in cur.channels:
            ch.built.wait(max(0.0, deadline - time.monotonic()))
        slow = [c.index for c in cur.channels if not c.built.is_set()]
        if slow:
            log.warning(
                "GPUs %s: NVML XID event set-up has not returned within %.1fs; it goes on in the "
                "background (the other GPUs are watched)",
                slow,
                self._setup_timeout,
            )

    def _start(self) -> _Start | None:
        if self._current is not None:
            return None
        stops = self._stops
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlInitError(f"NVML init failed: {exc}") from exc
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:  # an NVML error, or garbage from a broken binding: give NVML back
            self._shutdown_nvml()
            raise NvmlSourceError(f"NVML event sets could not be created: cannot count GPUs: {exc}") from exc
        if self._stops != stops:  # a stop() came while NVML was initialising: it wins
            self._shutdown_nvml()
            return None
        cur = _Start(count)
        try:
            for ch in cur.channels:
                ch.thread = threading.Thread(
                    target=self._run, args=(ch, cur), name=f"{self._thread_name}-gpu{ch.index}", daemon=True
                )
                ch.thread.start()
        except BaseException as exc:  # cannot start a thread: stop those started, give NVML back
            self._retire(cur, time.monotonic() + self._stop_timeout)
            raise NvmlSourceError(f"NVML event threads could not be started: {exc}") from exc
        self._current = cur
        return cur

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop the threads (within about one wait timeout) and free the sets. True when clean:
        every thread returned and the watcher holds no NVML reference any more.

        Never blocks longer than ``timeout_s`` (default ``stop_timeout_s``): a thread still
        blocked in NVML then keeps its set and its start's NVML reference until its wait returns
        (never freed under a wait; see the module docstring); the others are stopped anyway.
        """
        limit = self._stop_timeout if timeout_s is None else max(0.0, timeout_s)
        deadline = time.monotonic() + limit
        with self._lock:
            self._stops += 1
        if not self._life.acquire(timeout=limit):
            log.warning(
                "NVML XID event watcher: start() is still in nvmlInit after %.1fs; not stopped", limit
            )
            return False
        try:
            cur, self._current = self._current, None
            stuck = self._retire(cur, deadline) if cur is not None else []
            for old in list(self._orphans):  # earlier stuck waits: give them what time is left
                for ch in old.channels:
                    if ch.thread is not None and not _finished(ch):
                        ch.thread.join(max(0.0, deadline - time.monotonic()))
            if stuck:
                log.warning(
                    "NVML event threads of GPUs %s did not return from their wait within %.1fs; their "
                    "sets and NVML reference are released when they do",
                    stuck,
                    limit,
                )
            return not self.stuck
        finally:
            self._life.release()

    def _retire(self, cur: _Start, deadline: float) -> list[int]:
        """Stop ``cur``'s threads until ``deadline``; the GPUs whose thread is still in NVML."""
        cur.stop.set()
        for ch in cur.channels:
            if ch.thread is not None and ch.thread.ident is not None:
                ch.thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:  # against _ended(): exactly one of the two gives the reference back
            stuck = [ch.index for ch in cur.channels if not _finished(ch)]
            if stuck:
                cur.orphaned = True
                self._orphans.append(cur)
        if not stuck:
            self._give_back(cur)
        return stuck

    def _ended(self, ch: _Channel, cur: _Start) -> None:
        """``ch``'s thread has freed its set; the last orphan of a stopped start releases NVML."""
        with self._lock:
            ch.done = True
            last = cur.orphaned and all(_finished(c) for c in cur.channels)
            if last:
                self._orphans.remove(cur)
        ch.built.set()
        if last:
            log.warning(
                "GPU %d: the stuck NVML event wait returned; its set and NVML reference are released",
                ch.index,
            )
            self._give_back(cur)

    def _give_back(self, cur: _Start) -> None:
        with self._lock:
            held, cur.nvml_held = cur.nvml_held, False
        if held:
            self._shutdown_nvml()

    # -- one GPU --------------------------------------------------------------------------------
    def _build(self, ch: _Channel, first: bool) -> str:
        """Set ``ch`` up: ``"ok"``, ``"unsupported"`` or ``"failed"`` (retry later)."""
        nvml = self._nvml
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(ch.index)
            ch.uuid = text(nvml.nvmlDeviceGetUUID(h))
            ch.bus = text(nvml.nvmlDeviceGetPciInfo(h).busId)
            ch.mig = self._mig_mode(h, False)
            address = _address(h)
            if address:
                with self._lock:  # another GPU's thread may be resolving an event meanwhile
                    ch.devices[address] = _Gpu(ch.index, ch.uuid, ch.bus, ch.mig)
            try:
                mask = self._types & int(nvml.nvmlDeviceGetSupportedEventTypes(h))
            except nvml.NVMLError_NotSupported:
                mask = 0
            if not mask:
                return self._no_events(ch, first)
            es = nvml.nvmlEventSetCreate()
            try:
                nvml.nvmlDeviceRegisterEvents(h, mask, es)
            except BaseException:
                self._free_set(es)
                raise
        except nvml.NVMLError_NotSupported:
            return self._no_events(ch, first)
        except Exception as exc:  # NVML errors, and anything a broken binding raises: retried
            self._failed(ch, exc, "cannot set up XID events")
            return "failed"
        ch.set = es
        if ch.unsupported:
            ch.unsupported = False
            log.info("GPU %d offers XID events through NVML again", ch.index)
        return "ok"

    def _no_events(self, ch: _Channel, first: bool) -> str:
        if not ch.unsupported:  # once per GPU, not once per retry
            ch.unsupported = True
            if first:
                log.warning(
                    "GPU %d does not support XID events through NVML (kernel log still works)", ch.index
                )
            else:
                log.warning(
                    "GPU %d no longer offers XID events through NVML; asked again every %.0fs (kernel "
                    "log still works)",
                    ch.index,
                    self._backoff_max,
                )
        return "unsupported"

    def _run(self, ch: _Channel, cur: _Start) -> None:
        try:
            self._loop(ch, cur.stop)
        except Exception:
            ch.died = True
            log.exception(
                "GPU %d: the NVML XID event thread failed; this GPU's NVML XIDs are not watched until "
                "NVML is re-initialised (the kernel log still reports them)",
                ch.index,
            )
        finally:
            try:
                self._drain(ch)
                self._free(ch)
            finally:
                self._ended(ch, cur)

    def _loop(self, ch: _Channel, stop: threading.Event) -> None:
        nvml = self._nvml
        failures = 0
        backoff = self._backoff_initial
        first = True
        while not stop.is_set():
            if ch.set is None:
                state = self._build(ch, first)
                ch.built.set()
                if state == "unsupported" and first:
                    return  # this GPU offers no events: no thread needed
                first = False
                if state != "ok":
                    if state == "unsupported":
                        backoff = self._backoff_max  # a hardware answer: asked again slowly
                    if stop.wait(backoff):
                        return
                    backoff = min(backoff * 2, self._backoff_max)
                    continue
            try:
                data = self._wait(ch.set, self._timeout_ms)
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
                if stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self._backoff_max)
                continue
            failures, backoff = 0, self._backoff_initial
            self._recovered(ch)
            self._deliver(ch, data)

    def _drain(self, ch: _Channel) -> None:
        """Deliver what the set still holds (zero-timeout waits until NVML says timeout or fails)."""
        if ch.set is None:
            return
        for _ in range(MAX_DRAIN):
            try:
                data = self._wait(ch.set, 0)
            except Exception:
                return
            self._deliver(ch, data)

    def _wait(self, es: Any, timeout_ms: int) -> Any:
        """One wait on ``es``: the event, or NVML's error (Timeout when nothing came)."""
        return self._nvml.nvmlEventSetWait_v2(es, timeout_ms)

    def _free(self, ch: _Channel) -> None:
        es, ch.set = ch.set, None
        if es is not None:
            self._free_set(es)

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
        gpu, mig_instance = self._resolve(ch, data.device)
        if not etype & self._xid_type:
            kind = "recovery_action" if etype & self._recovery_type else "gpu_unavailable"
            self._hand_over(
                {
                    "type": kind,
                    "data": int(data.eventData),
                    "uuid": gpu.uuid,
                    "pci_bus_id": gpu.bus,
                    "gpu_index": gpu.index,
                    "set_gpu_index": ch.index,
                    "timestamp_ms": int(self._wall_clock() * 1000),
                }
            )
            return
        gi = int(data.gpuInstanceId) if mig_instance is None else mig_instance
        ci = int(data.computeInstanceId)
        in_mig = gpu.mig or mig_instance is not None
        gpu_instance_id = None if gi == NO_INSTANCE or not in_mig else gi
        compute_instance_id = None if ci == NO_INSTANCE or gpu_instance_id is None else ci
        event = {
            "xid": int(data.eventData),
            "uuid": gpu.uuid,
            "pci_bus_id": gpu.bus,
            "gpu_index": gpu.index,
            "gpu_instance_id": gpu_instance_id,
            "compute_instance_id": compute_instance_id,
            "mig_uuid": None,
            "set_gpu_index": ch.index,
            "timestamp_ms": int(self._wall_clock() * 1000),
        }
        if self._mig_lookup is not None and gpu.uuid and gpu_instance_id is not None:
            try:
                event["mig_uuid"] = self._mig_lookup(gpu.uuid, gpu_instance_id, compute_instance_id)
            except Exception as exc:
                log.debug("MIG lookup failed: %s", exc)
        self._hand_over(event)

    def _resolve(self, ch: _Channel, device: Any) -> tuple[_Gpu, int | None]:
        """The GPU ``device`` names (and its GPU instance when it is a MIG device handle), counted
        by how it compares with ``ch``, the channel whose set delivered the event."""
        address = _address(device)
        with self._lock:
            gpu = ch.devices.get(address) if address else None
        mig_instance = None
        if gpu is None and address:
            gpu, mig_instance = self._ask_nvml(ch.devices, device)
        elif gpu is not None and not gpu.mig:
            # MIG mode may have been switched on since the set-up; a lost GPU keeps what it had.
            gpu = _Gpu(gpu.index, gpu.uuid, gpu.bus, self._mig_mode(device, gpu.mig))
        gpu = gpu or _UNRESOLVED
        if gpu.index is None:
            delivery = "unresolved"
            log.warning(
                "an NVML event came through GPU %d's set naming a device NVML cannot identify; "
                "published without a GPU rather than on GPU %d",
                ch.index,
                ch.index,
            )
        else:
            delivery = "own_set" if gpu.index == ch.index else "other_set"
        with self._lock:
            self.delivery_counts[delivery] += 1
        if self._on_delivery is not None:
            try:
                self._on_delivery(delivery)
            except Exception as exc:
                log.debug("on_delivery hook failed: %s", exc)
        return gpu, mig_instance

    def _ask_nvml(self, devices: dict[int, _Gpu], device: Any) -> tuple[_Gpu | None, int | None]:
        """A handle no set-up recorded: NVML says which GPU it is (a MIG handle: its parent)."""
        nvml = self._nvml
        try:
            mig_instance = None
            if int(getattr(nvml.nvmlDeviceIsMigDeviceHandle(device), "value", 0) or 0):
                mig_instance = int(nvml.nvmlDeviceGetGpuInstanceId(device))
                device = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
                with self._lock:
                    known = devices.get(_address(device) or 0)
                if known is not None:
                    return known, mig_instance
            index = int(nvml.nvmlDeviceGetIndex(device))
            uuid = text(nvml.nvmlDeviceGetUUID(device))
            bus = text(nvml.nvmlDeviceGetPciInfo(device).busId)
        except Exception as exc:  # a lost GPU answers nothing; a broken binding anything
            log.debug("cannot identify an NVML event's device: %s", exc)
            return None, None
        return _Gpu(index, uuid, bus, self._mig_mode(device, mig_instance is not None)), mig_instance

    def _mig_mode(self, handle: Any, default: bool) -> bool:
        """Whether the GPU is in MIG mode now; ``default`` when NVML cannot say (a lost GPU)."""
        try:
            return int(self._nvml.nvmlDeviceGetMigMode(handle)[0]) == 1
        except Exception:
            return default

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
