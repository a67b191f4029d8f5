"""The NVML reference an :class:`~gpupipe_producer.nvml.source.NvmlSource` holds: taken at start, let go
of and taken again for a GPU reset, a fall-off-the-bus recovery or a driver upgrade.

Why: an initialised NVML keeps the view of the devices it had when it started. After a GPU fell off
the bus, a reset or a rebind is usually invisible to it until ``nvmlShutdown`` / ``nvmlInit``, so
the cheap probe in the same session may never see the GPU come back; and while the agent holds
NVML, ``nvidia-smi -r`` and the GPU Operator's driver unload cannot proceed. The source therefore
suspends (frees what it holds, then :meth:`NvmlSession.let_go`) and resumes
(:meth:`NvmlSession.take_again`, then re-enumerates its GPUs). With a GPU lost,
:meth:`NvmlSession.reinit_due` says when to try: ``lost_reinit`` seconds (60) after the loss,
doubling up to an hour while GPUs stay lost.

NVML's init is reference-counted: a real new session needs every holder (the event watcher too)
to shut down first. The node agent's :mod:`gpupipe_producer.agent.nvml_control` sequences that.
"""

from __future__ import annotations

import logging
from typing import Any

from gpupipe_producer.nvml.errors import NvmlInitError

log = logging.getLogger("gpupipe.nvml")

REINIT_MAX_S = 3600.0


class NvmlSession:
    """``nvmlInit`` / ``nvmlShutdown`` of one source, whether it is let go of, and the back-off
    of re-initialisations while GPUs are lost. Constructing it calls nothing in NVML."""

    def __init__(self, nvml: Any, lost_reinit_s: float) -> None:
        self._nvml = nvml
        self._first_reinit_s = lost_reinit_s
        #: True between let_go() and a successful take_again().
        self.released = False
        #: NVML's error class when the last take_again() failed (``NVMLError_LibRmVersionMismatch``...).
        self.resume_error: str | None = None
        #: Successful resumes (re-initialisations and releases ended).
        self.sessions_resumed = 0
        self._reinit_at: float | None = None
        self._reinit_backoff: float | None = None

    def open(self) -> int:
        """``nvmlInit`` and the GPU count; raises :class:`NvmlInitError` with NVML's text."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlInitError(f"NVML init failed: {exc}") from exc
        try:
            return int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self.close()
            raise NvmlInitError(f"NVML init failed: cannot count GPUs: {exc}") from exc

    def close(self) -> None:
        """``nvmlShutdown``, never raising (a failure there leaves nothing to do)."""
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    def let_go(self) -> None:
        """Shut this reference down; the caller has freed what it held under it."""
        self.close()
        self.released = True

    def take_again(self) -> int | None:
        """``nvmlInit`` again: the GPU count, or None (``resume_error`` set) on failure. The
        caller re-enumerates its GPUs, then calls :meth:`resumed`."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.resume_error = type(exc).__name__
            return None
        try:
            return int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self.close()
            self.resume_error = type(exc).__name__
            return None

    def resumed(self) -> None:
        self.released = False
        self.resume_error = None
        self.sessions_resumed += 1

    def reinit_due(self, now: float, any_lost: bool) -> bool:
        """True when a re-initialisation should be tried for the GPUs lost now (back-off)."""
        if not any_lost:
            self._reinit_at = self._reinit_backoff = None
            return False
        if self._reinit_at is None:
            self._reinit_backoff = self._first_reinit_s
            self._reinit_at = now + self._first_reinit_s
            return False
        return now >= self._reinit_at

    def reinit_tried(self, now: float) -> None:
        """A re-initialisation was tried: the next one (if GPUs stay lost) waits twice as long."""
        backoff = min((self._reinit_backoff or self._first_reinit_s) * 2, REINIT_MAX_S)
        self._reinit_backoff = backoff
        self._reinit_at = now + backoff
