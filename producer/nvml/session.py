"""Letting go of NVML and taking it again: what an :class:`~producer.nvml.source.NvmlSource` does
for a GPU reset, a fall-off-the-bus recovery or a driver upgrade (split out of source.py).

Why: an initialised NVML keeps the view of the devices it had when it started. After a GPU fell off
the bus, a reset or a rebind is usually invisible to it until ``nvmlShutdown`` / ``nvmlInit``
(review §2, ``nvml/source.py:433-456``), so the cheap probe in the same session may never see the
GPU come back; and while the agent holds NVML, ``nvidia-smi -r`` and the GPU Operator's driver
unload cannot proceed. So the source can

* :meth:`suspend`: free what it holds (GPM samples) and shut its NVML reference down; ``poll``
  returns nothing meanwhile. Refused (False) while a GPU's call is still in flight: NVML must not
  be shut down under a running call;
* :meth:`resume`: ``nvmlInit`` again and re-enumerate: each GPU found again by UUID (else PCI bus
  id, else NVML index) keeps its place and telemetry continues under new handles, with everything
  learned per device asked again (a new driver may answer differently); a GPU lost before and
  answering now is reported recovered; one still lost keeps its identity and is not reported
  again; one that vanished from the enumeration stays listed as lost;
* :meth:`reinit_due`: with a GPU lost, say when to try a re-initialisation: ``lost_reinit``
  seconds (60) after the loss, doubling up to an hour while GPUs stay lost.

NVML's init is reference-counted: a real new session needs every holder (the event watcher too)
to shut down first. The node agent's :mod:`producer.nvml_control` sequences that.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpupipe import pci

if TYPE_CHECKING:
    from producer.nvml.base import NvmlErrors

log = logging.getLogger("gpupipe.nvml")

REINIT_MAX_S = 3600.0


class SourceSession:
    """Mixed into NvmlSource (which provides the attributes declared below)."""

    if TYPE_CHECKING:
        _nvml: Any
        _gpus: list[Any]
        _workers: dict[int, Any]
        _stalled: set[int]
        _started: bool
        _now: float
        intervals: dict[str, float]
        unusable_gpus: int

        @property
        def _errs(self) -> NvmlErrors: ...
        def _release(self, ctx: Any) -> None: ...
        def _quiet_shutdown(self) -> None: ...
        def _open(self, index: int, prev: Any = None) -> Any: ...
        def _mark_lost(self, gpu: Any, ts: int, where: str, exc: BaseException) -> None: ...
        def _wall_clock(self) -> float: ...
        def _hook(self, name: str, *args: Any) -> None: ...

    #: True between suspend() and a successful resume().
    released = False
    #: NVML's error class when the last resume() failed (``NVMLError_LibRmVersionMismatch``...).
    resume_error: str | None = None
    #: Successful resumes (re-initialisations and releases ended).
    sessions_resumed = 0
    _reinit_at: float | None = None
    _reinit_backoff: float | None = None

    def can_suspend(self) -> bool:
        """False while a GPU's NVML call is in flight (a stalled GPU's worker)."""
        return not any(w.busy for w in self._workers.values())

    def suspend(self) -> bool:
        """Release NVML (see the module docstring). True when released (or already)."""
        if self.released or not self._started:
            return True
        if not self.can_suspend():
            return False
        for gpu in self._gpus:
            for ctx in (gpu.ctx, *(s.ctx for s in gpu.slices)):
                self._release(ctx)
                ctx.state.clear()
        self._quiet_shutdown()
        self.released = True
        return True

    def resume(self) -> bool:
        """Take NVML again and re-enumerate; False (still released, ``resume_error`` set) on failure."""
        if not self.released:
            return True
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.resume_error = type(exc).__name__
            return False
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self._quiet_shutdown()
            self.resume_error = type(exc).__name__
            return False
        self._reenumerate(count)
        self.released = False
        self.resume_error = None
        self.sessions_resumed += 1
        return True

    def reinit(self) -> bool:
        """:meth:`suspend` then :meth:`resume` (a new session only if nobody else holds NVML)."""
        return self.suspend() and self.resume()

    def reinit_due(self, now: float) -> bool:
        """True when a re-initialisation should be tried for the GPUs lost now (back-off)."""
        if not any(g.lost for g in self._gpus):
            self._reinit_at = self._reinit_backoff = None
            return False
        first = self.intervals["lost_reinit"]
        if self._reinit_at is None:
            self._reinit_backoff = first
            self._reinit_at = now + first
            return False
        return now >= self._reinit_at

    def reinit_tried(self, now: float) -> None:
        """A re-initialisation was tried: the next one (if GPUs stay lost) waits twice as long."""
        backoff = min((self._reinit_backoff or self.intervals["lost_reinit"]) * 2, REINIT_MAX_S)
        self._reinit_backoff = backoff
        self._reinit_at = now + backoff

    def _reenumerate(self, count: int) -> None:
        old = list(self._gpus)
        by_uuid = {g.ctx.uuid: g for g in old if g.ctx.uuid}
        by_bus = {pci.device_key(g.ctx.pci_bus_id): g for g in old if g.ctx.pci_bus_id}
        by_index = {g.ctx.index: g for g in old}
        self._stalled.clear()
        self.unusable_gpus = 0
        found: list[Any] = []
        matched: set[int] = set()  # id() of the old entries found again
        for index in range(count):
            gpu = self._open(index, by_index.get(index))
            if gpu is None:
                continue
            prev = gpu if any(gpu is g for g in old) else by_uuid.get(gpu.ctx.uuid or "")
            if prev is None and gpu.ctx.pci_bus_id:
                prev = by_bus.get(pci.device_key(gpu.ctx.pci_bus_id))
            if prev is not None:
                matched.add(id(prev))
                if prev is not gpu and prev.lost and not gpu.lost:
                    log.info("GPU %d answers NVML again after re-initialisation", gpu.ctx.index)
                    self._hook("gpu_recovered", self._ref(gpu))
            found.append(gpu)
        for g in old:  # gone from the enumeration: still a GPU of this node, reported lost
            if id(g) not in matched:
                if not g.lost:
                    exc = self._errs.base(self._nvml.NVML_ERROR_GPU_IS_LOST)
                    self._mark_lost(g, int(self._wall_clock() * 1000), "reinit", exc)
                found.append(g)
        self._gpus = found

    if TYPE_CHECKING:

        def _ref(self, gpu: Any) -> Any: ...
