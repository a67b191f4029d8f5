"""When the node agent lets go of NVML and when it takes it again (the polling thread's job).

:meth:`NvmlControl.step` runs once per tick: it re-initialises NVML while a GPU is lost, releases it
while ``--nvml-release-file`` exists, postpones either while an NVML call is still in flight, and
says when only a restart helps (:attr:`NvmlControl.needs_restart`). The rules: docs/producer.md.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpupipe_producer.nvml.errors import NvmlSourceError

log = logging.getLogger("gpupipe.agent")

LIB_MISMATCH = "NVMLError_LibRmVersionMismatch"


#: Why a let-go was postponed (the label of ``gpupipe_producer_nvml_let_go_postponed_total``).
GPU_CALL_IN_FLIGHT = "gpu_call_in_flight"
EVENT_WAIT_STUCK = "event_wait_stuck"


class NvmlControl:
    """Drives :class:`gpupipe_producer.nvml.source.NvmlSource` and its event watcher through releases and
    re-initialisations. :meth:`step` runs on the polling thread before each tick."""

    def __init__(
        self,
        source: Any,
        watcher: Any | None,
        release_file: str | None,
        on_watcher_error: Callable[[str], None] | None = None,
    ) -> None:
        self.source = source
        self.watcher = watcher
        self.release_file = release_file or None
        #: None while NVML is held; "request" (the release file) or "failure" (could not init).
        self.released: str | None = None
        #: Re-initialisations and releases done, by reason (``gpu_lost``, ``request``).
        self.reinits: Counter[str] = Counter()
        #: Failed attempts to take NVML again, by NVML error class.
        self.resume_failures: Counter[str] = Counter()
        #: Let-go attempts postponed, by reason (``gpu_call_in_flight``, ``event_wait_stuck``).
        self.postponed: Counter[str] = Counter()
        #: While the release file asks for a release that is postponed: why (else None).
        self.release_pending: str | None = None
        #: Why the last :meth:`_let_go` refused (None when it did not).
        self.refusal: str | None = None
        self._on_watcher_error = on_watcher_error
        self._logged_error: str | None = None
        self._logged_postponed: tuple[str, str] | None = None
        self._watcher_error: str | None = None

    @property
    def needs_restart(self) -> bool:
        """True when only a process restart can bring NVML back (a driver upgraded under us)."""
        return self.released is not None and self.source.resume_error == LIB_MISMATCH

    def release_requested(self) -> bool:
        return self.release_file is not None and os.path.exists(self.release_file)

    def step(self, now: float) -> bool:
        """Act on a release request or a due re-initialisation; True when the source may be polled."""
        requested = self.release_requested()
        if self.released is None:
            if requested:
                if self._let_go():
                    self.released = "request"
                    self.reinits["request"] += 1
                    self.release_pending = None
                    self._logged_postponed = None
                    log.warning(
                        "NVML released on request: no GPU telemetry until %s is removed "
                        "(kernel-log XIDs still reported; /readyz answers 503 meanwhile)",
                        self.release_file,
                    )
                else:
                    self._postpone("release")
                    self.release_pending = self.refusal
                    self._restart_watcher()
                return self.released is None
            if self.release_pending is not None:
                log.info(
                    "NVML release request withdrawn (%s removed) before it could be done", self.release_file
                )
                self.release_pending = None
                self._logged_postponed = None
            self._restart_watcher()
            if self.source.reinit_due(now):
                if self._let_go():
                    self.source.reinit_tried(now)  # only a re-initialisation done doubles the back-off
                    self._logged_postponed = None
                    self.reinits["gpu_lost"] += 1
                    log.info(
                        "re-initialising NVML to see lost GPUs again",
                        extra={"fields": {"lost": [g.gpu_index for g in self.source.lost_gpus]}},
                    )
                    self.released = "failure"  # until taken again just below
                    self._take_again()
                else:
                    self._postpone("re-initialisation")
            return self.released is None
        if requested:
            return False
        self._take_again()
        return self.released is None

    def _let_go(self) -> bool:
        """Stop the watcher and release the source; False (nothing changed, :attr:`refusal` says
        why) while NVML must not or cannot be shut down: a GPU call in flight, an event wait stuck."""
        self.refusal = None
        if not self.source.can_suspend():
            self.refusal = GPU_CALL_IN_FLIGHT
            return False
        w = self.watcher
        if w is not None:
            if w.stuck:  # an earlier stop's wait has not returned: it holds an NVML reference
                self.refusal = EVENT_WAIT_STUCK
                return False
            if not w.stop():
                self._start_watcher()  # the healthy GPUs' events are watched again at once
                self.refusal = EVENT_WAIT_STUCK
                return False
        if self.source.suspend():
            return True
        self._start_watcher()  # (cannot happen: checked above on this thread) keep events flowing
        self.refusal = GPU_CALL_IN_FLIGHT
        return False

    def _postpone(self, what: str) -> None:
        reason = self.refusal or GPU_CALL_IN_FLIGHT
        self.postponed[reason] += 1
        if self._logged_postponed == (what, reason):
            return
        self._logged_postponed = (what, reason)
        why = (
            f"the NVML event wait of GPUs {self.watcher.stuck} has not returned"
            if reason == EVENT_WAIT_STUCK and self.watcher is not None
            else "a GPU's NVML call has not returned (see gpupipe_producer_nvml_stalled_gpus)"
        )
        log.warning(
            "NVML %s postponed: %s; NVML cannot be shut down under it. Retried every tick%s",
            what,
            why,
            " (/readyz: nvml_release_pending)" if what == "release" else "",
            extra={"fields": {"reason": reason}},
        )

    def _restart_watcher(self) -> None:
        """A watcher that could not start after NVML was taken again is tried again each tick."""
        w = self.watcher
        if w is not None and not w.started and not w.stuck:
            self._start_watcher()

    def _start_watcher(self) -> None:
        w = self.watcher
        if w is None:
            return
        try:
            w.start()
        except NvmlSourceError as exc:
            kind = type(exc.__cause__ or exc).__name__
            if self._on_watcher_error is not None:
                self._on_watcher_error("event_set")
            if self._watcher_error != kind:
                self._watcher_error = kind
                log.warning(
                    "NVML XID events unavailable after re-initialisation (retried every tick): %s", exc
                )
            return
        if self._watcher_error is not None and w.started:
            self._watcher_error = None
            log.info("NVML XID events are watched again")

    def _take_again(self) -> None:
        if not self.source.resume():
            kind = self.source.resume_error or "unknown"
            self.resume_failures[kind] += 1
            if self._logged_error != kind:
                self._logged_error = kind
                log.error(
                    "NVML cannot be initialised again (%s); no GPU telemetry until it can%s",
                    kind,
                    "; the driver changed under the agent: restart needed (liveness fails)"
                    if kind == LIB_MISMATCH
                    else " (retried every tick)",
                )
            self.released = "failure"
            return
        if self.released == "request" or self._logged_error:
            log.info("NVML taken again", extra={"fields": {"gpus": len(self.source.gpus())}})
        self.released = None
        self._logged_error = None
        self._start_watcher()
