"""The one Kubernetes API client: configuration, authenticated JSON calls and watch streams.

Used by the alerts service (cordoning nodes) and by the node agent (its pods' metadata). Plain
``http.client``, no Kubernetes client dependency: the two callers need a handful of GETs, a PATCH and
one watch, and the agent runs on every GPU node, where a small image matters.

Configuration: ``--kube-api-url`` + ``--kube-token-file`` (+ ``--kube-ca-file``), else the in-cluster
service account (``KUBERNETES_SERVICE_HOST``/``_PORT`` and ``/var/run/secrets/kubernetes.io/
serviceaccount/{token,ca.crt}``). The token file is read for every request, because projected tokens
rotate under a running process. Building a :class:`KubeClient` reads the CA file but never connects:
the first call does.

Every failure is a :class:`KubeApiError` with the HTTP status (``None`` when no answer came: refused,
timed out, TLS failure, unreadable token, a body that is not JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import ssl
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupipe.common.errors import ConfigError, GpupipeError
from gpupipe.common.flag_files import read_text

__all__ = [
    "GONE",
    "SA_DIR",
    "STRATEGIC_MERGE_PATCH",
    "KubeApiError",
    "KubeClient",
    "KubeConfig",
    "Watch",
    "add_arguments",
    "config_from_args",
    "kube_config",
]

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
#: The resource version a watch resumes from was compacted away: list again.
GONE = 410


class KubeApiError(GpupipeError):
    """A Kubernetes API call failed; ``status`` is the HTTP status, or None when no answer came."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status or 'no answer'}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class KubeConfig:
    api_url: str
    token_file: str | None
    ca_file: str | None


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The three flags every caller of :func:`config_from_args` offers."""
    group.add_argument("--kube-api-url", default=None, help="API server URL (default: in-cluster config)")
    group.add_argument("--kube-token-file", default=None, help="bearer token file (default: service account)")
    group.add_argument("--kube-ca-file", default=None, help="CA bundle for the API server's certificate")


def config_from_args(args: argparse.Namespace, *, needed_by: str, otherwise: str = "") -> KubeConfig:
    """:func:`kube_config` from the flags of :func:`add_arguments`."""
    return kube_config(
        args.kube_api_url, args.kube_token_file, args.kube_ca_file, needed_by=needed_by, otherwise=otherwise
    )


def kube_config(
    api_url: str | None = None,
    token_file: str | None = None,
    ca_file: str | None = None,
    *,
    needed_by: str,
    otherwise: str = "",
    environ: Mapping[str, str] | None = None,
    sa_dir: Path = SA_DIR,
) -> KubeConfig:
    """Explicit settings, else in-cluster ones; :class:`ConfigError` when neither is available.

    ``needed_by`` names the caller's flag that wants the API (``--cordon``), ``otherwise`` an
    alternative it offers (``or use --dry-run``): the error then tells the operator what to change.
    """
    env = os.environ if environ is None else environ
    if api_url:
        if not api_url.startswith(("http://", "https://")):
            raise ConfigError(f"--kube-api-url must start with http:// or https://, got {api_url!r}")
        if token_file and not Path(token_file).is_file():
            raise ConfigError(f"--kube-token-file {token_file} does not exist")
        if ca_file and not Path(ca_file).is_file():
            raise ConfigError(f"--kube-ca-file {ca_file} does not exist")
        return KubeConfig(api_url.rstrip("/"), token_file, ca_file)
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    token = sa_dir / "token"
    if not host or not token.is_file():
        raise ConfigError(
            f"{needed_by} needs the Kubernetes API: run in a pod with a service account, or give "
            "--kube-api-url and --kube-token-file" + (f" ({otherwise})" if otherwise else "")
        )
    ca = sa_dir / "ca.crt"
    host = f"[{host}]" if ":" in host else host
    return KubeConfig(f"https://{host}:{port}", str(token), ca_file or (str(ca) if ca.is_file() else None))


class KubeClient:
    """Authenticated calls to one API server; one connection per call (the callers' rates are low)."""

    def __init__(self, cfg: KubeConfig, timeout_s: float = 10.0) -> None:
        u = urllib.parse.urlsplit(cfg.api_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"API URL must be http(s)://HOST[:PORT], got {cfg.api_url!r}")
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port or (443 if self._https else 80)
        self._prefix = u.path.rstrip("/")  # an API server behind a path (a proxy) keeps it
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            self._ssl = (
                ssl.create_default_context(cafile=cfg.ca_file)
                if cfg.ca_file
                else ssl.create_default_context()
            )

    def connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        """A new, unconnected connection to the API server."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def headers(self, content_type: str | None = None) -> dict[str, str]:
        """Request headers with the current bearer token (read now: it may have rotated)."""
        h = {"Accept": "application/json"}
        if self.cfg.token_file:
            try:
                h["Authorization"] = "Bearer " + read_text(self.cfg.token_file, "token file").strip()
            except ConfigError as exc:  # unreadable or not text (a rotation half-written): this call fails
                raise KubeApiError(None, str(exc)) from exc
        if content_type:
            h["Content-Type"] = content_type
        return h

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One call; ``body`` (if not None) is sent as JSON. Returns the decoded answer ({} when empty)."""
        data = None if body is None else json.dumps(body).encode()
        headers = self.headers(content_type if data is not None else None)
        conn = self.connection()
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            answer = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise KubeApiError(None, f"{type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        if not 200 <= resp.status < 300:
            raise KubeApiError(resp.status, _status_message(answer) or resp.reason)
        try:
            return json.loads(answer or b"{}")
        except ValueError as exc:
            raise KubeApiError(None, f"{type(exc).__name__}: {exc}") from exc

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def patch(self, path: str, body: Any, content_type: str = STRATEGIC_MERGE_PATCH) -> Any:
        return self.request("PATCH", path, body, content_type)

    def watch(self, path: str, idle_timeout_s: float) -> Watch:
        """A watch on ``path`` (with ``watch=true`` in its query), not yet opened: see :class:`Watch`."""
        return Watch(self, self._prefix + path, idle_timeout_s)


class Watch:
    """One watch stream of newline-delimited ``WatchEvent`` JSON.

    :meth:`open` connects and reads the headers within the client's timeout, then each event may take
    up to ``idle_timeout_s`` (a quiet watch sends nothing until the server ends it). :meth:`next_event`
    (or iterating) gives ``(type, object)`` for every event but ``ERROR``, which is raised as
    :class:`KubeApiError` with its code; a compacted resource version is status :data:`GONE` whether
    the server says so in the HTTP status or in an ``ERROR`` event. :meth:`abort` ends a blocked read
    from another thread.
    """

    def __init__(self, client: KubeClient, path: str, idle_timeout_s: float) -> None:
        self._client = client
        self._path = path
        self._idle_timeout_s = idle_timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self._resp: http.client.HTTPResponse | None = None

    def open(self) -> None:
        headers = self._client.headers()
        conn = self._conn = self._client.connection()
        try:
            conn.request("GET", self._path, headers=headers)
            resp = conn.getresponse()
            if conn.sock is not None:
                conn.sock.settimeout(self._idle_timeout_s)
            if resp.status != 200:
                raise KubeApiError(resp.status, _status_message(resp.read()) or resp.reason)
        except (OSError, http.client.HTTPException) as exc:
            raise KubeApiError(None, f"{type(exc).__name__}: {exc}") from exc
        self._resp = resp

    def next_event(self) -> tuple[str, dict[str, Any]] | None:
        """The next ``(type, object)``, or None when the server ended the watch (its timeoutSeconds)."""
        if self._resp is None:
            raise RuntimeError("Watch.open() first")
        try:
            while True:
                line = self._resp.readline()
                if not line:
                    return None
                if line.strip():
                    break
            event = json.loads(line)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise KubeApiError(None, f"{type(exc).__name__}: {exc}") from exc
        etype, obj = event.get("type"), event.get("object") or {}
        if etype == "ERROR":
            raise KubeApiError(obj.get("code"), obj.get("message", "watch error"))
        return str(etype), obj

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        while (event := self.next_event()) is not None:
            yield event

    def abort(self) -> None:
        """Unblock a read in progress (thread-safe); the iteration then ends or raises."""
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _status_message(body: bytes) -> str:
    """The ``message`` of a ``Status`` answer, else the start of the body as text."""
    try:
        return str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        return body[:300].decode("utf-8", "replace").strip()
