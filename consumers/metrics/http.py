"""``/metrics`` of the metrics consumer: the GPU exposition on the floor's one server.

:func:`make_metrics_server` is :class:`gpupipe.web.server.HttpServer` (TLS, auth, rate limit,
probes) with one route: ``GET /metrics``, the store's exposition, ``text/plain; version=0.0.4``.
With ``Accept-Encoding: gzip`` the answer is one gzip member whose deflate stream is made of two
parts: the GPU families, compressed once per store version and reused by every scrape until the
store changes (ended with a sync flush, so it stops on a byte boundary without the final-block
bit), then the small rest (sample ages, the service's own metrics) compressed per scrape and
finished; the trailer's CRC-32 continues over both. A deflate stream is just a series of blocks,
so any decoder reads it (curl and wget stop after the first member of a multi-member gzip, which
is why this is one member).
"""

from __future__ import annotations

from email.message import Message
from pathlib import Path
from typing import Any

from gpupipe.web.config import WebConfig, WebConfigSource, load_web_config, parse_web_config
from gpupipe.web.server import (
    DEFAULT_REQUEST_TIMEOUT_S,
    OPEN_PATHS,
    HealthCheck,
    HttpServer,
    Response,
)
from gpupipe_consumers.metrics.gzipcache import GzipCache
from gpupipe_consumers.metrics.store import SeriesStore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DEFAULT_PORT = 9400  # dcgm-exporter's

__all__ = ["GzipCache", "WebConfig", "load_web_config", "make_metrics_server", "parse_web_config"]


def accepts_gzip(header: str | None) -> bool:
    """True when an Accept-Encoding header allows gzip (``gzip``, ``x-gzip`` or ``*``, q > 0)."""
    if not header:
        return False
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


class MetricsEndpoint:
    """The ``/metrics`` route: the store's parts, gzip-spliced when the scraper accepts gzip."""

    def __init__(self, store: SeriesStore, gzip_level: int = 1) -> None:
        self.store = store
        self.gzip: Any = GzipCache(gzip_level)

    def __call__(self, headers: Message) -> Response:
        parts = self.store.render_parts()
        extra = {"Vary": "Accept-Encoding"}
        if accepts_gzip(headers.get("Accept-Encoding")):
            parts = self.gzip.compress(parts)
            extra["Content-Encoding"] = "gzip"
        return Response(200, parts, CONTENT_TYPE, extra)


class MetricsServer(HttpServer):
    """The floor's server with the GPU exposition on ``/metrics``."""

    def __init__(
        self,
        address: tuple[str, int],
        store: SeriesStore,
        *,
        health: HealthCheck | None = None,
        web_config: WebConfigSource | WebConfig | str | Path | None = None,
        gzip_level: int = 1,
        open_paths: frozenset[str] = OPEN_PATHS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        endpoint: MetricsEndpoint | None = None,
    ) -> None:
        self.endpoint = endpoint or MetricsEndpoint(store, gzip_level)
        super().__init__(
            address,
            web_config,
            service="metrics",
            routes={"/metrics": self.endpoint},
            health=health,
            open_paths=open_paths,
            request_timeout_s=request_timeout_s,
        )

    @property
    def store(self) -> SeriesStore:
        return self.endpoint.store

    @property
    def gzip(self) -> Any:
        return self.endpoint.gzip


def make_metrics_server(
    store: SeriesStore,
    host: str = "0.0.0.0",
    port: int = DEFAULT_PORT,
    *,
    health: HealthCheck | None = None,
    web_config: WebConfigSource | WebConfig | str | Path | None = None,
    gzip_level: int = 1,
    open_paths: frozenset[str] = OPEN_PATHS,
) -> MetricsServer:
    """Bind a metrics server (``port=0``: any free port; ``host="::"``: IPv6); ``.start()`` serves it.

    ``web_config``: a :class:`WebConfig`, or the path of an exporter-toolkit web-config file, or
    None (plain HTTP, no auth). ``gzip_level`` 1 keeps a 50 MB exposition's compression in the
    tens of milliseconds; text this repetitive still shrinks about tenfold.
    """
    return MetricsServer(
        (host, port),
        store,
        health=health,
        web_config=web_config,
        gzip_level=gzip_level,
        open_paths=open_paths,
    )
