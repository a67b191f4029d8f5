"""dcgm-exporter's exporter-derived families from GpuSample and XidEvent data (pure: no I/O, no clock).

dcgm-exporter computes a few ``DCGM_EXP_*`` families itself instead of reading one DCGM field;
this module holds their facts and the small state they need, so that the store stays a store:

* ``DCGM_EXP_XID_ERRORS_COUNT{window_size_in_ms, xid}``: XIDs per code whose time lies in the
  last ``--xid-count-window-size`` ms (default 5 min), counted at scrape time; a GPU with none
  in the window has one series with the ``window_size_in_ms`` label only and value 0
  (dcgm-exporter ``expcollector.go``).
* ``DCGM_EXP_CLOCK_EVENTS_COUNT{clock_event, window_size_in_ms}``: for each clock-event bit,
  the number of samples in the window that had it set (dcgm-exporter counts DCGM's samples of
  ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` the same way; ours come at the node agent's interval).
* ``DCGM_EXP_CLOCK_EVENTS_TOTAL{clock_event}``: a counter of rising edges per bit (4.8.3's
  "edge-counted" total): a bit that is set in a sample and was not in the GPU's previous one.
* ``DCGM_EXP_GPU_HEALTH_STATUS{health_error_code, health_watch}``: one series per DCGM health
  watch dcgm-exporter exports (PCIE ... DRIVER, ALL), value 0 pass, 10 warn, 20 fail (DCGM's
  ``dcgmHealthWatchResult_t``), from the health signals a GpuSample carries (see
  :func:`sample_health`): MEM, THERMAL, POWER and ALL. PCIE, NVLINK, PMU, MCU, SM, INFOROM and
  DRIVER have no signal in a GpuSample, so no check of them runs: they have no series (listed once
  in ``gpupipe_metrics_health_watch_not_run``) rather than a pass, which told an NVLink or PCIe
  alert or dashboard that a check nobody ran had passed.
* ``err_code``/``err_msg`` of ``DCGM_FI_DEV_XID_ERRORS``: the code and dcgm-exporter's text for it
  (``"No Error"`` for 0, ``"Unknown Error"`` past its table), see :func:`xid_message`.

Clock-event names are DCGM's (``dcgmi`` command-line names): bit 0x1 ``gpu_idle``, 0x2
``clocks_setting``, 0x4 ``power_cap``, 0x8 ``hw_slowdown``, 0x10 ``sync_boost``, 0x20
``sw_thermal``, 0x40 ``hw_thermal``, 0x80 ``hw_power_brake``, 0x100 ``display_clocks``.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

CLOCK_EVENTS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "clocks_setting"),
    (0x4, "power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
    (0x100, "display_clocks"),
)
CLOCK_EVENT_NAME = dict(CLOCK_EVENTS)
_CLOCK_MASK = sum(b for b, _ in CLOCK_EVENTS)

#: DCGM health watches dcgm-exporter exports, in its order (gpu_health_collector.go).
HEALTH_WATCHES = ("PCIE", "NVLINK", "PMU", "MCU", "MEM", "SM", "INFOROM", "THERMAL", "POWER", "DRIVER", "ALL")
#: The watches our health signals answer; the others are not run (see the module docstring).
RUN_WATCHES = ("MEM", "THERMAL", "POWER", "ALL")
NOT_RUN_WATCHES = tuple(w for w in HEALTH_WATCHES if w not in RUN_WATCHES)
PASS, WARN, FAIL = 0, 10, 20  # dcgmHealthWatchResult_t
OK_CODE = "DCGM_FR_OK"
_RECOVERY_CODES = {
    1: "DCGM_FR_GPU_RECOVERY_RESET",
    2: "DCGM_FR_GPU_RECOVERY_REBOOT",
    3: "DCGM_FR_GPU_RECOVERY_DRAIN_P2P",
    4: "DCGM_FR_GPU_RECOVERY_DRAIN_RESET",
    # R615's bus reset and system reboot: DCGM's nearest codes (a healthy PASS would hide them)
    6: "DCGM_FR_GPU_RECOVERY_RESET",
    7: "DCGM_FR_GPU_RECOVERY_REBOOT",
}
FATAL_XIDS = {79: "DCGM_FR_FALLEN_OFF_BUS", 95: "DCGM_FR_UNCONTAINED_ERROR"}

Health = tuple[tuple[str, int, str], ...]  # (watch, value, error code) per watch
ALL_PASS: Health = tuple((w, PASS, OK_CODE) for w in RUN_WATCHES)


def clock_bits(mask: int | None) -> tuple[int, ...]:
    """The known clock-event bits set in a bitmask (unknown bits are ignored, as dcgm-exporter)."""
    if not mask or mask < 0:
        return ()
    m = mask & _CLOCK_MASK
    return tuple(b for b, _ in CLOCK_EVENTS if m & b)


XID_MESSAGES_RESOURCE = "dcgm-xid-messages.json"


@lru_cache(maxsize=1)
def _xid_messages() -> tuple[tuple[str, ...], str]:
    doc = json.loads(
        resources.files("gpupipe_consumers.metrics").joinpath(XID_MESSAGES_RESOURCE).read_text("utf-8")
    )
    return tuple(doc["messages"]), doc["unknown"]


def xid_message(code: int) -> str:
    """``err_msg`` for an XID code: dcgm-exporter's own text (its ``xid_errors.go`` table, copied as
    data in ``dcgm-xid-messages.json``), ``"Unknown Error"`` outside it, as dcgm-exporter prints.

    Not gpupipe's XID catalog: its descriptions differ for most codes, and rules or annotations
    written against dcgm-exporter match on these exact strings."""
    messages, unknown = _xid_messages()
    return messages[code] if 0 <= code < len(messages) else unknown


def sample_health(rec: Mapping[str, Any]) -> Health:
    """Health per watch from one sample's health fields: MEM, THERMAL, POWER and ALL only (the
    watches with a signal; the others are not run, so not reported).

    MEM: volatile DBE count > 0 or a failed row remap fail; pending page retirement or row remap
    warn. THERMAL: the HW thermal slowdown clock event warns. POWER: the HW power-brake clock event
    warns. ALL: a lost GPU (XID 79) or a recovery action other than none fails."""
    mem = (PASS, OK_CODE)
    if rec.get("row_remap_failure"):
        mem = (FAIL, "DCGM_FR_ROW_REMAP_FAILURE")
    elif (rec.get("ecc_dbe_volatile_total") or 0) > 0:
        mem = (FAIL, "DCGM_FR_VOLATILE_DBE_DETECTED")
    elif rec.get("row_remap_pending"):
        mem = (WARN, "DCGM_FR_PENDING_ROW_REMAP")
    elif rec.get("retired_pages_pending"):
        mem = (WARN, "DCGM_FR_PENDING_PAGE_RETIREMENTS")
    reasons = rec.get("clock_event_reasons") or 0
    thermal = (WARN, "DCGM_FR_CLOCK_THROTTLE_THERMAL") if reasons & 0x40 else (PASS, OK_CODE)
    power = (WARN, "DCGM_FR_CLOCK_THROTTLE_POWER") if reasons & 0x80 else (PASS, OK_CODE)
    everything = (PASS, OK_CODE)
    action = rec.get("gpu_recovery_action")
    if rec.get("gpu_lost"):
        everything = (FAIL, FATAL_XIDS[79])
    elif action in _RECOVERY_CODES:
        everything = (FAIL, _RECOVERY_CODES[action])
    by = {"MEM": mem, "THERMAL": thermal, "POWER": power, "ALL": everything}
    return tuple((w, *by[w]) for w in HEALTH_WATCHES if w in by)


def with_fatal_xids(health: Health, window_codes: Iterable[int]) -> Health:
    """ALL fails while XID 79 or 95 is in the XID window (DCGM reports them under ALL)."""
    for code, fr in FATAL_XIDS.items():
        if code in window_codes:
            return tuple((w, FAIL, fr) if w == "ALL" and v != FAIL else (w, v, c) for w, v, c in health)
    return health


def add_counts(a: Mapping[int, int], b: Mapping[int, int]) -> Mapping[int, int]:
    """Counts per code of two sources (a MIG instance's own and its GPU's); ``a`` itself when ``b``
    is empty, so the usual case copies nothing."""
    if not b:
        return a
    out = dict(b)
    for k, n in a.items():
        out[k] = out.get(k, 0) + n
    return out


class WindowCounts:
    """Counts per key of the events whose time lies in a sliding window (push in any order)."""

    __slots__ = ("counts", "events", "window_ms")

    def __init__(self, window_ms: int) -> None:
        self.window_ms = window_ms
        self.events: deque[tuple[int, tuple[int, ...]]] = deque()
        self.counts: dict[int, int] = {}

    def push(self, ts_ms: int, keys: tuple[int, ...], now_ms: int | None = None) -> bool:
        """Add one event carrying ``keys``; False when it is already outside the window."""
        if not keys or (now_ms is not None and ts_ms <= now_ms - self.window_ms):
            return False
        ev = self.events
        if ev and ts_ms < ev[-1][0]:  # out of order (rare): keep the deque sorted
            items = sorted([*ev, (ts_ms, keys)], key=lambda e: e[0])
            ev.clear()
            ev.extend(items)
        else:
            ev.append((ts_ms, keys))
        c = self.counts
        for k in keys:
            c[k] = c.get(k, 0) + 1
        return True

    def prune(self, now_ms: int) -> bool:
        """Drop events at or before ``now_ms - window``; True when a count changed."""
        cutoff = now_ms - self.window_ms
        ev, c = self.events, self.counts
        changed = False
        while ev and ev[0][0] <= cutoff:
            _, keys = ev.popleft()
            for k in keys:
                n = c[k] - 1
                if n:
                    c[k] = n
                else:
                    del c[k]
            changed = True
        return changed

    def next_expiry_ms(self) -> int | None:
        """Wall time (ms) at which the oldest event leaves the window, None when empty."""
        return self.events[0][0] + self.window_ms if self.events else None
