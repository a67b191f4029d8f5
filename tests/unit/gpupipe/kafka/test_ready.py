"""gpupipe.kafka.ready: retry with backoff, what is fatal, /healthz while starting."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from confluent_kafka import KafkaError, KafkaException

from gpupipe.common.errors import BrokerUnavailableError, ConfigError
from gpupipe.kafka import ready
from gpupipe.web.server import HttpServer
from tests.conftest import free_port


def test_backoff_grows_to_the_cap_with_jitter() -> None:
    b = ready.Backoff(first_s=0.2, cap_s=2.0, rng=random.Random(1))
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

    state = ready.StartupState()
    assert ready.retry(flaky, what="Kafka", state=state, sleep=sleeps.append) == "ok"
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
        ready.retry(refused, what="Kafka", sleep=lambda s: None)
    assert len(calls) == 1


def test_config_error_is_not_retried() -> None:
    with pytest.raises(ConfigError, match="bad flag"):
        ready.retry(
            lambda: (_ for _ in ()).throw(ConfigError("bad flag")), what="x", transient=(ConfigError,)
        )


def test_not_leader_is_transient() -> None:
    exc = KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION, "Not leader for partition"))
    assert not ready.is_fatal(exc)


def test_retry_gives_up_after_the_startup_timeout() -> None:
    def down() -> None:
        raise BrokerUnavailableError("cannot reach Kafka at h:1")

    began = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match=r"cannot reach Kafka at h:1 \(gave up waiting"):
        ready.retry(down, what="Kafka", timeout_s=0.5)
    assert time.monotonic() - began < 3


def test_health_answers_503_while_starting() -> None:
    port = free_port()
    state = ready.StartupState()
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
