"""Per-link NVLink health from the counters of ``GpuSample.nvlink_link_counters``: a state per
(host, GPU, link) that turns ``degrading`` on a *sustained* rise of the link's error counters, before
the link fails (pure: times come with the samples, no clock, no I/O).

Contract. :meth:`LinkHealthTracker.observe` takes one GPU's sample time and its per-link counters and
returns the :class:`LinkChange` s it caused. The counters are cut into windows of
``window_ms`` (DCGM's NVLink health watch also judges one minute). A window is *bad* when any error
counter of the link rose in it. States:

* ``healthy`` -> ``degrading``: ``degrade_windows`` bad windows among the last ``history_windows``, or
  ``recoveries_to_degrade`` link recoveries (retrainings) in them: the predictive warning;
* any -> ``failed``: DCGM's FAIL condition for NVLink (CRC errors at ``crc_fail_per_s`` per second or
  more over a window), the link leaving the active state, or a failed link recovery;
* ``degrading`` / ``failed`` -> ``healthy``: ``clear_windows`` clean windows in a row (hysteresis; a
  link that is down stays failed until it is up and clean).

A counter that goes down (driver reload, GPU reset, ``nvmlDeviceResetNvLinkErrorCounters``) starts
the link over from that value: the window is dropped, never read as a rise. Thresholds, their source
and the measured false-alarm rate and lead time: docs/alerts.md, "NVLink link health".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ERROR_COUNTERS",
    "LinkChange",
    "LinkHealthConfig",
    "LinkHealthTracker",
    "LinkState",
]

LinkState = Literal["healthy", "degrading", "failed"]

#: Counters of one link whose rise is an error (NVLink up to 4: CRC, replay, recovery; NVLink 5:
#: receive and symbol errors). ``recovery_failed`` is read apart: one is a failure.
ERROR_COUNTERS = ("crc_flit", "crc_data", "replay", "recovery", "rcv", "symbol")
CRC_COUNTERS = ("crc_flit", "crc_data")
MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS
RECOVERY_COUNTERS = ("recovery",)


@dataclass(frozen=True, slots=True)
class LinkHealthConfig:
    window_ms: int = 60_000
    """One window: DCGM's health watch reads its NVLink counters over the last minute."""
    history_windows: int = 8
    degrade_windows: int = 5
    """Bad windows among the last ``history_windows`` that make a link degrading (sustained: a single
    CRC burst, as healthy links show now and then, is one bad window)."""
    recoveries_to_degrade: int = 2
    """Link recoveries (retraining, each a stall of the link's traffic) among the last
    ``history_windows`` windows that make it degrading on their own."""
    crc_fail_per_s: float = 100.0
    """DCGM_LIMIT_MAX_NVLINK_CRC_ERROR: CRC errors per second at which DCGM's watch FAILs the link."""
    clear_windows: int = 15
    """Clean windows in a row that bring a degrading or failed link back to healthy."""

    def __post_init__(self) -> None:
        if self.window_ms <= 0 or self.crc_fail_per_s <= 0:
            raise ValueError("window_ms and crc_fail_per_s must be positive")
        if not 1 <= self.degrade_windows <= self.history_windows:
            raise ValueError("degrade_windows must be between 1 and history_windows")
        if self.recoveries_to_degrade < 1 or self.clear_windows < 1:
            raise ValueError("recoveries_to_degrade and clear_windows must be at least 1")


@dataclass(frozen=True, slots=True)
class LinkChange:
    """A link's state changed at ``ts_ms`` (the sample that closed the deciding window)."""

    hostname: str
    device: str
    link: int
    state: LinkState
    previous: LinkState
    ts_ms: int
    since_ms: int
    """When the evidence began: the first bad window counted (degrading), the failing window's start."""
    peer: str | None
    reason: str


