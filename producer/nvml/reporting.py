"""What an :class:`~gpupipe_producer.nvml.source.NvmlSource` tells about itself: its counters, its log
lines and its hooks, in one place that every device context of the source reports to.

Errors are counted and logged at most once a minute per kind; garbage values are counted; a call
learned unanswerable is counted per (call, reason) through the hooks, and a refusal that means
missing rights or an old binding or driver (NoPermission, FunctionNotFound, a version mismatch, a
function the binding lacks) is one WARNING per call key, the first time. A hook that raises is
logged and swallowed: the source's own telemetry must never stop a poll.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from gpupipe.common.errors import ConfigError
from gpupipe_producer.nvml.base import DeviceContext
from gpupipe_producer.nvml.learned import BINDING_MISSING, RETRY_KINDS, refusal_kind
from gpupipe_producer.nvml.records import GpuRef, LostGpu

log = logging.getLogger("gpupipe.nvml")

ERROR_LOG_INTERVAL_S = 60.0


class SourceHooks:
    """The source's own telemetry. Subclass and override what you need; all no-ops here.

    Called on the polling thread; an exception raised by a hook is logged and swallowed.
    """

    def collect_duration(self, group: str, seconds: float) -> None:
        """Wall time one group took over all GPUs in one poll."""

    def nvml_error(self, kind: str) -> None:
        """One NVML error that is not "unsupported" (kind: the error class, ``NVMLError_Unknown``)."""

    def garbage(self, field: str) -> None:
        """NVML returned a value that cannot be real for ``field``; the field is null instead."""

    def collector_failure(self, group: str, exc: BaseException) -> None:
        """A collector raised something other than an NVML error (a bug); its group is null."""

    def gpu_lost(self, lost: LostGpu) -> None:
        """NVML reported a GPU lost; once per loss."""

    def gpu_recovered(self, gpu: GpuRef) -> None:
        """A GPU reported lost answers NVML again."""

    def unsupported(self, call: str, reason: str) -> None:
        """A call was learned as unanswerable on one device; ``reason`` is the NVML error class
        without its prefix (``NotSupported``, ``NoPermission``, ``FunctionNotFound``...)."""


class SourceReporter:
    """The source's counters and hooks; the ``Reporter`` of every DeviceContext of one source.

    ``clock`` is the source's poll time: log lines are limited per kind on it.
    """

    def __init__(self, hooks: SourceHooks, clock: Callable[[], float]) -> None:
        self.hooks = hooks
        self._clock = clock
        self.error_counts: Counter[str] = Counter()
        self.garbage_counts: Counter[str] = Counter()
        self.collector_failures: Counter[str] = Counter()
        self._error_logged: dict[str, float] = {}
        self._warned_unsupported: set[tuple[str, str]] = set()

    def hook(self, name: str, *args: Any) -> None:
        try:
            getattr(self.hooks, name)(*args)
        except Exception as exc:
            log.warning("NVML source hook %s failed: %r", name, exc)

    def log_error(self, kind: str, message: str, exc: BaseException | None = None) -> None:
        now = self._clock()
        last = self._error_logged.get(kind)
        if last is None or now - last >= ERROR_LOG_INTERVAL_S:
            self._error_logged[kind] = now
            log.warning(
                "%s (logged at most once per %ds per kind)", message, ERROR_LOG_INTERVAL_S, exc_info=exc
            )

    def nvml_error(self, kind: str) -> None:
        """An NVML error the source met itself (opening a GPU, a lost GPU, a stalled call)."""
        self.error_counts[kind] += 1
        self.hook("nvml_error", kind)

    def collector_failure(self, group: str, message: str, exc: BaseException) -> None:
        self.collector_failures[group] += 1
        self.log_error(f"collector:{group}", message, exc)
        self.hook("collector_failure", group, exc)

    # -- Reporter (DeviceContext) ---------------------------------------------------------------
    def error(self, kind: str) -> None:
        self.error_counts[kind] += 1
        self.log_error(kind, f"NVML error {kind}")
        self.hook("nvml_error", kind)

    def garbage(self, field: str) -> None:
        self.garbage_counts[field] += 1
        self.log_error(f"garbage:{field}", f"NVML returned an impossible value for {field}; sent as null")
        self.hook("garbage", field)

    def learned(self, ctx: DeviceContext, key: str, reason: str) -> None:
        kind = refusal_kind(reason)
        call = key.split(":", 1)[0]
        self.hook("unsupported", call, kind)
        if kind not in RETRY_KINDS and kind != BINDING_MISSING:
            # Expected on most GPUs (ECC off, no NVLink, pre-Hopper...): "no data", not a failure.
            log.debug("GPU %d: %s unsupported (%s); not asked again", ctx.index, key, reason)
            return
        # A configuration problem (no rights, a binding or driver too old): say so once per key,
        # so "the agent lacks rights" never passes for "this GPU has no such counter".
        if (key, kind) in self._warned_unsupported:
            log.debug("GPU %d: NVML still refuses %s (%s)", ctx.index, key, reason)
            return
        self._warned_unsupported.add((key, kind))
        again = (
            f"asked again every {ctx.unsupported.retry_s:.0f}s or more"
            if kind in RETRY_KINDS
            else "not asked again until the agent restarts"
        )
        log.warning(
            "GPU %d: NVML refused %s (%s); its fields stay null meanwhile (%s). "
            "See gpupipe_producer_nvml_learned{call,reason}",
            ctx.index,
            key,
            reason,
            again,
        )


def check_intervals(intervals: Mapping[str, float] | None, defaults: Mapping[str, float]) -> dict[str, float]:
    out = dict(defaults)
    for key, value in (intervals or {}).items():
        if key not in defaults:
            raise ConfigError(f"unknown NVML interval {key!r}; known: {sorted(defaults)}")
        try:
            seconds = float(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"NVML interval {key!r} must be a number of seconds, got {value!r}") from exc
        if not seconds > 0:
            raise ConfigError(f"NVML interval {key!r} must be positive, got {value!r}")
        out[key] = seconds
    return out
