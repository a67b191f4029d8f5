"""Push GPU readings and XID events to an OpenTelemetry Collector: gpu.samples.v1 + gpu.xid.v1 -> OTLP.

Samples become metrics named by the OpenTelemetry hardware conventions (hw.gpu.*, hw.power,
hw.energy, hw.temperature), XIDs become log records with their catalog classification, each under a
resource per pod (docs/otel.md has the mapping). Kafka offsets are committed only after the collector
acknowledged the export: during a collector outage the batch is held and retried, and /healthz says
that exports fail. Credentials (headers) come from OTEL_EXPORTER_OTLP_HEADERS or --otlp-headers-file,
never from the command line.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from gpupipe.common.argtypes import ArgType, duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides
from gpupipe.lifecycle import service_flags, startup
from gpupipe.lifecycle.runner import KafkaNeeds, ServiceSpec, run_service
from gpupipe_consumers.otlp.settings import (
    DEFAULT_ENDPOINTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_TIMEOUT_S,
    MIN_REQUEST_BYTES,
    PROTOCOLS,
)

if TYPE_CHECKING:
    from gpupipe_consumers.otlp.export import OtlpConfig

USES_KAFKA = True

log = logging.getLogger("gpupipe.otlp")

#: One line for `gpupipe --help`.
HELP = "push GPU metrics and XID events to an OpenTelemetry Collector (OTLP)"

DEFAULT_GROUP = "gpupipe-otlp"

_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1, "": 1}


def _parse_bytes(text: str) -> int:
    """``3MiB``, ``512KiB`` or a number of bytes, at least MIN_REQUEST_BYTES."""
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise ConfigError(f"expected a size such as 3MiB, 512KiB or 1048576, got {text!r}")
    n = int(digits) * _UNITS[unit]
    if n < MIN_REQUEST_BYTES:
        raise ConfigError(f"at least {MIN_REQUEST_BYTES // 2**10}KiB, got {text!r}")
    return n


def _show_bytes(n: int) -> str:
    return f"{n // 2**20}MiB" if n % 2**20 == 0 else f"{n // 2**10}KiB" if n % 2**10 == 0 else str(n)


_request_bytes = ArgType(_parse_bytes, show=_show_bytes)


def add_arguments(p: argparse.ArgumentParser) -> None:
    service_flags.add_listen(p, serves="/metrics (the exporter's own)")
    p.add_argument("--group-id", default=DEFAULT_GROUP, help="Kafka consumer group")
    service_flags.add_from_beginning(p)
    service_flags.add_create_topics(p)
    o = p.add_argument_group("OTLP: flags win over the OTEL_EXPORTER_OTLP_* variables")
    o.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="collector: http[s]://HOST:PORT for gRPC (http:// is plaintext), or the base URL that "
        "/v1/metrics and /v1/logs are appended to for HTTP "
        f"(default: OTEL_EXPORTER_OTLP_ENDPOINT, else {DEFAULT_ENDPOINTS['grpc']} for gRPC, "
        f"{DEFAULT_ENDPOINTS['http/protobuf']} for HTTP)",
    )
    o.add_argument(
        "--otlp-protocol",
        choices=PROTOCOLS,
        default=None,
        help="transport (default: OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)",
    )
    o.add_argument(
        "--otlp-headers-file",
        default=None,
        metavar="FILE",
        help="YAML mapping of request headers (e.g. authorization), re-read when it changes; added to "
        "OTEL_EXPORTER_OTLP_HEADERS",
    )
    o.add_argument(
        "--otlp-ca-file",
        default=None,
        metavar="FILE",
        help="CA bundle for the collector's certificate (default: OTEL_EXPORTER_OTLP_CERTIFICATE)",
    )
    o.add_argument(
        "--otlp-cert-file",
        default=None,
        metavar="FILE",
        help="client certificate for mTLS (default: OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE)",
    )
    o.add_argument(
        "--otlp-key-file",
        default=None,
        metavar="FILE",
        help="client key for mTLS (default: OTEL_EXPORTER_OTLP_CLIENT_KEY)",
    )
    o.add_argument(
        "--otlp-timeout",
        type=duration_ms,
        default=None,
        metavar="DURATION",
        help=f"per export request (default: OTEL_EXPORTER_OTLP_TIMEOUT in ms, else {DEFAULT_TIMEOUT_S:g}s)",
    )
    o.add_argument(
        "--otlp-max-request-bytes",
        type=_request_bytes,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="SIZE",
        help="the most one export request may weigh, encoded: keep it under the collector's limit "
        "(gRPC receivers take 4 MiB by default); a larger batch is split, a record too large alone "
        "is dead-lettered",
    )
    startup.add_arguments(p)


def otlp_config(args: argparse.Namespace) -> OtlpConfig:
    from gpupipe_consumers.otlp.export import (
        config_from,  # gRPC and the OTLP messages load when the command runs
    )

    return config_from(
        protocol=args.otlp_protocol,
        endpoint=args.otlp_endpoint,
        headers_file=args.otlp_headers_file,
        ca_file=args.otlp_ca_file,
        cert_file=args.otlp_cert_file,
        key_file=args.otlp_key_file,
        timeout_s=None if args.otlp_timeout is None else args.otlp_timeout / 1000,
    )


def run(args: argparse.Namespace) -> int:
    from gpupipe_consumers.otlp.export import transport

    cfg = otlp_config(args)  # config errors (a broken headers file included) before any network
    tx = transport(cfg)
    extra = parse_kafka_overrides(args.kafka_config)
    spec = ServiceSpec.from_args(
        "otlp",
        args,
        KafkaNeeds(
            args.bootstrap_servers,
            topics.to_prepare([topics.SAMPLES, topics.XID, topics.DEADLETTER], create=args.create_topics),
            prefix=args.topic_prefix,
            create=args.create_topics,
            extra=extra,
        ),
    )
    from gpupipe_consumers.otlp.service import build

    return run_service(spec, lambda life: build(args, cfg, tx, extra, life))
