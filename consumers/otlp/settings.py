"""The exporter's defaults, apart from the transports so that building the CLI parser loads no gRPC."""

from __future__ import annotations

from typing import Literal

Protocol_ = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[Protocol_, ...] = ("grpc", "http/protobuf")
#: The OTLP defaults (the exporter specification): gRPC on 4317, HTTP on 4318.
DEFAULT_ENDPOINTS: dict[Protocol_, str] = {
    "grpc": "http://localhost:4317",
    "http/protobuf": "http://localhost:4318",
}
DEFAULT_TIMEOUT_S = 10.0
#: The most one export request may weigh, encoded: under the 4 MiB that a collector's gRPC receiver
#: takes by default (``max_recv_msg_size_mib``) with room for framing; OTLP/HTTP takes 20 MiB.
DEFAULT_MAX_REQUEST_BYTES = 3 * 2**20
#: Below this, ordinary records (a few KB of OTLP each) would be dead-lettered as too large.
MIN_REQUEST_BYTES = 64 * 2**10