COUNTERS = (*ERROR_COUNTERS, "recovery_failed")
_ERR = tuple(COUNTERS.index(k) for k in ERROR_COUNTERS)
_CRC = tuple(COUNTERS.index(k) for k in (*CRC_COUNTERS, "rcv"))
_RECOV = tuple(COUNTERS.index(k) for k in RECOVERY_COUNTERS)
_FAILED_RECOV = COUNTERS.index("recovery_failed")

Counters = tuple[int | None, ...]
"""A link's counters in :data:`COUNTERS` order (None: not reported): a tuple, not a dict, because a
fleet has hundreds of thousands of links."""


@dataclass(slots=True)
class _Link:
    start_ms: int
    base: Counters
    state: LinkState = "healthy"
    peer: str | None = None
    windows: int = 0
    """Windows closed so far: the history is the last ``history_windows`` of them."""
    bads: tuple[tuple[int, int], ...] = ()
    """(window number, start) of the bad windows in the history (empty for a clean link: no allocation)."""
    recovs: tuple[tuple[int, int], ...] = ()
    """(window number, link recoveries) of the windows in the history that had some."""
    clean_run: int = 0
    down: bool = False
    since_ms: int = 0
    reason: str = ""


def _counters(entry: Mapping[str, Any]) -> Counters:
    out: list[int | None] = []
    for name in COUNTERS:
        v = entry.get(name)
        out.append(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None)
    return tuple(out)


