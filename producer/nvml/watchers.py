"""The node's NVML event watchers as one: legacy XID events and GPU Operational Events.

The agent and :mod:`gpupipe_producer.agent.nvml_control` start, stop and inspect "the watcher" (``start``,
``stop``, ``started``, ``stuck``, ``dead``); :class:`WatcherPair` gives them both watchers behind that
surface, so a release of NVML (``nvidia-smi -r``) stops both and each gives its NVML reference back.
The legacy watcher decides ``started`` and answers every other attribute (``registered``, ``failing``,
``unsupported``, ``delivery_counts``... describe the XID event sets, as before); the operational one
never makes a start fail (a driver without operational events is an answer, not an error).
"""

from __future__ import annotations

import logging

from gpupipe_producer.nvml.errors import NvmlSourceError
from gpupipe_producer.nvml.events import XidEventWatcher
from gpupipe_producer.nvml.operational import OperationalEventWatcher

log = logging.getLogger("gpupipe.nvml.events")


class WatcherPair:
    """``legacy`` and ``operational`` started, stopped and reported together."""

    def __init__(self, legacy: XidEventWatcher, operational: OperationalEventWatcher) -> None:
        self.legacy = legacy
        self.operational = operational

    def __getattr__(self, name: str) -> object:
        return getattr(self.legacy, name)

    def start(self) -> None:
        self.legacy.start()  # NvmlSourceError propagates: the caller falls back to the kernel log
        try:
            self.operational.start()
        except NvmlSourceError as exc:
            log.warning("GPU operational events not watched: %s", exc)

    def stop(self, timeout_s: float | None = None) -> bool:
        clean = self.legacy.stop(timeout_s)
        return self.operational.stop(timeout_s) and clean

    @property
    def started(self) -> bool:
        return self.legacy.started

    @property
    def stuck(self) -> list[int]:
        return sorted(set(self.legacy.stuck) | set(self.operational.stuck))

    @property
    def dead(self) -> list[int]:
        return sorted(set(self.legacy.dead) | set(self.operational.dead))
