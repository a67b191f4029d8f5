"""Start, serve and stop: the one sequence every long-running service goes through.

Copies of this sequence per service drift (a missing start-up wait crash-loops on a fresh
broker; a copied server honours half of the web config), so there is one: a command turns
its flags into a config and a ``build`` function, and :func:`run_service` does:

1. read the web config (a mistake is one line and exit 2, before any network);
2. handle SIGTERM/SIGINT with the shutdown deadline (``--shutdown-timeout``);
3. listen on ``--listen`` at once, answering 503 "starting" (same TLS and auth as later);
4. wait for Kafka and the topics (``--startup-timeout``; a stop signal meanwhile is a clean exit);
5. ``build`` the service (it may do more waiting of its own, shown on the same 503);
6. serve its routes and checks, ``run(stop)`` it, then ``close()`` it and the server.

A service that must work before Kafka is usable (the node agent spools XIDs while its topics are
missing) waits in a thread of its own and names the event it sets once ready: ``serve_after``.
Its server keeps answering 503 "starting" (with what it waits for) until then, while it runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from gpupipe.kafka import ready as kafka_ready
from gpupipe.kafka import topics
from gpupipe.lifecycle import shutdown
from gpupipe.web.config import WebConfigSource
from gpupipe.web.server import HealthCheck, HttpServer, Route, registry_route

log = logging.getLogger("gpupipe.runner")


@runtime_checkable
class Service(Protocol):
    def health(self) -> tuple[bool, Mapping[str, Any]]: ...

    def run(self, stop: threading.Event) -> None: ...


@dataclass(frozen=True)
class KafkaNeeds:
    """What must be usable before the service is built: the broker and these topics with leaders."""

    bootstrap: str
    bases: Sequence[str]  # base names, prefixed with `prefix`
    prefix: str = ""
    create: bool = True
    extra: Mapping[str, str] | None = None
    specs: Mapping[str, topics.TopicSpec] | None = None
    exact: Sequence[str] = ()  # full names used as given (topic overrides)


@dataclass(frozen=True)
class Lifecycle:
    """What ``build`` gets: the stop event, the deadline, and the state shown while starting."""

    name: str
    stop: threading.Event
    deadline: shutdown.ShutdownDeadline
    state: kafka_ready.StartupState
    startup_timeout_s: float
    http: HttpServer | None = None


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    listen: str | None
    web_config_file: str | None = None
    startup_timeout_ms: int = 0
    shutdown_timeout_ms: int = int(shutdown.DEFAULT_SHUTDOWN_S * 1000)
    kafka: KafkaNeeds | None = None
    extra_routes: Mapping[str, Route] = field(default_factory=dict)

    @classmethod
    def from_args(cls, name: str, args: Any, kafka: KafkaNeeds | None = None, **over: Any) -> ServiceSpec:
        """The spec from the flags every service has (--listen, --web-config-file, the two timeouts)."""
        given = {
            "listen": args.listen,
            "web_config_file": args.web_config_file,
            "startup_timeout_ms": args.startup_timeout,
            "shutdown_timeout_ms": args.shutdown_timeout,
        }
        return cls(name=name, kafka=kafka, **{**given, **over})


def routes_of(service: Any) -> dict[str, Route]:
    """The service's own routes, else ``/metrics`` of its prometheus_client registry."""
    own = getattr(service, "routes", None)
    if callable(own):
        return dict(own())
    registry = getattr(service, "registry", None)
    return {"/metrics": registry_route(registry)} if registry is not None else {}


def run_service(spec: ServiceSpec, build: Callable[[Lifecycle], Service]) -> int:
    web = WebConfigSource(spec.web_config_file) if spec.web_config_file else None
    stop = threading.Event()
    deadline = shutdown.ShutdownDeadline(stop, spec.shutdown_timeout_ms, spec.name).install()
    state = kafka_ready.StartupState()
    http = HttpServer(spec.listen, web, service=spec.name, starting=state).start() if spec.listen else None
    life = Lifecycle(spec.name, stop, deadline, state, spec.startup_timeout_ms / 1000, http)
    service: Service | None = None
    try:
        if spec.kafka is not None:
            k = spec.kafka
            kafka_ready.prepare_kafka(
                k.bootstrap,
                k.bases,
                prefix=k.prefix,
                create=k.create,
                specs=k.specs,
                extra=k.extra,
                timeout_s=life.startup_timeout_s,
                state=state,
                exact=k.exact,
                stop=stop,
            )
        if stop.is_set():
            return 0
        service = build(life)
        if http is not None:
            _serve_when_ready(http, service, spec, stop)
        service.run(stop)
    except kafka_ready.StartupCancelled:
        log.info("stopped while starting", extra={"fields": {"service": spec.name}})
        return 0
    finally:
        try:
            close = getattr(service, "close", None)
            if callable(close):
                close()
        finally:
            if http is not None:
                http.close()
    return 0


def _serve_when_ready(http: HttpServer, service: Service, spec: ServiceSpec, stop: threading.Event) -> None:
    """Serve the service's routes and checks now, or once its ``serve_after`` event is set."""
    ready: HealthCheck | None = getattr(service, "ready", None)

    def serve() -> None:
        http.serve({**routes_of(service), **spec.extra_routes}, health=service.health, ready=ready)

    after = getattr(service, "serve_after", None)
    if not isinstance(after, threading.Event) or after.is_set():
        serve()
        return

    def wait() -> None:
        while not after.wait(0.2):
            if stop.is_set():
                return
        serve()

    threading.Thread(target=wait, name="serve-after-start", daemon=True).start()