class LinkHealthTracker:
    """Link states of every GPU seen; see the module doc."""

    def __init__(self, config: LinkHealthConfig | None = None) -> None:
        self.cfg = config or LinkHealthConfig()
        self._links: dict[tuple[str, str, int], _Link] = {}
        self._assumed: dict[tuple[str, str, int], LinkState] = {}
        self.resets = 0

    def __len__(self) -> int:
        return len(self._links)

    def state(self, hostname: str, device: str, link: int) -> LinkState | None:
        st = self._links.get((hostname, device, link))
        return None if st is None else st.state

    def assume(self, hostname: str, device: str, link: int, state: LinkState) -> None:
        """Start a link not seen yet in ``state`` (an alert restored open after a restart): it then needs
        its clean windows to be healthy again, as if this tracker had never stopped."""
        if (hostname, device, link) not in self._links:
            self._assumed[(hostname, device, link)] = state

    def unhealthy(self, hostname: str, device: str) -> list[LinkChange]:
        """The GPU's links that are not healthy now, as the change that made them so."""
        return [
            LinkChange(h, d, link, st.state, st.state, st.since_ms, st.since_ms, st.peer, st.reason)
            for (h, d, link), st in self._links.items()
            if h == hostname and d == device and st.state != "healthy"
        ]

    def forget(self, hostname: str, device: str | None = None) -> None:
        """Drop the links of a host (or of one of its GPUs)."""
        for table in (self._links, self._assumed):
            for key in [k for k in table if k[0] == hostname and (device is None or k[1] == device)]:
                del table[key]

    def observe(
        self, hostname: str, device: str, ts_ms: int, links: Iterable[Mapping[str, Any]]
    ) -> list[LinkChange]:
        out: list[LinkChange] = []
        for entry in links:
            link = entry.get("link")
            if not isinstance(link, int) or isinstance(link, bool) or not 0 <= link < MAX_LINKS:
                continue  # not a link NVML can have: a forged sample must not grow the state
            change = self._one(hostname, device, link, ts_ms, entry)
            if change is not None:
                out.append(change)
        return out

    def _one(
        self, hostname: str, device: str, link: int, ts: int, entry: Mapping[str, Any]
    ) -> LinkChange | None:
        cfg = self.cfg
        now = _counters(entry)
        key = (hostname, device, link)
        st = self._links.get(key)
        if st is None:
            st = self._links[key] = _Link(start_ms=ts, base=now, peer=entry.get("peer"))
            st.state = self._assumed.pop(key, "healthy")
            return self._down(key, st, ts, entry)
        peer = entry.get("peer")
        if peer and peer != st.peer:  # keep the string held: one per link, not one per sample read
            st.peer = peer
        if ts < st.start_ms:
            return None  # older than the window under way: replayed input
        if any(n is not None and b is not None and n < b for n, b in zip(now, st.base, strict=True)):
            # a counter went down: the driver or someone reset them; start over from here
            self.resets += 1
            st.start_ms, st.base = ts, now
            return self._down(key, st, ts, entry)
        if any(b is None and n is not None for n, b in zip(now, st.base, strict=True)):
            # a counter first answered now: its first value is its base
            st.base = tuple(n if b is None else b for n, b in zip(now, st.base, strict=True))
        down = self._down(key, st, ts, entry)
        if down is not None:
            return down
        span = ts - st.start_ms
        if span < cfg.window_ms:
            return None
        delta = tuple(0 if n is None or b is None else n - b for n, b in zip(now, st.base, strict=True))
        start = st.start_ms
        st.start_ms, st.base = ts, now
        return self._close(key, st, start, span, delta, ts)

    def _down(
        self, key: tuple[str, str, int], st: _Link, ts: int, entry: Mapping[str, Any]
    ) -> LinkChange | None:
        """A link that is not up is failed at once (DCGM's watch: "NVLink link down")."""
        st.down = entry.get("up") is False
        if st.down and st.state != "failed":
            st.clean_run = 0
            return self._to(key, st, "failed", ts, ts, "link not active (NVML link state)")
        return None

    def _close(
        self, key: tuple[str, str, int], st: _Link, start: int, span: int, delta: Counters, ts: int
    ) -> LinkChange | None:
        cfg = self.cfg
        errors = sum(delta[i] or 0 for i in _ERR)
        recoveries = sum(delta[i] or 0 for i in _RECOV)
        crc = sum(delta[i] or 0 for i in _CRC)
        failed_recoveries = delta[_FAILED_RECOV] or 0
        st.windows += 1
        oldest = st.windows - cfg.history_windows
        if errors or (st.bads and st.bads[0][0] <= oldest):
            st.bads = tuple(b for b in st.bads if b[0] > oldest) + (((st.windows, start),) if errors else ())
        if recoveries or (st.recovs and st.recovs[0][0] <= oldest):
            st.recovs = tuple(r for r in st.recovs if r[0] > oldest) + (
                ((st.windows, recoveries),) if recoveries else ()
            )
        st.clean_run = 0 if errors or st.down or failed_recoveries else st.clean_run + 1
        per_s = crc * 1000.0 / span
        if failed_recoveries > 0 and st.state != "failed":
            return self._to(key, st, "failed", ts, start, f"{failed_recoveries} failed link recoveries")
        if per_s >= cfg.crc_fail_per_s and st.state != "failed":
            return self._to(
                key,
                st,
                "failed",
                ts,
                start,
                f"{per_s:.0f} CRC errors/s (DCGM fails at {cfg.crc_fail_per_s:g}/s)",
            )
        if st.state == "healthy":
            bad = len(st.bads)
            recov = sum(n for _, n in st.recovs)
            if bad >= cfg.degrade_windows or recov >= cfg.recoveries_to_degrade:
                first = st.bads[0][1] if st.bads else start
                seen = min(st.windows, cfg.history_windows)
                why = (
                    f"errors in {bad} of the last {seen} windows of {cfg.window_ms // 1000} s"
                    f" ({errors} in the latest), {recov} link recoveries"
                )
                return self._to(key, st, "degrading", ts, first, why)
        elif st.clean_run >= cfg.clear_windows:
            return self._to(key, st, "healthy", ts, ts, f"{st.clean_run} clean windows in a row")
        return None

    def _to(
        self, key: tuple[str, str, int], st: _Link, state: LinkState, ts: int, since: int, reason: str
    ) -> LinkChange:
        previous, st.state = st.state, state
        st.since_ms, st.reason = since, reason
        if state == "healthy":
            st.bads = st.recovs = ()
        st.clean_run = 0
        return LinkChange(key[0], key[1], key[2], state, previous, ts, since, st.peer, reason)
