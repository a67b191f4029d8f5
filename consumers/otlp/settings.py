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
