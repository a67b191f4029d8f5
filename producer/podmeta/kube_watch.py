"""Labels, owners and priority classes of this node's pods, from a node-scoped watch on the API server.

Why the API server and not the kubelet's ``/pods``: the kubelet endpoint (port 10250) needs the
``nodes/proxy`` permission, which also allows exec into every pod of the node (a known escalation
path), and it only names a pod's direct owner (a ReplicaSet, a Job): finding the Deployment or
CronJob needs the API server anyway. A watch with ``fieldSelector=spec.nodeName=<node>`` is what
every kubelet already runs: the API server answers it from its watch cache, indexed by node name,
so one more such watch per node costs it what a second kubelet would. Measured with the faithful
double in ``bench/bench_podmeta_load.py`` and written up in docs/benchmarks.md.

Protocol, as client-go's reflector does it:

1. ``LIST /api/v1/pods?fieldSelector=spec.nodeName=N&resourceVersion=0`` (served from the watch
   cache, never a quorum read of etcd: 10k agents restarting at once must not hit etcd);
2. ``WATCH`` from the list's ``resourceVersion`` with ``allowWatchBookmarks=true`` and a
   ``timeoutSeconds`` (the server ends the stream; the watch resumes from the last version seen);
3. a ``410 Gone`` (HTTP status or an ``ERROR`` event with code 410: the version was compacted)
   means relist; any other failure backs off exponentially (0.5 s .. 30 s) and resumes.

Owners are fetched with one GET per controller object, cached by UID (a Deployment's pods share a
ReplicaSet: one GET per new ReplicaSet, none per pod). While the API is unreachable the last known
metadata stays in use, flagged ``stale`` in every allocation, and ``healthy`` is False.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from gpupipe.clients.kube import GONE, KubeApiError, KubeClient, Watch
from gpupipe_producer.podmeta.owners import PodMeta, object_path, pod_meta

log = logging.getLogger("gpupipe.podmeta")

WATCH_TIMEOUT_S = 300
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0


class PodMetadataWatcher:
    """Background thread keeping ``(namespace, pod) -> PodMeta`` for the pods of one node."""

    def __init__(
        self,
        api: KubeClient,
        node_name: str,
        *,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        on_error: Callable[[str], None] = lambda _kind: None,
        on_request: Callable[[str], None] = lambda _verb: None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.watch_timeout_s = watch_timeout_s
        self.on_error = on_error
        self.on_request = on_request
        self._pods: dict[tuple[str, str], PodMeta] = {}
        self._owners: dict[str, Mapping[str, Any] | None] = {}  # "apiVersion/kind/ns/name" -> metadata
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stream: Watch | None = None
        self._thread: threading.Thread | None = None
        self.healthy = False
        self.resource_version = ""
        self.relists = 0
        self.synced = threading.Event()  # set after the first successful list

    # -- reading (any thread) ------------------------------------------------------------------------
    def lookup(self, namespace: str, pod: str) -> PodMeta | None:
        with self._lock:
            return self._pods.get((namespace, pod))

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)

    # -- HTTP ----------------------------------------------------------------------------------------
    def _get_json(self, path: str, verb: str) -> Any:
        self.on_request(verb)
        return self.api.get(path)

    def _selector(self) -> str:
        return urllib.parse.quote(f"spec.nodeName={self.node_name}", safe="")

    # -- owners --------------------------------------------------------------------------------------
    def _owner_meta(self, api_version: str, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        key = f"{api_version}/{kind}/{namespace}/{name}"
        if key in self._owners:
            return self._owners[key]
        try:
            obj = self._get_json(object_path(api_version, kind, namespace, name), "get_owner")
            meta: Mapping[str, Any] | None = obj.get("metadata") or {}
        except KubeApiError as exc:
            if exc.status is None or exc.status >= 500:
                raise  # the API is down: retry later rather than remember a wrong owner
            self.on_error(f"owner_{exc.status}")
            meta = None  # forbidden, gone, or a group this cluster does not serve: stop here
        if len(self._owners) > 10_000:
            self._owners.clear()
        self._owners[key] = meta
        return meta

    def _apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        md = pod.get("metadata") or {}
        key = (str(md.get("namespace", "")), str(md.get("name", "")))
        if kind == "DELETED":
            with self._lock:
                self._pods.pop(key, None)
            return
        meta = pod_meta(pod, self._owner_meta)
        with self._lock:
            self._pods[key] = meta

    # -- list / watch ---------------------------------------------------------------------------------
    def _list(self) -> None:
        data = self._get_json(f"/api/v1/pods?fieldSelector={self._selector()}&resourceVersion=0", "list")
        pods = {}
        for item in data.get("items") or ():
            meta = pod_meta(item, self._owner_meta)
            pods[(meta.namespace, meta.name)] = meta
        with self._lock:
            self._pods = pods
        self.resource_version = str((data.get("metadata") or {}).get("resourceVersion") or "")
        self.relists += 1
        self.synced.set()

    def _watch(self) -> bool:
        """Stream events until the server ends the watch (True) or the version is gone (False)."""
        path = (
            f"/api/v1/pods?fieldSelector={self._selector()}&watch=true&allowWatchBookmarks=true"
            f"&resourceVersion={urllib.parse.quote(self.resource_version)}&timeoutSeconds={self.watch_timeout_s}"
        )
        self.on_request("watch")
        # connecting and the headers: the client's short timeout; then the stream may stay quiet
        # until the server ends it
        stream = self.api.watch(path, idle_timeout_s=self.watch_timeout_s + self.api.timeout_s)
        self._stream = stream
        try:
            stream.open()
            self.healthy = True
            while not self._stop.is_set():
                event = stream.next_event()
                if event is None:
                    return True
                etype, obj = event
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    self._apply(etype, obj)
                if rv:
                    self.resource_version = str(rv)
            return True
        except KubeApiError as exc:
            if exc.status == GONE:
                return False
            if exc.status is None and self._stop.is_set():
                return True
            raise
        finally:
            self._stream = None
            stream.close()

    def run_once(self) -> None:
        """One list + watch cycle until the watch ends (tests drive this directly)."""
        if not self.resource_version:
            self._list()
            self.healthy = True
        if not self._watch():
            self.on_error("gone")
            self.resource_version = ""

    def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            try:
                self.run_once()
                backoff = BACKOFF_MIN_S
            except KubeApiError as exc:
                if self._stop.is_set():
                    break
                was = self.healthy
                self.healthy = False
                self.on_error("unreachable" if exc.status is None else f"http_{exc.status}")
                if was:
                    log.warning(
                        "pod metadata source failing; allocations keep last known values (stale): %s", exc
                    )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            except Exception:  # never let a bug kill enrichment silently
                log.exception("pod metadata watcher failed")
                self.healthy = False
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def start(self) -> PodMetadataWatcher:
        self._thread = threading.Thread(target=self._run, name="pod-metadata", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.abort()
        if self._thread is not None:
            self._thread.join(timeout_s)
