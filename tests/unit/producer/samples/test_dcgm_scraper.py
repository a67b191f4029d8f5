"""The dcgm-exporter scraper against a real local HTTP server: success, down, garbage, slow, HTTP error."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpupipe_producer.samples.dcgm_scraper import DcgmExporterScraper

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "dcgm"


class Exporter:
    """A stand-in dcgm-exporter: serves ``body`` with ``status``; ``hold`` makes it hang until released."""

    def __init__(self) -> None:
        self.body = (FIXTURES / "a30-mig-busy.prom").read_bytes()
        self.status = 200
        self.hold = threading.Event()
        self.release = threading.Event()
        ex = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if ex.hold.is_set():
                    ex.release.wait(10)
                self.send_response(ex.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(ex.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    ex = Exporter()
    yield ex
    ex.close()


def scraper(url: str, errors: list[str], **kw: object) -> DcgmExporterScraper:
    return DcgmExporterScraper(url, interval_s=1.0, timeout_s=0.3, on_error=errors.append, **kw)  # type: ignore[arg-type]


def test_a_scrape_gives_the_readings(exporter: Exporter) -> None:
    errors: list[str] = []
    s = scraper(exporter.url, errors)
    assert s.readings() == {}
    assert s.scrape_once()
    assert s.readings() == {
        ("GPU-603a8873-0edd-c157-ce48-2078e8b1a935", 1): {
            "gr_engine_active_ratio": 0.381124,
            "tensor_active_ratio": 0.022137,
        }
    }
    assert errors == []


def test_an_exporter_that_is_down_is_counted_each_time_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    errors: list[str] = []
    s = scraper(f"http://127.0.0.1:{port}/metrics", errors)
    with caplog.at_level(logging.WARNING, logger="gpupipe.dcgm"):
        assert not s.scrape_once() and not s.scrape_once()
    assert errors == ["connect", "connect"]
    assert len([r for r in caplog.records if "scrape" in r.getMessage()]) == 1
    assert s.readings() == {}


def test_garbage_and_http_errors_keep_the_last_good_readings_until_they_age_out(exporter: Exporter) -> None:
    now = [100.0]
    errors: list[str] = []
    s = scraper(exporter.url, errors, max_age_s=5.0, clock=lambda: now[0])
    assert s.scrape_once()
    exporter.body = b"<html>502 Bad Gateway</html>\n"
    assert not s.scrape_once()
    exporter.status = 503
    assert not s.scrape_once()
    assert errors == ["parse", "http"]
    assert s.readings()  # the last good scrape, still young
    now[0] += 6.0
    assert s.readings() == {}


def test_a_slow_exporter_is_given_up_on_within_the_timeout(exporter: Exporter) -> None:
    exporter.hold.set()
    errors: list[str] = []
    s = scraper(exporter.url, errors)
    began = time.monotonic()
    assert not s.scrape_once()
    assert time.monotonic() - began < 3.0  # bounded by timeout_s (0.3 s), not by the server's 10 s hang
    assert errors == ["timeout"]


def test_run_scrapes_until_stopped(exporter: Exporter) -> None:
    s = DcgmExporterScraper(exporter.url, interval_s=0.05, timeout_s=0.3)
    stop = threading.Event()
    t = threading.Thread(target=s.run, args=(stop,), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while s.scrapes < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(5)
    assert s.scrapes >= 2 and not t.is_alive()
