"""Which Kubernetes pod a host process belongs to: ``/proc/<pid>/cgroup`` + ``/var/log/pods``.

Pure parsers (:func:`parse_cgroup`, :func:`parse_pod_log_dir`) and the cached resolver
:class:`PidPodResolver` the agent hands to :func:`~gpupipe_producer.samples.enrich.enrich_sample`.
Layouts and requirements: docs/producer.md.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable

from gpupipe_producer.samples.enrich import ProcPod

__all__ = ["PidPodResolver", "parse_cgroup", "parse_pod_log_dir"]

# A pod UID: a UUID, or for static (mirror) pods the 32-hex config hash the kubelet uses instead.
_POD_UID = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
    r"|[0-9a-fA-F]{32}(?![0-9a-fA-F]))"
)
_CONTAINER_ID = re.compile(r"(?:^|[-:])([0-9a-f]{64})(?:\.scope)?$")
_UUID = re.compile(r"^(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32})$")


def parse_cgroup(text: str) -> ProcPod | None:
    """Pod UID and container id from the text of ``/proc/<pid>/cgroup``; None for empty text.

    ``ProcPod(in_kubernetes=False)`` when no line is under ``kubepods``.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    # Prefer the unified (v2) line, then any controller line naming a pod.
    lines.sort(key=lambda ln: not ln.startswith("0::"))
    for ln in lines:
        path = ln.split(":", 2)[-1]
        if "kubepods" not in path:
            continue
        m = _POD_UID.search(path)
        if m is None:
            continue
        uid = m.group(1).replace("_", "-").lower()
        leaf = path.rstrip("/").rsplit("/", 1)[-1]
        c = _CONTAINER_ID.search(leaf)
        container = c.group(1) if c is not None and "conmon" not in leaf else None
        return ProcPod(True, uid, container)
    if any("kubepods" in ln for ln in lines):
        return ProcPod(True)  # a pod-level or QoS cgroup without a UID we recognise
    return ProcPod(False)


def parse_pod_log_dir(name: str) -> tuple[str, str, str] | None:
    """``<namespace>_<pod>_<uid>`` -> (namespace, pod, uid); None for anything else."""
    parts = name.split("_")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None
    uid = parts[2].lower()
    if _UUID.match(uid) is None:
        return None
    return parts[0], parts[1], uid


def pod_names_by_uid(dir_names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """uid -> (namespace, pod) from the entries of ``/var/log/pods``."""
    out: dict[str, tuple[str, str]] = {}
    for name in dir_names:
        parsed = parse_pod_log_dir(name)
        if parsed is not None:
            ns, pod, uid = parsed
            out[uid] = (ns, pod)
    return out


class PidPodResolver:
    """``resolver(pid) -> ProcPod | None`` reading ``<proc_root>/<pid>/cgroup`` and ``pod_logs_dir``.

    None means "cannot tell" (the pid is not visible, e.g. no ``hostPID``). Results are cached per
    pid for ``ttl_s`` (a pid's pod never changes while it lives; the TTL covers pid reuse); the pod
    log directory is re-listed at most every ``ttl_s`` and when an unknown UID shows up.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        pod_logs_dir: str = "/var/log/pods",
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 4096,
    ) -> None:
        self.proc_root = proc_root
        self.pod_logs_dir = pod_logs_dir
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_entries
        self._cache: dict[int, tuple[float, ProcPod | None]] = {}
        self._names: dict[str, tuple[str, str]] = {}
        self._names_at = float("-inf")
        self.read_errors = 0

    def __call__(self, pid: int) -> ProcPod | None:
        now = self._clock()
        hit = self._cache.get(pid)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        info = self._resolve(pid, now)
        if len(self._cache) >= self._max:
            self._cache.clear()
        self._cache[pid] = (now, info)
        return info

    def _resolve(self, pid: int, now: float) -> ProcPod | None:
        try:
            with open(
                os.path.join(self.proc_root, str(pid), "cgroup"), encoding="utf-8", errors="replace"
            ) as f:
                info = parse_cgroup(f.read())
        except OSError:
            self.read_errors += 1
            return None
        if info is None or not info.in_kubernetes or info.pod_uid is None:
            return info
        names = self._pod_names(now, info.pod_uid)
        found = names.get(info.pod_uid)
        if found is None:
            return info
        return ProcPod(True, info.pod_uid, info.container_id, found[0], found[1])

    def _pod_names(self, now: float, uid: str) -> dict[str, tuple[str, str]]:
        if uid in self._names and now - self._names_at < self.ttl_s:
            return self._names
        if now - self._names_at < 1.0:  # an unknown UID re-lists at most once a second
            return self._names
        try:
            self._names = pod_names_by_uid(os.listdir(self.pod_logs_dir))
        except OSError:
            self._names = {}
        self._names_at = now
        return self._names
