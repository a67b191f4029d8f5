"""When the node agent lets go of NVML and when it takes it again (the polling thread's job).

Two reasons to let go, one way back:

* **A GPU is lost.** An initialised NVML rarely sees a GPU come back after a fall off the bus, a
  reset or a rebind; a new NVML session does. So while a GPU is lost, the agent re-initialises
  NVML ``--nvml-reinit-after`` (60 s) after the loss and then with a doubling back-off up to an
  hour (:meth:`NvmlSource.reinit_due <producer.nvml.session.SourceSession.reinit_due>`): the event
  watcher is stopped (its sets drained, so no queued XID is dropped), the source shuts NVML down
  (every holder gone: a real ``nvmlShutdown``), inits again and re-enumerates, the watcher starts
  again. Telemetry of the other GPUs misses at most the tick it happens in; kernel-log XIDs are
  read throughout.
* **An operator asks**: while the file ``--nvml-release-file`` (default
  ``<spool-dir>/nvml-release``, on the host under the spool's hostPath) exists, the agent holds no
  NVML session and no device file, so ``nvidia-smi -r`` or the GPU Operator's driver upgrade can
  proceed. Meanwhile no GpuSample is published, ``/readyz`` answers 503 (``nvml_released``)
  while ``/healthz`` (liveness) stays 200, and ``gpupipe_producer_nvml_released`` is 1; the kernel
  log still reports XIDs. Removing the file takes NVML again (retried every tick until ``nvmlInit``
  works, e.g. once the new driver is loaded).

When NVML cannot be initialised again because the driver was upgraded under the running process
(``NVMLError_LibRmVersionMismatch``: the library this process loaded no longer matches the kernel
module), only a restart loads the new library: :attr:`NvmlControl.needs_restart` turns
``/healthz`` unhealthy, so the kubelet's liveness probe restarts the pod.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

from producer.nvml.errors import NvmlSourceError

log = logging.getLogger("gpupipe.agent")

LIB_MISMATCH = "NVMLError_LibRmVersionMismatch"


class NvmlControl:
    """Drives :class:`producer.nvml.source.NvmlSource` and its event watcher through releases and
    re-initialisations. :meth:`step` runs on the polling thread before each tick."""

    def __init__(self, source: Any, watcher: Any | None, release_file: str | None) -> None:
        self.source = source
        self.watcher = watcher
        self.release_file = release_file or None
        #: None while NVML is held; "request" (the release file) or "failure" (could not init).
        self.released: str | None = None
        #: Re-initialisations and releases done, by reason (``gpu_lost``, ``request``).
        self.reinits: Counter[str] = Counter()
        #: Failed attempts to take NVML again, by NVML error class.
        self.resume_failures: Counter[str] = Counter()
        self._logged_error: str | None = None

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
                    log.warning(
                        "NVML released on request: no GPU telemetry until %s is removed "
                        "(kernel-log XIDs still reported; /readyz answers 503 meanwhile)",
                        self.release_file,
                    )
                return self.released is None
            if self.source.reinit_due(now):
                self.source.reinit_tried(now)
                if self._let_go():
                    self.reinits["gpu_lost"] += 1
                    log.info(
                        "re-initialising NVML to see lost GPUs again",
                        extra={"fields": {"lost": [g.gpu_index for g in self.source.lost_gpus]}},
                    )
                    self.released = "failure"  # until taken again just below
                    self._take_again()
            return self.released is None
        if requested:
            return False
        self._take_again()
        return self.released is None

    def _let_go(self) -> bool:
        """Stop the watcher and release the source; False (nothing changed) while a GPU call is in
        flight: NVML must not be shut down under it."""
        if not self.source.can_suspend():
            return False
        w = self.watcher
        if w is not None and not w.stop():
            log.error("an NVML event thread is stuck in NVML: NVML is not fully released")
        if self.source.suspend():
            return True
        self._start_watcher()  # (cannot happen: checked above on this thread) keep events flowing
        return False

    def _start_watcher(self) -> None:
        w = self.watcher
        if w is not None:
            try:
                w.start()
            except NvmlSourceError as exc:
                log.warning("NVML XID events unavailable after re-initialisation: %s", exc)

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
