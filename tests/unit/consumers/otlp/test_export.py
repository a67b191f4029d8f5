"""How the transports read a collector's refusals: which are final, which mean "too large, split
it", which mean "sent, maybe taken" (a timeout after the request went out), and that a redirect is
an error, never followed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest

from gpupipe_consumers.otlp.export import ExportError, HttpTransport, _grpc_error, config_from


@pytest.mark.parametrize(
    ("code", "detail", "retryable", "too_large", "maybe_delivered"),
    [
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "grpc: received message larger than max (5 vs. 4)",
            False,
            True,
            False,
        ),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "memory limiter: data refused", True, False, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True, False, True),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad", False, False, False),
        (grpc.StatusCode.UNAVAILABLE, "down", True, False, False),
    ],
)
def test_grpc_status_codes(
    code: grpc.StatusCode, detail: str, retryable: bool, too_large: bool, maybe_delivered: bool
) -> None:
    err = _grpc_error(code, detail)
    assert (err.retryable, err.too_large, err.maybe_delivered) == (retryable, too_large, maybe_delivered)


class Answers:
    """A local HTTP endpoint answering each POST with ``(status, headers, delay_s)``."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, str], float] = (200, {}, 0.0)
        self.gets = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.gets += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, delay = outer.answer
                time.sleep(delay)
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the client timed out meanwhile

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = False  # server_close joins the handlers
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="otlp-answers", daemon=True
        )
        self.thread.start()

    def transport(self, timeout_s: float = 5.0) -> HttpTransport:
        port = self.server.server_address[1]
        return HttpTransport(
            config_from(
                protocol="http/protobuf",
                endpoint=f"http://127.0.0.1:{port}",
                headers_file=None,
                ca_file=None,
                cert_file=None,
                key_file=None,
                timeout_s=timeout_s,
                environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t"},
            )
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def answers() -> Iterator[Answers]:
    a = Answers()
    try:
        yield a
    finally:
        a.close()


def refusal(tx: HttpTransport, **kw: Any) -> ExportError:
    with pytest.raises(ExportError) as info:
        tx.export("metrics", b"", **kw)
    return info.value


@pytest.mark.parametrize("status", [302, 303, 307])
def test_a_redirect_is_an_error_and_not_followed(answers: Answers, status: int) -> None:
    answers.answer = (status, {"Location": "http://elsewhere.example:8080/collect?token=x"}, 0.0)
    err = refusal(answers.transport())
    assert err.retryable and not err.too_large
    assert f"HTTP {status}" in str(err) and "http://elsewhere.example:8080/collect" in str(err)
    assert "token=x" not in str(err)  # a query may hold a secret: not in logs or /healthz
    assert answers.gets == 0


def test_413_means_split_it_and_400_means_bad_data(answers: Answers) -> None:
    answers.answer = (413, {}, 0.0)
    err = refusal(answers.transport())
    assert err.too_large and not err.retryable
    answers.answer = (400, {}, 0.0)
    err = refusal(answers.transport())
    assert not err.too_large and not err.retryable


def test_a_timeout_after_sending_may_have_delivered(answers: Answers) -> None:
    answers.answer = (200, {}, 1.0)
    tx = answers.transport(timeout_s=5.0)
    err = refusal(tx, timeout_s=0.2)  # the per-request timeout wins over the configured one
    assert err.retryable and err.maybe_delivered
    answers.answer = (200, {}, 0.0)
    tx.export("metrics", b"")


def test_a_body_not_taken_in_time_is_slow_not_delivered() -> None:
    # A collector (or a link) that does not take the body: the upload itself times out.
    with socket.create_server(("127.0.0.1", 0), backlog=1) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        port = srv.getsockname()[1]
        tx = HttpTransport(
            config_from(
                protocol="http/protobuf",
                endpoint=f"http://127.0.0.1:{port}",
                headers_file=None,
                ca_file=None,
                cert_file=None,
                key_file=None,
                timeout_s=0.5,
                environ={},
            )
        )
        with pytest.raises(ExportError) as info:
            tx.export("metrics", b"x" * (32 << 20))  # never read: the send buffers fill
    err = info.value
    assert err.retryable and err.slow and not err.maybe_delivered


def test_a_refused_connection_was_not_delivered() -> None:
    a = Answers()
    tx = a.transport()
    a.close()
    err = refusal(tx)
    assert err.retryable and not err.maybe_delivered
