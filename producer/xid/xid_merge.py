"""Merge one Xid seen by both NVML and the kernel log into one event (pure: no clock, no I/O).

:class:`XidMerger` holds the first sighting of ``(bus id, code)`` for up to ``window_s``; the other
source's sighting inside the window yields one ``source="nvml+kmsg"`` event at once with the richer
fields of both, else the sighting is emitted alone once the window has passed. Times are passed in
(one monotonic clock of arrival); same-source sightings never merge; SXids are never held.
More: docs/producer.md, "Merging NVML and kernel-log sightings".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gpupipe.domain.pci import canonical

__all__ = [
    "DEFAULT_WINDOW_S",
    "NVML_NO_INSTANCE",
    "XidMerger",
]

Source = Literal["nvml", "kmsg"]

DEFAULT_WINDOW_S = 0.5
#: NVML's "not attributable to a MIG instance" value for gpuInstanceId / computeInstanceId.
NVML_NO_INSTANCE = 0xFFFFFFFF

#: Keys whose NVML value wins when both sources have one; every other key prefers the kmsg value.
_NVML_OWNED = frozenset({"uuid", "gpu_instance_id", "compute_instance_id"})
_MIG_KEYS = ("gpu_instance_id", "compute_instance_id")
_BASE_KEYS = ("uuid", "gpu_instance_id", "compute_instance_id", "pid", "process_name", "message")


def _key_pci(bus_id: str) -> str:
    try:
        return canonical(bus_id)
    except ValueError:
        return bus_id.strip().lower()


def _mig(value: Any) -> Any:
    return None if value == NVML_NO_INSTANCE else value


@dataclass(slots=True)
class _Held:
    seq: int
    source: Source
    pci: str
    xid: int
    at_s: float
    fields: Mapping[str, Any]


class XidMerger:
    """Pair NVML and kmsg sightings of the same Xid; see the module docstring for the rules."""

    __slots__ = ("_by_key", "_held", "_oldest", "_seq", "window_s")

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not window_s >= 0:
            raise ValueError("window_s must be >= 0")
        self.window_s = float(window_s)
        self._held: list[_Held] = []
        # (source, xid, pci) -> held sightings in arrival order, and the oldest arrival held: an
        # XID storm (thousands held in one window) costs O(1) per sighting, not a scan of all.
        self._by_key: dict[tuple[str, int, str], list[_Held]] = {}
        self._oldest = math.inf
        self._seq = 0

    def __len__(self) -> int:
        """Number of sightings currently held."""
        return len(self._held)

    def add(
        self, source: Source, key_pci: str, xid: int, at_s: float, fields: Mapping[str, Any]
    ) -> list[dict[str, Any]]:
        """Record one sighting at ``at_s``; returns the events this releases (oldest first).

        Expired held sightings come first, then the merged event if this sighting completed a pair.
        """
        if source not in ("nvml", "kmsg"):
            raise ValueError(f"unknown source {source!r}")
        out = self.expire(at_s)
        pci = _key_pci(key_pci)
        xid = int(xid)
        self._seq += 1
        new = _Held(self._seq, source, pci, xid, float(at_s), fields)
        if source == "kmsg" and fields.get("kind") == "sxid":
            out.append(_single(new, emitted_at_s=new.at_s))
            return out
        other = "kmsg" if source == "nvml" else "nvml"
        partners = self._by_key.get((other, xid, pci))
        if partners:
            held = partners.pop(0)
            if not partners:
                del self._by_key[(other, xid, pci)]
            self._held.remove(held)
            if held.at_s <= self._oldest:
                self._oldest = min((h.at_s for h in self._held), default=math.inf)
            out.append(_pair(held, new))
            return out
        self._held.append(new)
        self._by_key.setdefault((source, xid, pci), []).append(new)
        self._oldest = min(self._oldest, new.at_s)
        return out

    def held_field_min(self, key: str) -> Any:
        """The smallest non-null ``fields[key]`` among held sightings (None if none): the agent's
        kernel-log cursor must not pass a sighting that is held and so not spooled yet."""
        vals = [h.fields.get(key) for h in self._held]
        return min((v for v in vals if v is not None), default=None)

    def expire(self, now_s: float) -> list[dict[str, Any]]:
        """Emit, alone, every held sighting with ``now_s - at_s >= window_s`` (oldest first)."""
        if not self._held or now_s - self._oldest < self.window_s:
            return []
        due = [h for h in self._held if now_s - h.at_s >= self.window_s]
        if not due:
            return []
        self._reindex([h for h in self._held if now_s - h.at_s < self.window_s])
        due.sort(key=lambda h: (h.at_s, h.seq))
        return [_single(h, emitted_at_s=now_s) for h in due]

    def _reindex(self, held: list[_Held]) -> None:
        self._held = held
        self._by_key = {}
        for h in held:
            self._by_key.setdefault((h.source, h.xid, h.pci), []).append(h)
        self._oldest = min((h.at_s for h in held), default=math.inf)

    def flush(self, now_s: float | None = None) -> list[dict[str, Any]]:
        """Emit everything still held, alone (shutdown)."""
        held = sorted(self._held, key=lambda h: (h.at_s, h.seq))
        self._reindex([])
        return [_single(h, emitted_at_s=now_s) for h in held]


def _base(xid: int, pci: str) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "", "xid": xid, "pci_bus_id": pci}
    for key in _BASE_KEYS:
        out[key] = None
    return out


def _finish(out: dict[str, Any], source: str, xid: int, pci: str, first: float, wait: float | None) -> None:
    out["source"] = source
    out["xid"] = xid
    out["pci_bus_id"] = pci
    for key in _MIG_KEYS:
        out[key] = _mig(out.get(key))
    out["first_seen_s"] = first
    out["wait_s"] = wait


def _single(h: _Held, *, emitted_at_s: float | None) -> dict[str, Any]:
    out = _base(h.xid, h.pci)
    out.update(h.fields)
    wait = None if emitted_at_s is None else max(0.0, emitted_at_s - h.at_s)
    _finish(out, h.source, h.xid, h.pci, h.at_s, wait)
    return out


def _pair(a: _Held, b: _Held) -> dict[str, Any]:
    nvml, kmsg = (a, b) if a.source == "nvml" else (b, a)
    out = _base(a.xid, a.pci)
    nf = {k: (_mig(v) if k in _MIG_KEYS else v) for k, v in nvml.fields.items()}
    kf = kmsg.fields
    for key in dict.fromkeys((*kf, *nf)):
        first, second = (nf, kf) if key in _NVML_OWNED else (kf, nf)
        value = first.get(key)
        out[key] = value if value is not None else second.get(key)
    _finish(out, "nvml+kmsg", a.xid, a.pci, min(a.at_s, b.at_s), abs(b.at_s - a.at_s))
    return out
