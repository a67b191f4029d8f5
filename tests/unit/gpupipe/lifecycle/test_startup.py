"""gpupipe.lifecycle.startup: retry with backoff, what is fatal, /healthz while starting, shutdown."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from confluent_kafka import KafkaError, KafkaException

from gpupipe.common.errors import BrokerUnavailableError, ConfigError
from gpupipe.lifecycle import startup
from gpupipe.web.server import HttpServer
from tests.conftest import free_port


def test_backoff_grows_to_the_cap_with_jitter() -> None:
    b = startup.Backoff(first_s=0.2, cap_s=2.0, rng=random.Random(1))
    delays = [b.next() for _ in range(8)]
    assert 0.1 <= delays[0] <= 0.2
    assert all(1.0 <= d <= 2.0 for d in delays[4:])


def test_retry_waits_out_transient_errors() -> None:
    calls, sleeps = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise BrokerUnavailableError("cannot reach Kafka")
        return "ok"

    state = startup.StartupState()
    assert startup.retry(flaky, what="Kafka", state=state, sleep=sleeps.append) == "ok"
    assert len(calls) == 4 and len(sleeps) == 3
    assert state.attempts == 3 and state.last_error == "cannot reach Kafka"


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError._AUTHENTICATION,
    ],
)
def test_authentication_and_authorization_fail_at_once(code: int) -> None:
    calls = []

    def refused() -> None:
        calls.append(1)
        raise KafkaException(KafkaError(code, "refused"))

    with pytest.raises(ConfigError, match="will not pass by waiting"):
        startup.retry(refused, what="Kafka", sleep=lambda s: None)
    assert len(calls) == 1


def test_config_error_is_not_retried() -> None:
    with pytest.raises(ConfigError, match="bad flag"):
        startup.retry(
            lambda: (_ for _ in ()).throw(ConfigError("bad flag")), what="x", transient=(ConfigError,)
        )


def test_not_leader_is_transient() -> None:
    exc = KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION, "Not leader for partition"))
    assert not startup.is_fatal(exc)


def test_retry_gives_up_after_the_startup_timeout() -> None:
    def down() -> None:
        raise BrokerUnavailableError("cannot reach Kafka at h:1")

    began = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"cannot reach Kafka at h:1 \(gave up waiting"):
        startup.retry(down, what="Kafka", timeout_s=0.5)
    assert time.monotonic() - began < 3


def test_health_answers_503_while_starting() -> None:
    port = free_port()
    state = startup.StartupState()
    state.waiting_for = "Kafka at h:1"
    with contextlib.closing(HttpServer(f"127.0.0.1:{port}", service="alerts", starting=state).start()):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert err.value.code == 503
        body = json.loads(err.value.read())
        assert body["status"] == "starting" and body["waiting_for"] == "Kafka at h:1"
    # the port is free again for the service's own server
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_shutdown_deadline_remaining_and_cancel() -> None:
    stop = threading.Event()
    d = startup.ShutdownDeadline(stop, 5000, "test")
    assert d.remaining(default_s=30.0) == 30.0
    d.begin()
    try:
        assert stop.is_set()
        assert 2.5 < d.remaining() <= 3.0
    finally:
        d.cancel()


def test_shutdown_deadline_exits_with_one_line() -> None:
    code = (
        "import threading, time\n"
        "from gpupipe.lifecycle import startup\n"
        "stop = threading.Event()\n"
        "startup.ShutdownDeadline(stop, 300, 'stuck').install().begin()\n"
        "time.sleep(30)\n"
    )
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert time.monotonic() - began < 10
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0
    assert "stuck did not stop within 0.3s" in out.stderr


def test_bad_client_setting_is_one_line_and_exit_2_at_once() -> None:
    began = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpupipe",
            "alerts",
            "--bootstrap-servers",
            "127.0.0.1:1",
            "--kafka-config",
            "security.protocol=SASL_PLAINTEXT,sasl.mechanism=BOGUS",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert time.monotonic() - began < 20
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "Kafka refused: Failed to create admin client: Unsupported SASL mechanism: BOGUS" in out.stderr


def test_repeat_throttle_holds_back_a_reconnect_storm() -> None:
    import logging

    now = [0.0]
    f = startup.RepeatThrottle(every_s=10.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("gpupipe.kafka", logging.ERROR, __file__, 1, msg, (), None)

    storm = [f"Connect to ipv4#127.0.0.1:9092 failed (after {i}ms in state CONNECT)" for i in range(50)]
    passed = [r for r in (rec(m) for m in storm) if f.filter(r)]
    assert len(passed) == 1
    assert f.filter(rec("a different message"))
    now[0] = 10.5
    later = rec("Connect to ipv4#127.0.0.1:9092 failed (after 3ms in state CONNECT)")
    assert f.filter(later)
    assert later.getMessage().endswith("(49 similar lines held back)")
