"""OTLP transports: gRPC and HTTP/protobuf, one ``export(signal, request)`` each.

Why not the SDK's exporters: they take SDK data (one Resource per MeterProvider, while we send a
resource per pod) and retry on their own for a bounded time, after which they drop the batch. Here a
failed export raises, and the caller decides: the Kafka offsets stay uncommitted and the batch is
tried again until the collector takes it. The request messages come from ``opentelemetry-proto``;
gRPC is ``grpcio`` (already a dependency), HTTP is the standard library.

Which failures are whose (:class:`ExportError`): only a collector saying the data itself is bad
(gRPC INVALID_ARGUMENT, HTTP 400) is permanent. A request over the collector's size limit (gRPC
RESOURCE_EXHAUSTED "larger than max", HTTP 413) is ``too_large``: the caller splits it. A request that
timed out after it was sent is ``maybe_delivered``: the collector may hold it already. Everything
else, refused credentials, unknown services and redirects included, is a collector or configuration
problem that an operator fixes, after which the held batch goes through: nothing is dropped for it.
A redirect is never followed: urllib would resend the credentials to wherever it points, as a GET
without the body, and take that GET's 200 for an acknowledgement.
"""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse

from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import read_bytes
from gpupipe.common.yaml_file import load_yaml
from gpupipe_consumers.otlp.settings import DEFAULT_ENDPOINTS, DEFAULT_TIMEOUT_S, PROTOCOLS, Protocol_

Signal = Literal["metrics", "logs"]

_HEADERS_ENV = "OTEL_EXPORTER_OTLP_HEADERS"
_PERMANENT_GRPC = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
_PERMANENT_HTTP = frozenset({400})
_TOO_LARGE_HTTP = 413


class ExportError(Exception):
    """An export not acknowledged. ``retryable``: the same request may succeed later;
    ``too_large``: the collector refused its size (send it in parts); ``maybe_delivered``: it timed
    out after it was sent, so the collector may have taken it (a resend may duplicate it);
    ``slow``: it could not be connected or sent within the timeout (nothing delivered; a longer
    timeout may let a large request through a slow link)."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        too_large: bool = False,
        maybe_delivered: bool = False,
        slow: bool = False,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.too_large = too_large
        self.maybe_delivered = maybe_delivered
        self.slow = slow


def _grpc_error(code: grpc.StatusCode, detail: str) -> ExportError:
    message = f"gRPC {code.name}: {detail}"
    # grpc's own text for a message over a receive limit (the collector's and a proxy's alike);
    # RESOURCE_EXHAUSTED alone may also be a memory limiter asking us to come back later.
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (detail or "").lower():
        return ExportError(message, retryable=False, too_large=True)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ExportError(message, retryable=True, maybe_delivered=True)
    return ExportError(message, retryable=code not in _PERMANENT_GRPC)


@dataclass(frozen=True)
class PartialSuccess:
    """What the collector took but refused in part (not retried: the specification says so)."""

    rejected: int = 0
    message: str = ""


@dataclass
class OtlpConfig:
    protocol: Protocol_
    endpoint: str  # base URL (http[s]://host:port); HTTP appends /v1/metrics and /v1/logs
    signal_endpoints: dict[Signal, str] = field(default_factory=dict)  # full URLs, as given
    headers_file: str | None = None
    env_headers: dict[str, str] = field(default_factory=dict)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool | None = None  # gRPC: plaintext even for a host-only endpoint
    timeout_s: float = DEFAULT_TIMEOUT_S


def parse_headers(text: str, what: str) -> dict[str, str]:
    """``key=value,key2=value2`` with percent-encoded values, as OTEL_EXPORTER_OTLP_HEADERS."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{what}: {item.split('=')[0]!r} is not key=value")
        out[key.strip().lower()] = urllib.parse.unquote(value.strip())
    return out


