"""The transactional session's error classification and recovery, with real confluent_kafka errors.

A real broker cannot fail a transactional call on cue; a fake producer raising KafkaException with
real KafkaError objects (the flags librdkafka sets) can. What matters: retriable errors are retried,
abortable ones ask the caller to abort and replay, fatal ones end, and the most severe flag wins.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from gpupipe.kafka.stuck_call import StuckCallError
from gpupipe.kafka.txn import (
    AbortRequired,
    TransactionalSession,
    TransactionFatalError,
    TxnOutcome,
    classify,
    raise_for,
)

RETRIABLE = KafkaError(KafkaError._TIMED_OUT, "coordinator busy", retriable=True)
ABORTABLE = KafkaError(KafkaError._STATE, "needs abort", txn_requires_abort=True)
FENCED = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
PLAIN = KafkaError(KafkaError.INVALID_CONFIG, "no flag at all")


@pytest.mark.parametrize(
    ("err", "outcome"),
    [
        (RETRIABLE, TxnOutcome.RETRY),
        (ABORTABLE, TxnOutcome.ABORT),
        (FENCED, TxnOutcome.FATAL),
        (PLAIN, TxnOutcome.FATAL),
        (KafkaError(KafkaError._STATE, "both", retriable=True, txn_requires_abort=True), TxnOutcome.ABORT),
        (
            KafkaError(KafkaError._FENCED, "all", fatal=True, retriable=True, txn_requires_abort=True),
            TxnOutcome.FATAL,
        ),
        ("not a KafkaError", TxnOutcome.FATAL),
        (None, TxnOutcome.FATAL),
    ],
    ids=["retriable", "abort", "fatal", "no-flag", "abort-beats-retry", "fatal-beats-all", "foreign", "none"],
)
def test_classify(err: Any, outcome: TxnOutcome) -> None:
    assert classify(err) is outcome


def test_raise_for_names_the_error() -> None:
    raise_for(KafkaException(RETRIABLE))  # returns: the caller retries
    with pytest.raises(AbortRequired, match="_STATE: needs abort"):
        raise_for(KafkaException(ABORTABLE))
    with pytest.raises(TransactionFatalError, match=r"fatal Kafka error \(_FENCED\): fenced"):
        raise_for(KafkaException(FENCED))
    with pytest.raises(TransactionFatalError, match=r"^Kafka error \(INVALID_CONFIG\)"):
        raise_for(KafkaException(PLAIN))
    with pytest.raises(TransactionFatalError, match="unexpected Kafka error"):
        raise_for(KafkaException("a string"))


class Producer:
    """Records the calls; ``fail[name]`` holds errors that call raises next, in order."""

    def __init__(self, fail: dict[str, list[KafkaError]] | None = None) -> None:
        self.fail = fail or {}
        self.calls: list[str] = []
        self.block = threading.Event()  # set: send_offsets_to_transaction never returns

    def _call(self, name: str) -> None:
        self.calls.append(name)
        errors = self.fail.get(name)
        if errors:
            raise KafkaException(errors.pop(0))

    def init_transactions(self, timeout: float) -> None:
        self._call("init")

    def begin_transaction(self) -> None:
        self._call("begin")

    def produce(self, topic: str, value: Any, key: Any, headers: Any = None) -> None:
        self._call("produce")

    def send_offsets_to_transaction(self, offsets: Any, meta: Any, timeout: float) -> None:
        self._call("send_offsets")
        while self.block.is_set():
            time.sleep(0.01)

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort")

    def poll(self, timeout: float) -> int:
        return 0


def session(*producers: Producer, retry_for_s: float = 5.0, **kw: Any) -> TransactionalSession:
    queue = list(producers)
    return TransactionalSession(lambda: queue.pop(0), retry_for_s=retry_for_s, **kw)


def test_the_constructor_creates_no_producer() -> None:
    made: list[Producer] = []

    def new() -> Producer:
        made.append(Producer())
        return made[-1]

    txn = TransactionalSession(new)
    assert made == [] and txn.producer is None and not txn.in_txn
    txn.start()
    assert txn.producer is made[0] and made[0].calls == ["init"]  # fences older producers first


def test_a_retriable_error_is_retried_in_place() -> None:
    prod = Producer({"commit": [RETRIABLE, RETRIABLE]})
    txn = session(prod)
    txn.start()
    txn.begin()
    txn.commit()
    assert prod.calls == ["init", "begin", "commit", "commit", "commit"]
    assert not txn.in_txn


def test_a_retriable_error_past_the_budget_is_fatal() -> None:
    prod = Producer({"commit": [RETRIABLE] * 100})
    txn = session(prod, retry_for_s=0.0)
    txn.start()
    txn.begin()
    with pytest.raises(TransactionFatalError, match="commit_transaction kept failing: coordinator busy"):
        txn.commit()


def test_an_abortable_error_asks_for_an_abort_then_the_session_goes_on() -> None:
    prod = Producer({"commit": [ABORTABLE]})
    txn = session(prod)
    txn.start()
    txn.begin()
    with pytest.raises(AbortRequired):
        txn.commit()
    assert txn.in_txn  # still open: the caller aborts it
    assert txn.abort() is True and not txn.in_txn
    assert txn.abort() is False  # nothing open: no call
    txn.begin()
    txn.commit()
    assert prod.calls == ["init", "begin", "commit", "abort", "begin", "commit"]


def test_a_fatal_error_ends_at_once() -> None:
    prod = Producer({"begin": [FENCED]})
    txn = session(prod)
    txn.start()
    with pytest.raises(TransactionFatalError, match="fenced"):
        txn.begin()
    assert prod.calls == ["init", "begin"]


def test_an_abort_that_needs_an_abort_is_fatal() -> None:
    prod = Producer({"abort": [ABORTABLE]})
    txn = session(prod)
    txn.start()
    txn.begin()
    with pytest.raises(TransactionFatalError, match="abort_transaction failed"):
        txn.abort()


def test_abort_if_possible_swallows_only_the_abortable() -> None:
    txn = session(Producer({"abort": [ABORTABLE]}), Producer({"abort": [FENCED]}))
    txn.start()
    txn.begin()
    assert txn.abort_if_possible() is True and not txn.in_txn
    txn.start()
    txn.begin()
    with pytest.raises(TransactionFatalError):
        txn.abort_if_possible()


def test_init_transactions_that_needs_an_abort_is_fatal() -> None:
    with pytest.raises(TransactionFatalError, match="init_transactions failed"):
        session(Producer({"init": [ABORTABLE]})).start()


def test_produce_retries_a_retriable_error_and_raises_the_others() -> None:
    prod = Producer({"produce": [RETRIABLE, ABORTABLE]})
    txn = session(prod)
    txn.start()
    txn.begin()
    with pytest.raises(AbortRequired):
        txn.produce("t", b"v", b"k")
    assert prod.calls.count("produce") == 2


def test_a_stuck_send_offsets_replaces_the_producer_and_asks_for_a_replay() -> None:
    stuck, fresh = Producer(), Producer()
    stuck.block.set()
    txn = session(stuck, fresh, stuck_s=0.2)
    txn.start(threading.Event())
    txn.begin()
    try:
        with pytest.raises(AbortRequired, match="did not return"):
            txn.send_offsets([], "meta")
    finally:
        stuck.block.clear()
    assert txn.producer is fresh and fresh.calls == ["init"]  # the fresh one fenced the stuck one
    assert not txn.in_txn and txn.abandoned == [stuck] and txn.abandoned_producers == 1


def test_a_stuck_send_offsets_while_stopping_leaves_the_producer_wedged() -> None:
    stuck = Producer()
    stuck.block.set()
    stop = threading.Event()
    txn = session(stuck, stuck_s=30.0)
    txn.start(stop)
    txn.begin()
    threading.Timer(0.2, stop.set).start()
    try:
        with pytest.raises(StuckCallError):
            txn.send_offsets([], "meta")
    finally:
        stuck.block.clear()
    assert txn.wedged and txn.producer is stuck and txn.abandoned_producers == 1
    assert not txn.usable()  # nothing more is committed
    txn.close()
    assert "abort" not in stuck.calls  # never called into a wedged producer


def test_after_an_outage_commits_wait_for_the_broker_then_start_from_a_fresh_producer() -> None:
    answers = {"up": False}

    def probe() -> None:
        if not answers["up"]:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "down"))

    first, fresh = Producer(), Producer()
    txn = session(first, fresh, probe=probe)
    txn.start()
    txn.broker_down()
    assert not txn.usable(probe=False)  # inside a rebalance callback: no probe
    assert not txn.usable()
    answers["up"] = True
    with pytest.raises(AbortRequired, match="replaced after an outage"):
        txn.usable()
    assert txn.producer is fresh and txn.abandoned == [first]
    assert txn.usable() and not txn.broker_was_down
