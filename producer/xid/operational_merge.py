"""One record per incident when a GPU reports it both as a legacy Xid and as an operational event
(pure: no clock, no I/O).

NVIDIA's GPU Operational Events (driver R615+ preview) describe the same occurrence as the legacy
``NVRM: Xid`` line and NVML Xid event; an operational event that has a legacy equivalent carries that
Xid in a legacy-Xid context. :class:`OperationalMerger` sits after
:class:`~gpupipe_producer.xid.xid_merge.XidMerger` (which already pairs the NVML and kernel-log
sightings of an Xid) and pairs its output with the operational events:

* an operational event without a legacy Xid is released at once (nothing to pair);
* on a GPU registered for operational events (``capable``), a legacy Xid and an operational event
  naming the same Xid on the same GPU (canonical bus id) whose arrivals are less than ``window_s``
  apart become one :class:`Incident` holding both, released as soon as the second arrives; the first
  is held until then, or released alone once ``window_s`` has passed;
* a legacy sighting of a code that an incident already absorbed within ``window_s`` of its structured
  event (the kernel-log half the Xid merger released late) is dropped and counted in ``absorbed``;
* on a GPU not registered for operational events, legacy Xids pass through unheld, as before.

``window_s`` must exceed the Xid merger's own window: that merger may release the legacy half up to its
window after it arrived (:func:`window_for`). Times are monotonic seconds of arrival, passed in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe.domain.pci import canonical

__all__ = ["SLACK_S", "Incident", "OperationalMerger", "legacy_sources", "window_for"]

#: What the pairing window adds to the Xid merger's window (see :func:`window_for`).
SLACK_S = 0.5


def window_for(xid_merge_window_s: float) -> float:
    """The pairing window that still catches a legacy Xid the Xid merger held for its whole window."""
    return float(xid_merge_window_s) + SLACK_S


def _key_pci(bus_id: str | None) -> str:
    try:
        return canonical(bus_id or "")
    except ValueError:
        return (bus_id or "").strip().lower()


@dataclass(slots=True)
class Incident:
    """What to publish: the structured event, the legacy report, or both of one occurrence."""

    operational: Mapping[str, Any] | None = None
    legacy: Mapping[str, Any] | None = None


@dataclass(slots=True)
class _Held:
    seq: int
    side: str  # "legacy" or "operational"
    pci: str
    xid: int
    at_s: float
    item: Mapping[str, Any]


@dataclass(slots=True)
class _Absorbed:
    pci: str
    xid: int
    until_s: float


class OperationalMerger:
    """Pairs legacy Xids with operational events; see the module docstring for the rules."""

    def __init__(self, window_s: float, capable: Callable[[str], bool] = lambda _pci: False) -> None:
        if not window_s >= 0:
            raise ValueError("window_s must be >= 0")
        self.window_s = float(window_s)
        self.capable = capable  # canonical bus id -> registered for operational events
        self._held: list[_Held] = []
        self._absorbed: list[_Absorbed] = []
        self._seq = 0
        self.paired = 0
        self.absorbed = 0

    def __len__(self) -> int:
        return len(self._held)

    # -- input --------------------------------------------------------------------------------------
    def operational(self, event: Mapping[str, Any], at_s: float) -> list[Incident]:
        """One operational event (the watcher's dict: ``pci_bus_id``, ``legacy_xid``...)."""
        out = self.expire(at_s)
        xid = event.get("legacy_xid")
        if xid is None:
            out.append(Incident(operational=event))
            return out
        pci = _key_pci(event.get("pci_bus_id"))
        partner = self._take("legacy", pci, int(xid), at_s)
        if partner is None:
            self._hold("operational", pci, int(xid), at_s, event)
        else:
            out.append(self._pair(event, partner.item, pci, int(xid), at_s))
        return out

    def legacy(self, merged: Mapping[str, Any], at_s: float) -> list[Incident]:
        """One output of the Xid merger (``kind``, ``xid``, canonical ``pci_bus_id``, ``source``)."""
        out = self.expire(at_s)
        pci = _key_pci(merged.get("pci_bus_id"))
        xid = merged.get("xid")
        if merged.get("kind") == "sxid" or xid is None or not self.capable(pci):
            out.append(Incident(legacy=merged))
            return out
        xid = int(xid)
        for a in self._absorbed:
            if a.pci == pci and a.xid == xid:
                self.absorbed += 1
                return out
        partner = self._take("operational", pci, xid, at_s)
        if partner is None:
            self._hold("legacy", pci, xid, at_s, merged)
        else:
            out.append(self._pair(partner.item, merged, pci, xid, partner.at_s))
        return out

    # -- time -----------------------------------------------------------------------------------------
    def expire(self, now_s: float) -> list[Incident]:
        """Release, alone, what was held ``window_s`` or longer (oldest first)."""
        self._absorbed = [a for a in self._absorbed if a.until_s > now_s]
        due = [h for h in self._held if now_s - h.at_s >= self.window_s]
        if not due:
            return []
        self._held = [h for h in self._held if now_s - h.at_s < self.window_s]
        return [_alone(h) for h in sorted(due, key=lambda h: (h.at_s, h.seq))]

    def flush(self) -> list[Incident]:
        """Release everything held, alone (shutdown)."""
        held, self._held = sorted(self._held, key=lambda h: (h.at_s, h.seq)), []
        return [_alone(h) for h in held]

    def oldest(self) -> float:
        """Arrival of the oldest held sighting (``inf`` when none)."""
        return min((h.at_s for h in self._held), default=math.inf)

    def held_field_min(self, key: str) -> Any:
        """The smallest non-null ``item[key]`` among held legacy sightings (the kernel-log cursor must
        not pass one: it is not spooled yet)."""
        vals = [h.item.get(key) for h in self._held if h.side == "legacy"]
        return min((v for v in vals if v is not None), default=None)

    # -- internals ------------------------------------------------------------------------------------
    def _hold(self, side: str, pci: str, xid: int, at_s: float, item: Mapping[str, Any]) -> None:
        self._seq += 1
        self._held.append(_Held(self._seq, side, pci, xid, float(at_s), item))

    def _take(self, side: str, pci: str, xid: int, at_s: float) -> _Held | None:
        for h in self._held:  # oldest first: held in arrival order
            if h.side == side and h.pci == pci and h.xid == xid and abs(at_s - h.at_s) < self.window_s:
                self._held.remove(h)
                return h
        return None

    def _pair(
        self, operational: Mapping[str, Any], legacy: Mapping[str, Any], pci: str, xid: int, op_at_s: float
    ) -> Incident:
        self.paired += 1
        self._absorbed.append(_Absorbed(pci, xid, op_at_s + self.window_s))
        return Incident(operational=operational, legacy=legacy)


def _sources(merged: Mapping[str, Any]) -> list[str]:
    """The legacy reports behind one Xid merger output: ``nvml``, ``kmsg`` or both."""
    source = str(merged.get("source") or "")
    return [s for s in ("nvml", "kmsg") if s in source.split("+")]


def legacy_sources(merged: Mapping[str, Any] | None) -> list[str]:
    """What a paired record lists in ``operational.legacy_sources``."""
    return [] if merged is None else _sources(merged)


def _alone(h: _Held) -> Incident:
    return Incident(operational=h.item) if h.side == "operational" else Incident(legacy=h.item)