def config_from(
    *,
    protocol: str | None,
    endpoint: str | None,
    headers_file: str | None,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    timeout_s: float | None,
    environ: Mapping[str, str] = os.environ,
) -> OtlpConfig:
    """The exporter's config: flags first, then the OTEL_EXPORTER_OTLP_* variables, then OTLP's defaults.

    Headers (credentials) come only from the environment or a file, never from argv."""
    proto = protocol or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if proto not in PROTOCOLS:
        raise ConfigError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {proto!r}")
    base = endpoint or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINTS[proto]  # type: ignore[index]
    if proto == "http/protobuf" and not base.startswith(("http://", "https://")):
        raise ConfigError(f"the OTLP/HTTP endpoint must start with http:// or https://, got {base!r}")
    signals: dict[Signal, str] = {}
    for sig in ("metrics", "logs"):
        value = environ.get(f"OTEL_EXPORTER_OTLP_{sig.upper()}_ENDPOINT")
        if value and not endpoint:  # a flag names the one endpoint for both signals
            signals[sig] = value  # type: ignore[index]
    insecure_env = environ.get("OTEL_EXPORTER_OTLP_INSECURE")
    timeout_env = environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")  # milliseconds, as the specification has it
    try:
        timeout = timeout_s if timeout_s is not None else float(timeout_env) / 1000 if timeout_env else None
    except ValueError as exc:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TIMEOUT must be milliseconds, got {timeout_env!r}") from exc
    cfg = OtlpConfig(
        protocol=proto,  # type: ignore[arg-type]
        endpoint=base,
        signal_endpoints=signals,
        headers_file=headers_file,
        env_headers=parse_headers(environ.get(_HEADERS_ENV, ""), _HEADERS_ENV),
        ca_file=ca_file or environ.get("OTEL_EXPORTER_OTLP_CERTIFICATE"),
        cert_file=cert_file or environ.get("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"),
        key_file=key_file or environ.get("OTEL_EXPORTER_OTLP_CLIENT_KEY"),
        insecure=None if insecure_env is None else insecure_env.strip().lower() == "true",
        timeout_s=timeout if timeout is not None else DEFAULT_TIMEOUT_S,
    )
    if bool(cfg.cert_file) != bool(cfg.key_file):
        raise ConfigError("an OTLP client certificate needs its key, and a key its certificate")
    for f in (cfg.ca_file, cfg.cert_file, cfg.key_file, cfg.headers_file):
        if f and not Path(f).is_file():
            raise ConfigError(f"OTLP: {f} is not a readable file")
    if timeout is not None and timeout <= 0:
        raise ConfigError("the OTLP timeout must be greater than zero")
    return cfg


class Headers:
    """The export headers: the environment's, then the file's (a YAML mapping), re-read when it changes,
    so a rotated token is used without a restart."""

    def __init__(self, cfg: OtlpConfig) -> None:
        self._env = dict(cfg.env_headers)
        self._file = cfg.headers_file
        self._mtime: float | None = None
        self._from_file: dict[str, str] = {}
        self.current()  # a broken file is a start-up error, not a retry loop

    def current(self) -> dict[str, str]:
        if self._file:
            mtime = Path(self._file).stat().st_mtime
            if mtime != self._mtime:
                doc = load_yaml(self._file, "OTLP headers file")
                if doc is None:
                    doc = {}
                if not isinstance(doc, dict) or not all(isinstance(v, str | int) for v in doc.values()):
                    raise ConfigError(f"{self._file}: the OTLP headers file must map names to strings")
                self._from_file = {str(k).lower(): str(v) for k, v in doc.items()}
                self._mtime = mtime
        return {**self._env, **self._from_file}


def _read(path: str | None) -> bytes | None:
    return read_bytes(path, "TLS file") if path else None


class Transport(Protocol):
    def export(self, signal: Signal, payload: bytes, timeout_s: float | None = None) -> PartialSuccess:
        """Send one serialized Export*ServiceRequest; raise :class:`ExportError` unless acknowledged.

        ``timeout_s``: this request's (default: the configured one)."""
        ...

    def close(self) -> None: ...


_RESPONSES: dict[Signal, type[Message]] = {
    "metrics": ExportMetricsServiceResponse,
    "logs": ExportLogsServiceResponse,
}
# The services' methods (opentelemetry/proto/collector/*/v1/*_service.proto), called with the
# request already serialized.
_METHODS: dict[Signal, str] = {
    "metrics": "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
    "logs": "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
}


def _partial(response: Message) -> PartialSuccess:
    if not response.HasField("partial_success"):  # type: ignore[attr-defined]
        return PartialSuccess()
    ps = response.partial_success  # type: ignore[attr-defined]
    rejected = getattr(ps, "rejected_data_points", 0) or getattr(ps, "rejected_log_records", 0)
    return PartialSuccess(int(rejected), ps.error_message)


