"""Which GPU or MIG device a DRA claim holds: the node's ResourceSlices, read from the API server.

:class:`ResourceSliceIndex` maps ``(driver, pool, device)`` to the device's UUID; it lists again (at
most every ``min_interval_s``) when a claim names a device it does not know. Details: docs/producer.md.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpupipe.clients.kube import KubeApiError, KubeClient

__all__ = ["ResourceSliceIndex", "slice_uuids"]

log = logging.getLogger("gpupipe.dra")

API_VERSIONS = ("v1", "v1beta2", "v1beta1")
MIN_INTERVAL_S = 30.0
Key = tuple[str, str, str]  # (driver, pool, device)


def _uuid_attribute(device: Mapping[str, Any], driver: str) -> str | None:
    attrs = device.get("attributes")
    if attrs is None:
        attrs = (device.get("basic") or {}).get("attributes")
    if not isinstance(attrs, Mapping):
        return None
    for name in ("uuid", f"{driver}/uuid"):  # a short name is in the driver's own domain
        value = attrs.get(name)
        if isinstance(value, Mapping) and isinstance(value.get("string"), str) and value["string"]:
            return value["string"]
    return None


def slice_uuids(items: Iterable[Mapping[str, Any]], drivers: Iterable[str]) -> dict[Key, str]:
    """``(driver, pool, device) -> uuid`` of the slices' devices of ``drivers`` (pure)."""
    wanted = set(drivers)
    out: dict[Key, str] = {}
    for item in items:
        spec = item.get("spec") or {}
        driver = spec.get("driver")
        pool = (spec.get("pool") or {}).get("name")
        if driver not in wanted or not isinstance(pool, str):
            continue
        for dev in spec.get("devices") or ():
            name = dev.get("name") if isinstance(dev, Mapping) else None
            uuid = _uuid_attribute(dev, driver) if isinstance(name, str) else None
            if uuid:
                out[(driver, pool, name)] = uuid
    return out


class ResourceSliceIndex:
    """This node's DRA devices by ``(driver, pool, device)``; ``uuid`` is the resolver the kubelet
    mapper takes. Thread-safe; a failed list keeps what was known and is retried after the interval."""

    def __init__(
        self,
        api: KubeClient,
        node_name: str,
        drivers: Iterable[str],
        *,
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[str], None] = lambda _kind: None,
        fallback: Callable[[str, str, str], str | None] | None = None,
    ) -> None:
        self.api, self.node_name, self.drivers = api, node_name, tuple(drivers)
        self.min_interval_s = min_interval_s
        self._clock, self.on_error, self.fallback = clock, on_error, fallback
        self._lock = threading.Lock()
        self._index: dict[Key, str] = {}
        self._last: float | None = None
        self._version: str | None = None
        self.lists = 0

    def _path(self, version: str) -> str:
        sel = urllib.parse.quote(f"spec.nodeName={self.node_name}", safe="")
        return f"/apis/resource.k8s.io/{version}/resourceslices?fieldSelector={sel}"

    def refresh(self) -> bool:
        """List the node's slices now; False (and the old index kept) when the API refuses."""
        self._last = self._clock()
        versions = (self._version,) if self._version else API_VERSIONS
        for version in versions:
            try:
                data = self.api.get(self._path(version))
            except KubeApiError as exc:
                if exc.status == 404 and not self._version:
                    continue  # this API server does not serve that version
                self.on_error("unreachable" if exc.status is None else f"http_{exc.status}")
                log.warning("cannot list ResourceSlices: %s", exc)
                return False
            index = slice_uuids(data.get("items") or (), self.drivers)
            with self._lock:
                self._index, self._version = index, version
            self.lists += 1
            return True
        self.on_error("not_served")
        return False

    def uuid(self, driver: str, pool: str, device: str) -> str | None:
        """The UUID of that device (GPU or MIG), listing again when it is unknown and the last list is
        old enough; else the fallback's answer (the ``gpu-<n>`` naming of whole GPUs)."""
        key = (driver, pool, device)
        with self._lock:
            hit = self._index.get(key)
        if hit is None and driver in self.drivers:
            last = self._last
            if last is None or self._clock() - last >= self.min_interval_s:
                self.refresh()
                with self._lock:
                    hit = self._index.get(key)
        if hit is None and self.fallback is not None:
            return self.fallback(driver, pool, device)
        return hit

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)
