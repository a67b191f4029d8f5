"""How an :class:`~producer.nvml.source.NvmlSource` reports what its device contexts see, and
how its interval settings are checked (split out of source.py, which is about polling).

Errors are counted and logged at most once a minute per kind; garbage values are counted; a call
learned unanswerable is counted per (call, reason) through the source's hooks, and a refusal that
means missing rights or an old binding or driver (NoPermission, FunctionNotFound, a version
mismatch, a function the binding lacks) is one WARNING per call key, the first time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpupipe.errors import ConfigError
from producer.nvml.base import DeviceContext
from producer.nvml.learned import BINDING_MISSING, RETRY_KINDS, refusal_kind

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
        kind = refusal_kind(reason)
        call = key.split(":", 1)[0]
        src._hook("unsupported", call, kind)
        if kind not in RETRY_KINDS and kind != BINDING_MISSING:
            # Expected on most GPUs (ECC off, no NVLink, pre-Hopper...): "no data", not a failure.
            log.debug("GPU %d: %s unsupported (%s); not asked again", ctx.index, key, reason)
            return
        # A configuration problem (no rights, a binding or driver too old): say so once per key,
        # so "the agent lacks rights" never passes for "this GPU has no such counter".
        if (key, kind) in src._warned_unsupported:
            log.debug("GPU %d: NVML still refuses %s (%s)", ctx.index, key, reason)
            return
        src._warned_unsupported.add((key, kind))
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