class GrpcTransport:
    def __init__(self, cfg: OtlpConfig) -> None:
        self.cfg = cfg
        self.headers = Headers(cfg)
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, endpoint: str) -> grpc.Channel:
        ch = self._channels.get(endpoint)
        if ch is not None:
            return ch
        parsed = urllib.parse.urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
        target = parsed.netloc or parsed.path
        plaintext = parsed.scheme == "http" or (parsed.scheme == "" and self.cfg.insecure is True)
        if plaintext:
            ch = grpc.insecure_channel(target)
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.cfg.ca_file),
                private_key=_read(self.cfg.key_file),
                certificate_chain=_read(self.cfg.cert_file),
            )
            ch = grpc.secure_channel(target, creds)
        self._channels[endpoint] = ch
        return ch

    def export(self, signal: Signal, payload: bytes, timeout_s: float | None = None) -> PartialSuccess:
        ch = self._channel(self.cfg.signal_endpoints.get(signal, self.cfg.endpoint))
        call = ch.unary_unary(_METHODS[signal], response_deserializer=_RESPONSES[signal].FromString)
        try:
            headers = self.headers.current()
        except (OSError, ConfigError) as exc:
            raise ExportError(f"headers file: {exc}", retryable=True) from exc
        try:
            response = call(payload, timeout=timeout_s or self.cfg.timeout_s, metadata=list(headers.items()))
        except grpc.RpcError as exc:
            raise _grpc_error(exc.code(), exc.details()) from exc  # type: ignore[attr-defined]
        return _partial(response)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Answer every 3xx with its own HTTPError: following it would send our headers (credentials)
    to the new location, and as a GET without the body whose 200 would read as delivered."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _redirect_error(exc: urllib.error.HTTPError) -> ExportError:
    where = urllib.parse.urlsplit(exc.headers.get("Location") or "")
    shown = f"{where.scheme}://{where.netloc}{where.path}" if where.netloc else where.path or "?"
    return ExportError(
        f"HTTP {exc.code}: the endpoint redirects to {shown}; redirects are not followed "
        "(set the OTLP endpoint to the collector itself)",
        retryable=True,
    )


class HttpTransport:
    def __init__(self, cfg: OtlpConfig) -> None:
        self.cfg = cfg
        self.headers = Headers(cfg)
        self._ssl: ssl.SSLContext | None = None
        if cfg.ca_file or cfg.cert_file:
            self._ssl = ssl.create_default_context(cafile=cfg.ca_file)
            if cfg.cert_file:
                self._ssl.load_cert_chain(cfg.cert_file, cfg.key_file)
        # build_opener keeps its default handlers (proxies from the environment included) but takes
        # our subclass in place of the redirect handler.
        self._opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=self._ssl), _NoRedirect()
        )

    def url(self, signal: Signal) -> str:
        given = self.cfg.signal_endpoints.get(signal)
        return given if given else f"{self.cfg.endpoint.rstrip('/')}/v1/{signal}"

    def export(self, signal: Signal, payload: bytes, timeout_s: float | None = None) -> PartialSuccess:
        try:
            headers = self.headers.current()
        except (OSError, ConfigError) as exc:
            raise ExportError(f"headers file: {exc}", retryable=True) from exc
        req = urllib.request.Request(
            self.url(signal),
            data=payload,
            headers={**headers, "Content-Type": "application/x-protobuf"},
            method="POST",
        )
        try:
            with self._opener.open(req, timeout=timeout_s or self.cfg.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                raise _redirect_error(exc) from exc
            detail = exc.read()[:200].decode("utf-8", "replace")
            too_large = exc.code == _TOO_LARGE_HTTP
            raise ExportError(
                f"HTTP {exc.code}: {detail or exc.reason}",
                retryable=not too_large and exc.code not in _PERMANENT_HTTP,
                too_large=too_large,
            ) from exc
        except urllib.error.URLError as exc:  # before the request was sent: refused, TLS, DNS
            # or a timeout connecting or uploading the body: the same timeout would fail for ever
            slow = isinstance(exc.reason, TimeoutError)
            raise ExportError(f"HTTP: {exc}", retryable=True, slow=slow) from exc
        except TimeoutError as exc:  # sent, no answer in time: the collector may have taken it
            raise ExportError(
                f"HTTP: no answer within the timeout ({exc})", retryable=True, maybe_delivered=True
            ) from exc
        except OSError as exc:  # reset, closed
            raise ExportError(f"HTTP: {exc}", retryable=True) from exc
        response = _RESPONSES[signal]()
        try:
            response.ParseFromString(body)
        except DecodeError:
            return PartialSuccess()  # a 2xx is the acknowledgement; a body we cannot read adds nothing
        return _partial(response)

    def close(self) -> None:
        pass


def transport(cfg: OtlpConfig) -> Transport:
    return GrpcTransport(cfg) if cfg.protocol == "grpc" else HttpTransport(cfg)
