"""`gpupipe otlp`'s exporter settings: flags, then OTEL_EXPORTER_OTLP_*, then OTLP's defaults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.otlp.export import Headers, HttpTransport, config_from

NONE: dict[str, Any] = {
    "protocol": None,
    "endpoint": None,
    "headers_file": None,
    "ca_file": None,
    "cert_file": None,
    "key_file": None,
    "timeout_s": None,
}


def cfg(environ: dict[str, str] | None = None, **flags: Any) -> Any:
    return config_from(**{**NONE, **flags}, environ=environ or {})


def test_defaults_are_otlps() -> None:
    c = cfg()
    assert (c.protocol, c.endpoint, c.timeout_s) == ("grpc", "http://localhost:4317", 10.0)
    assert cfg(protocol="http/protobuf").endpoint == "http://localhost:4318"


def test_environment_then_flags() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318",
        "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "https://logs:4318/custom/logs",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc, x-tenant = t1",
    }
    c = cfg(env)
    assert (c.protocol, c.endpoint, c.timeout_s) == ("http/protobuf", "https://collector:4318", 2.5)
    assert c.env_headers == {"authorization": "Bearer abc", "x-tenant": "t1"}
    http = HttpTransport(c)
    assert http.url("metrics") == "https://collector:4318/v1/metrics"
    assert http.url("logs") == "https://logs:4318/custom/logs"
    flagged = cfg(env, protocol="grpc", endpoint="http://other:4317", timeout_s=1.0)
    assert (flagged.protocol, flagged.endpoint, flagged.timeout_s) == ("grpc", "http://other:4317", 1.0)
    assert flagged.signal_endpoints == {}  # the flag names one endpoint for both signals


@pytest.mark.parametrize(
    ("environ", "flags", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, {}, "must be one of grpc, http/protobuf"),
        ({}, {"protocol": "http/protobuf", "endpoint": "collector:4318"}, "must start with http"),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, {}, "is not key=value"),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "5s"}, {}, "must be milliseconds"),
        ({}, {"cert_file": __file__}, "needs its key"),
        ({}, {"ca_file": "/nonexistent/ca.pem"}, "is not a readable file"),
    ],
)
def test_bad_settings_are_one_line(environ: dict[str, str], flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg(environ, **flags)


def test_headers_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    f = tmp_path / "headers.yaml"
    f.write_text("Authorization: Bearer one\n")
    h = Headers(cfg({"OTEL_EXPORTER_OTLP_HEADERS": "x-env=1"}, headers_file=str(f)))
    assert h.current() == {"x-env": "1", "authorization": "Bearer one"}
    f.write_text("Authorization: Bearer two\n")
    os.utime(f, (1, 1))  # a different mtime, however fast the rewrite
    assert h.current()["authorization"] == "Bearer two"
    f.write_text("- not a mapping\n")
    os.utime(f, (2, 2))
    with pytest.raises(ConfigError, match="must map names to strings"):
        h.current()
