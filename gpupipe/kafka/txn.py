"""A transactional producer session: begin, produce, send offsets, commit or abort, and what a
failure of any of them means.

Why one place: a consume-transform-produce service must get the same few things right around
librdkafka's transactional API, and a mistake in any of them is output lost or doubled.

* Every error is classified (:func:`classify`). A *retriable* one is retried in place, for a
  bounded time; one that *requires an abort* raises :class:`AbortRequired`: the caller aborts
  (:meth:`TransactionalSession.abort`) and replays its input from the last commit; a *fatal* one
  (fenced by a newer producer with the same ``transactional.id``, retries exhausted, ...) raises
  :class:`TransactionFatalError` and the service ends.
* ``init_transactions`` fences any older producer with the same ``transactional.id`` and aborts
  what it left open, at once rather than after ``transaction.timeout.ms``.
* ``send_offsets_to_transaction`` can block past its own timeout with the group coordinator gone
  (confluentinc/librdkafka#5456): it runs under a deadline, and a stuck producer is replaced by a
  fresh one, which fences it and aborts its transaction. A replaced producer is kept, never torn
  down: destroying one stuck in a call can abort the process.
* After "all brokers down" a producer may keep a dead coordinator and hang in its next call
  (confluentinc/librdkafka#5511): commits wait until a probe answers, then go on with a fresh one.

The constructor connects nothing; :meth:`TransactionalSession.start` creates the producer.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from gpupipe.common.errors import GpupipeError
from gpupipe.common.logs import fields
from gpupipe.kafka.stuck_call import StuckCallError, with_deadline

__all__ = [
    "AbortRequired",
    "TransactionFatalError",
    "TransactionalSession",
    "TxnOutcome",
    "classify",
    "raise_for",
]


class AbortRequired(GpupipeError):
    """The open transaction cannot commit: abort it and replay its input from the last commit."""


class TransactionFatalError(GpupipeError):
    """The transactional producer cannot go on (fenced, fatal client error, retries exhausted)."""


class TxnOutcome(enum.Enum):
    RETRY = "retry"
    ABORT = "abort"
    FATAL = "fatal"


def classify(err: object) -> TxnOutcome:
    """What an error of a transactional call means for the caller.

    The flags are checked from the most severe down, so an error carrying several takes the
    worst; an error with none of them, or one that is not a KafkaError at all, is fatal: retrying
    or replaying what nobody understands could loop for ever."""
    if not isinstance(err, KafkaError) or err.fatal():
        return TxnOutcome.FATAL
    if err.txn_requires_abort():
        return TxnOutcome.ABORT
    if err.retriable():
        return TxnOutcome.RETRY
    return TxnOutcome.FATAL


def raise_for(exc: KafkaException) -> None:
    """Return for a retriable error; raise :class:`AbortRequired` or :class:`TransactionFatalError`."""
    err = exc.args[0] if exc.args else None
    outcome = classify(err)
    if outcome is TxnOutcome.RETRY:
        return
    if not isinstance(err, KafkaError):
        raise TransactionFatalError(f"unexpected Kafka error: {exc}") from exc
    if outcome is TxnOutcome.ABORT:
        raise AbortRequired(f"{err.name()}: {err.str()}") from exc
    if err.fatal():
        raise TransactionFatalError(f"fatal Kafka error ({err.name()}): {err.str()}") from exc
    raise TransactionFatalError(f"Kafka error ({err.name()}): {err.str()}") from exc


class TransactionalSession:
    """One transactional producer (replaced when it gets stuck) and whether a transaction is open.

    ``new_producer`` builds a producer with the ``transactional.id``; every replacement uses the same
    one, which is what fences its predecessor. ``probe`` (e.g. a metadata request of the consumer)
    says whether the cluster answers after an outage; it raises KafkaException when it does not."""

    def __init__(
        self,
        new_producer: Callable[[], Any],
        *,
        probe: Callable[[], object] | None = None,
        op_timeout_s: float = 30.0,
        retry_for_s: float = 120.0,
        stuck_s: float = 15.0,
        log: logging.Logger | None = None,
    ) -> None:
        self._new_producer = new_producer
        self._probe = probe
        self.op_timeout_s = op_timeout_s
        self.retry_for_s = retry_for_s
        self.stuck_s = stuck_s  # send_offsets takes milliseconds; past this it is stuck (librdkafka#5456)
        self.log = log or logging.getLogger("gpupipe.kafka.txn")
        self.producer: Any = None
        self.in_txn = False
        # Stopping with a call stuck in librdkafka: nothing more may be called on the producer, and
        # the open transaction is left to the broker (transaction.timeout.ms) or the next start.
        self.wedged = False
        self.abandoned: list[Any] = []
        self.stop: threading.Event | None = None
        self.broker_was_down = False
        self._last_probe = 0.0

    # -- life -------------------------------------------------------------------------------------
    def start(self, stop: threading.Event | None = None) -> None:
        """Create the producer and fence every older one; a set ``stop`` gives up stuck calls."""
        self.stop = stop
        self.producer = self._new_producer()
        self._init_transactions()

    def _init_transactions(self) -> None:
        try:
            self.call(self.producer.init_transactions, self.op_timeout_s)
        except AbortRequired as exc:  # no transaction is open yet: nothing to abort
            raise TransactionFatalError(f"init_transactions failed: {exc}") from exc

    def replace(self, why: str) -> None:
        """A fresh producer with the same transactional.id fences the old one and aborts its open
        transaction at the coordinator; the old one is kept referenced (it may be stuck in a call)."""
        self.log.warning("replacing the transactional producer", extra=fields(why=why))
        self.abandoned.append(self.producer)
        self.producer = self._new_producer()
        self.in_txn = False
        self._init_transactions()

    @property
    def abandoned_producers(self) -> int:
        """Producers replaced or left in a stuck call (kept, never torn down)."""
        return len(self.abandoned) + int(self.wedged)

    def close(self, abort_timeout_s: float = 5.0) -> None:
        """Abort what is open, best effort (the service is ending on an error)."""
        if self.in_txn and not self.wedged:
            with contextlib.suppress(Exception):
                self.producer.abort_transaction(abort_timeout_s)
        self.in_txn = False

    # -- calls ------------------------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
        """Call a transactional API, retrying retriable errors for ``retry_for_s``."""
        name = what or getattr(fn, "__name__", str(fn))
        deadline = time.monotonic() + self.retry_for_s
        while True:
            try:
                return fn(*args)
            except KafkaException as exc:
                raise_for(exc)
                if time.monotonic() > deadline:
                    raise TransactionFatalError(f"{name} kept failing: {exc.args[0].str()}") from exc
                self.log.info(
                    "retriable transaction error, retrying", extra=fields(op=name, error=exc.args[0].str())
                )
                time.sleep(0.1)

    def begin(self) -> None:
        """Open a transaction unless one is open."""
        if not self.in_txn:
            self.call(self.producer.begin_transaction)
            self.in_txn = True

    def produce(self, topic: str, value: bytes | None, key: bytes | None, headers: Any = None) -> None:
        """Produce into the open transaction, waiting while the local queue is full."""
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:
                self.producer.poll(0.05)
            except KafkaException as exc:
                raise_for(exc)
                self.producer.poll(0.05)

    def send_offsets(self, offsets: list[Any], group_metadata: Any) -> None:
        """Add the consumer's offsets to the open transaction, under a deadline.

        A stuck call replaces the producer (its transaction is aborted by the fencing) and raises
        :class:`AbortRequired`; while stopping it leaves the producer wedged and raises
        :class:`~gpupipe.kafka.stuck_call.StuckCallError`: no new producer, nothing more is committed."""
        bounded = with_deadline(
            self.producer.send_offsets_to_transaction, self.stuck_s, "send_offsets", self.stop
        )
        try:
            self.call(bounded, offsets, group_metadata, self.op_timeout_s, what="send_offsets_to_transaction")
        except StuckCallError as exc:
            if self.stop is not None and self.stop.is_set():
                self.wedged = True
                raise
            self.replace(str(exc))
            raise AbortRequired(str(exc)) from exc

    def commit(self) -> None:
        self.call(self.producer.commit_transaction, self.op_timeout_s)
        self.in_txn = False

    def abort(self) -> bool:
        """Abort the open transaction, if any (True when there was one). An abort that itself needs
        an abort cannot go on: fatal."""
        if not self.in_txn:
            return False
        try:
            self.call(self.producer.abort_transaction, self.op_timeout_s)
        except AbortRequired as exc:
            raise TransactionFatalError(f"abort_transaction failed: {exc}") from exc
        self.in_txn = False
        return True

    def abort_if_possible(self) -> bool:
        """Abort the open transaction where it can be (True when one was open); for callers that
        drop its state anyway, so a failed abort needs nothing more. Fatal errors still raise."""
        if not self.in_txn:
            return False
        with contextlib.suppress(AbortRequired):
            self.call(self.producer.abort_transaction, self.op_timeout_s)
        self.in_txn = False
        return True

    def poll(self, timeout_s: float = 0.0) -> None:
        self.producer.poll(timeout_s)

    # -- outages ----------------------------------------------------------------------------------
    def broker_down(self) -> None:
        """The consumer saw every broker go down: the next commit probes first."""
        self.broker_was_down = True

    def usable(self, probe: bool = True) -> bool:
        """Whether a commit may start now: never while wedged; after an outage, only once the cluster
        answers (a probe of at most a couple of seconds per commit keeps the loop alive), and then
        with a fresh producer: that replacement raises :class:`AbortRequired`, for the caller to
        replay from its last commit before it commits again. ``probe=False`` (inside a rebalance
        callback: no nested client call) answers from what is known."""
        if self.wedged:
            return False
        if not probe or self._probe is None:
            return not self.broker_was_down
        now = time.monotonic()
        if not self.broker_was_down and now - self._last_probe < 1.0:
            return True  # probed within the last second (commits can be every 100 ms)
        self._last_probe = now
        try:
            self._probe()
        except KafkaException:
            self.broker_was_down = True
            return False
        if not self.broker_was_down:
            return True
        self.broker_was_down = False
        self.replace("the broker answers again after an outage")
        raise AbortRequired("producer replaced after an outage")
