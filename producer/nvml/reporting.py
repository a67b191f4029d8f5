"""How an :class:`~producer.nvml.source.NvmlSource` reports what its device contexts see, and
how its interval settings are checked (split out of source.py, which is about polling).

Errors are counted and logged at most once a minute per kind; garbage values are counted; a call
learned unanswerable is counted per (call, reason) through the source's hooks, and a refusal that
means missing rights or an old binding (NoPermission, FunctionNotFound) is one WARNING per call.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpupipe.errors import ConfigError
from producer.nvml.base import DeviceContext

log = logging.getLogger("gpupipe.nvml")


class SourceReporter:
    """The ``Reporter`` every DeviceContext of one source reports to."""

    __slots__ = ("_src",)

    def __init__(self, src: Any) -> None:
        """``src``: the :class:`producer.nvml.source.NvmlSource` (not imported: it imports us)."""
        self._src = src

    def error(self, kind: str) -> None:
        src = self._src
        src.error_counts[kind] += 1
        src._log_error(kind, f"NVML error {kind}")
        src._hook("nvml_error", kind)

    def garbage(self, field: str) -> None:
        src = self._src
        src.garbage_counts[field] += 1
        src._log_error(f"garbage:{field}", f"NVML returned an impossible value for {field}; sent as null")
        src._hook("garbage", field)

    def learned(self, ctx: DeviceContext, key: str, reason: str) -> None:
        src = self._src
        kind = reason.split(":", 1)[0].removeprefix("NVMLError_") or "unknown"
        if "missing from the NVML binding" in reason:
            kind = "FunctionNotFound"
        call = key.split(":", 1)[0]
        src._hook("unsupported", call, kind)
        if kind in ("NotSupported", "InvalidArgument", "NotFound"):
            # Expected on most GPUs (ECC off, no NVLink, pre-Hopper...): "no data", not a failure.
            log.debug("GPU %d: %s unsupported (%s); not asked again", ctx.index, key, reason)
            return
        # A configuration problem (no rights, a binding too old): say so once per call.
        if (call, kind) not in src._warned_unsupported:
            src._warned_unsupported.add((call, kind))
            log.warning(
                "GPU %d: NVML refused %s (%s); its fields stay null on every GPU where this repeats. "
                "See gpupipe_producer_nvml_unsupported_total{call,reason}",
                ctx.index,
                key,
                reason,
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
