"""A fatal error of the idempotent producer with the real librdkafka on its mock
cluster (no broker): noticed once, never raised out of poll()/flush(), and `gpupipe produce`
stops with one line and exit 1 instead of a traceback.

librdkafka signals it twice: delivery reports of what was queued carry ``_FATAL`` with fatal()
False, and poll()/flush() raise a KafkaException whose error has fatal() True. The Publisher
matched only ``err.fatal()`` on delivery reports, so neither was seen; the raise escaped the node
agent's main loop and cli.main (which catches only GpupipeError).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError

import gpupipe_producer.agent.node_agent as node_agent
import gpupipe_producer.service as service
from gpupipe.commands.cli import main as cli_main
from gpupipe_producer.publish import Publisher, producer_config
from tests.fake_nvml import FakeNvml
from tests.librdkafka_fatal import inject_fatal_error

MOCK = {"test.mock.num.brokers": "1"}
CAUSE = "OUT_OF_ORDER_SEQUENCE_NUMBER"


def _mock_conf() -> dict[str, Any]:
    conf = producer_config("unused:9092", MOCK, linger_ms=5)
    conf.pop("bootstrap.servers", None)  # the mock cluster is the bootstrap
    return conf


def test_the_fatal_error_is_noticed_once_and_never_raised() -> None:
    fatal: list[tuple[str, str | None]] = []
    tracked: list[str | None] = []
    pub = Publisher(_mock_conf(), on_fatal=lambda err, topic: fatal.append((err.name(), topic)))
    for _ in range(3):
        pub.produce("t", b"gpu", b"sample")
    assert pub.flush(10) == 0 and pub.sent == 3
    inject_fatal_error(pub._producer, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "test")
    pub.produce("t", b"gpu", b"sample")  # refused by produce(): _FATAL
    pub.produce_tracked("x", b"gpu", b"xid", lambda err, msg: tracked.append(err and err.name()))
    deadline = time.monotonic() + 5
    while pub.fatal is None and time.monotonic() < deadline:
        pub.poll(0.05)  # raised KafkaException(fatal) before the fix
    pub.flush(1.0)
    pub.poll(0)
    assert fatal == [(CAUSE, None)], "once, naming librdkafka's own fatal error"
    assert pub.fatal is not None and pub.fatal[0].fatal()
    assert tracked == ["_FATAL"]  # a spooled XID learns it was not sent (it stays spooled)
    assert pub.sent == 3


def test_produce_stops_with_one_line_and_exit_1(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kafka: str,
    topic_prefix: str,
) -> None:
    """End to end: `gpupipe produce --source nvml` (fake NVML, a real broker: the agent waits for
    its topics, which librdkafka's mock cluster, one per client, cannot show it)."""
    fake = FakeNvml.node("H100", 2)
    monkeypatch.setattr(node_agent, "nvml_factory", lambda: fake)
    made: list[Publisher] = []

    class Seen(Publisher):  # the real Publisher; the test only needs to reach its producer
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(service, "Publisher", Seen)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)  # cli.main sets logging up for the process
    rc: list[int] = []
    argv = [
        "produce", "--source", "nvml", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix,
        "--kmsg-path", "",
        "--kubelet-socket", "", "--spool-dir", str(tmp_path), "--interval", "100ms",
        "--log-level", "error",
    ]  # fmt: skip
    # On its own thread: cli.main then installs no signal handler in the test process.
    t = threading.Thread(target=lambda: rc.append(cli_main(argv)), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not (made and made[0].sent >= 2):
            assert time.monotonic() < deadline and t.is_alive(), "the agent published nothing"
            time.sleep(0.02)
        inject_fatal_error(made[0]._producer, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "test")
        t.join(20)
    finally:
        if t.is_alive() and made and made[0].fatal is None:  # a failed wait: stop it the same way
            inject_fatal_error(made[0]._producer, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "test")
        t.join(20)
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    assert not t.is_alive() and rc == [1]
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("gpupipe produce: error:")]
    want = f"gpupipe produce: error: the Kafka producer failed fatally ({CAUSE}: test_fatal_error: test)"
    assert lines == [want]
