"""Start in any order and any cluster state: wait with backoff, report not-ready, exit only for good.

Why: on a fresh install every service starts at once, before the broker answers, before the topics
exist, while partition leaders are being elected and while another service creates the same topics.
Each of those passes by itself, so a service waits for it (retry with capped exponential backoff and
jitter, one log line per attempt at most every few seconds) and its server answers 503 "starting"
meanwhile (:mod:`gpupipe.lifecycle.runner`); a Kubernetes readiness probe then shows "starting", not a crash
loop. What will not pass (a bad flag, authentication or authorization refused) is one line and an
exit at once.

Also here: the moment the process started (:func:`process_start_ms`), where a new consumer group
begins reading (:func:`start_offsets`: offsets for that time, so records written while the service
was starting are never skipped), and the shutdown budget every service shares (``--shutdown-timeout``).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from gpupipe.common.errors import BrokerUnavailableError, ConfigError, GpupipeError
from gpupipe.common.logs import fields
from gpupipe.kafka import topics

log = logging.getLogger("gpupipe.startup")

T = TypeVar("T")

_START_MS = int(time.time() * 1000)

DEFAULT_SHUTDOWN_S = 10.0

# Kafka errors that retrying cannot fix: credentials, permissions, a bad client setting.
FATAL_CODES = frozenset(
    {
        KafkaError._AUTHENTICATION,
        KafkaError._INVALID_ARG,
        KafkaError._UNSUPPORTED_FEATURE,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.UNSUPPORTED_SASL_MECHANISM,
        KafkaError.ILLEGAL_SASL_STATE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.POLICY_VIOLATION,
        KafkaError.INVALID_REPLICATION_FACTOR,
        KafkaError.INVALID_PARTITIONS,
        KafkaError.INVALID_CONFIG,
    }
)


def mark_start(now_ms: int | None = None) -> None:
    """Record when the service started (the CLI calls this first thing; tests may pin it)."""
    global _START_MS
    _START_MS = int(time.time() * 1000) if now_ms is None else now_ms


def process_start_ms() -> int:
    return _START_MS


# -- flags -------------------------------------------------------------------------------------------
def add_arguments(
    p: argparse.ArgumentParser, *, startup_default: str | None = "0", unset_means: str = ""
) -> None:
    """``--startup-timeout`` and ``--shutdown-timeout``.

    `startup_default` None leaves the default to the command, which says in `unset_means` what it
    then does (the producer: 10s for a --duration job, else for ever); `--help` adds the rest."""
    from gpupipe.common.argtypes import duration_ms

    g = p.add_argument_group("start-up and shutdown")
    g.add_argument(
        "--startup-timeout",
        type=duration_ms,
        default=None if startup_default is None else duration_ms(startup_default),
        metavar="DURATION",
        help="give up (exit 3) when Kafka and the topics are not usable within this time; 0 waits for "
        "ever, answering 503 on /healthz meanwhile" + (f" (default: {unset_means})" if unset_means else ""),
    )
    g.add_argument(
        "--shutdown-timeout",
        type=duration_ms,
        default=round(DEFAULT_SHUTDOWN_S * 1000),
        metavar="DURATION",
        help="exit within this time of SIGTERM, broker up or down",
    )


# -- retry -------------------------------------------------------------------------------------------
class Backoff:
    """Capped exponential backoff with full jitter (0.2 s, 0.4 s, ... up to `cap_s`)."""

    def __init__(self, first_s: float = 0.2, cap_s: float = 5.0, rng: random.Random | None = None) -> None:
        self.first_s, self.cap_s, self.attempt = first_s, cap_s, 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        ceiling = min(self.cap_s, self.first_s * 2**self.attempt)
        self.attempt += 1
        return self._rng.uniform(ceiling / 2, ceiling)


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError inside a KafkaException (also when wrapped by one of our errors)."""
    for e in (exc, exc.__cause__):
        if isinstance(e, KafkaException) and e.args and isinstance(e.args[0], KafkaError):
            return e.args[0]
    return None


def is_fatal(exc: BaseException) -> bool:
    """True for what waiting will not fix: configuration, authentication, authorization."""
    if isinstance(exc, ConfigError):
        return True
    err = kafka_error(exc)
    return err is not None and (err.code() in FATAL_CODES or err.fatal())


class StartupCancelled(GpupipeError):
    """The service was asked to stop while it was still waiting to start."""


class StartupState:
    """What the service waits for, shown on /healthz while it starts."""

    def __init__(self) -> None:
        self.waiting_for = "start"
        self.attempts = 0
        self.last_error = ""

    def as_dict(self) -> dict[str, Any]:
        return {"waiting_for": self.waiting_for, "attempts": self.attempts, "last_error": self.last_error}


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    timeout_s: float = 0.0,
    state: StartupState | None = None,
    transient: tuple[type[BaseException], ...] = (BrokerUnavailableError, KafkaException, TimeoutError),
    backoff: Backoff | None = None,
    sleep: Callable[[float], Any] = time.sleep,
    stop: threading.Event | None = None,
) -> T:
    """Call ``fn`` until it succeeds; wait with backoff on transient errors, re-raise fatal ones.

    ``timeout_s`` 0 waits for ever. After the deadline the last error is raised as
    BrokerUnavailableError (exit 3); a fatal error becomes a ConfigError (exit 2) at once. A set
    ``stop`` ends the wait with :class:`StartupCancelled` (SIGTERM while starting is a clean exit).
    """
    backoff = backoff or Backoff()
    state = state or StartupState()
    state.waiting_for = what
    began = time.monotonic()
    last_log = 0.0
    while True:
        try:
            result = fn()
        except transient as exc:
            message = _message(exc)
            if is_fatal(exc):
                if isinstance(exc, ConfigError):
                    raise
                err = kafka_error(exc)
                detail = err.str() if err is not None else message
                raise ConfigError(f"Kafka refused: {detail} (will not pass by waiting; {what})") from exc
            state.attempts += 1
            state.last_error = message
            elapsed = time.monotonic() - began
            if timeout_s and elapsed >= timeout_s:
                raise BrokerUnavailableError(f"{message} (gave up waiting after {elapsed:.0f}s)") from exc
            delay = backoff.next()
            if timeout_s:
                delay = min(delay, max(0.0, timeout_s - elapsed))
            # Quiet on the first failure (a job's one-line error stays one line), then every 10s.
            if state.attempts >= 2 and time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                log.warning(
                    "waiting: %s",
                    what,
                    extra=fields(attempt=state.attempts, error=message, retry_in_s=round(delay, 2)),
                )
            if stop is None:
                sleep(delay)
            elif stop.wait(delay):
                raise StartupCancelled(f"stopped while waiting for {what}") from exc
            continue
        if state.attempts:
            log.info("ready: %s", what, extra=fields(attempts=state.attempts))
        return result


def _message(exc: BaseException) -> str:
    err = kafka_error(exc)
    if err is not None and not isinstance(exc, BrokerUnavailableError):
        return err.str()
    return str(exc) or type(exc).__name__


# -- Kafka readiness ---------------------------------------------------------------------------------
def check_topics_ready(admin: Any, names: Sequence[str], timeout_s: float = 5.0) -> None:
    """Raise BrokerUnavailableError unless every topic exists and each partition has a leader."""
    md = admin.list_topics(timeout=timeout_s)
    for name in names:
        t = md.topics.get(name)
        if t is None:
            raise BrokerUnavailableError(f"topic {name} does not exist yet")
        if t.error is not None:
            if t.error.code() in FATAL_CODES:
                raise KafkaException(t.error)
            raise BrokerUnavailableError(f"topic {name}: {t.error.str()}")
        if not t.partitions:
            raise BrokerUnavailableError(f"topic {name} has no partitions yet")
        for p in t.partitions.values():
            if p.error is not None or p.leader < 0:
                raise BrokerUnavailableError(f"topic {name} partition {p.id} has no leader yet")


def prepare_kafka(
    bootstrap: str,
    bases: Iterable[str],
    *,
    prefix: str = "",
    create: bool = True,
    specs: Mapping[str, topics.TopicSpec] | None = None,
    extra: Mapping[str, str] | None = None,
    timeout_s: float = 0.0,
    state: StartupState | None = None,
    exact: Iterable[str] = (),
    stop: threading.Event | None = None,
) -> None:
    """Wait until the broker answers and the topics (created when `create`) have leaders.

    `bases` are base names (prefixed here); `exact` are full names used as given (overrides).
    Races with another service creating the same topics are harmless (TOPIC_ALREADY_EXISTS).
    """
    from gpupipe.kafka.admin import client_config, ensure_topics, wait_for_broker

    bases = list(bases)
    exact = list(exact)
    names = [topics.with_prefix(prefix, b) for b in bases] + exact
    state = state or StartupState()

    def attempt() -> None:
        wait_for_broker(bootstrap, timeout_s=5.0, extra=extra)
        if create:
            ensure_topics(bootstrap, bases, prefix=prefix, specs=specs, extra=extra, timeout_s=10.0)
            if exact:
                ensure_topics(bootstrap, exact, extra=extra, timeout_s=10.0)
        conf = client_config(bootstrap, extra)
        check_topics_ready(AdminClient(conf), names)

    what = f"Kafka at {bootstrap} with topics {', '.join(names)}"
    retry(attempt, what=what, timeout_s=timeout_s, state=state, stop=stop)


# -- where a new consumer group starts -------------------------------------------------------------
def start_offsets(
    consumer: Any, parts: Sequence[TopicPartition], start_ms: int, timeout_s: float = 10.0
) -> list[TopicPartition] | None:
    """Offsets to assign: the committed ones, else the first record at or after `start_ms`.

    None when every partition has a committed offset (the default assignment is right). When no
    record at or after `start_ms` exists yet, the high watermark read *before* that lookup is used:
    any record written since has a later timestamp and so sits at or after it (no gap, no replay).
    """
    committed = consumer.committed(list(parts), timeout=timeout_s)
    fresh = [tp for tp in committed if tp.offset < 0]
    if not fresh:
        return None
    highs = {
        (tp.topic, tp.partition): consumer.get_watermark_offsets(
            TopicPartition(tp.topic, tp.partition), timeout=timeout_s
        )[1]
        for tp in fresh
    }
    found = consumer.offsets_for_times(
        [TopicPartition(tp.topic, tp.partition, start_ms) for tp in fresh], timeout=timeout_s
    )
    at = {(tp.topic, tp.partition): tp.offset for tp in found}
    out = []
    for tp in committed:
        key = (tp.topic, tp.partition)
        if tp.offset >= 0:
            out.append(TopicPartition(tp.topic, tp.partition, tp.offset))
        else:
            off = at.get(key, -1)
            out.append(TopicPartition(tp.topic, tp.partition, off if off >= 0 else highs[key]))
    return out


# -- bounded shutdown ------------------------------------------------------------------------------
class ShutdownDeadline:
    """SIGTERM/SIGINT set `stop` and arm a deadline: past it, one line on stderr and exit now.

    Why: with the broker gone, librdkafka's flush/close and a transaction abort can each wait for
    their own timeouts (30 s and more), longer than Kubernetes' grace period; SIGKILL would then
    lose what a clean exit could still say. Services should finish well within the budget (the
    producer sizes its flush by :meth:`remaining`); the deadline is the backstop.
    """

    def __init__(self, stop: threading.Event, timeout_ms: int, service: str) -> None:
        self.stop = stop
        self.timeout_s = max(0.1, timeout_ms / 1000.0) if timeout_ms else DEFAULT_SHUTDOWN_S
        self.service = service
        self.signalled_at: float | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._wakeup: tuple[Any, Any] | None = None

    def install(self) -> ShutdownDeadline:
        """Handle SIGTERM/SIGINT. The countdown is also armed from a watcher thread woken through
        ``signal.set_wakeup_fd``: a Python signal handler runs only when the main thread gets back
        to Python, which a librdkafka call stuck in C (see the chargeback's commit) may never do."""
        if threading.current_thread() is not threading.main_thread():
            return self
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        import socket

        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)  # kept open for the life of the process

        def watch() -> None:
            while True:
                data = reader.recv(64)
                if not data or any(b in (signal.SIGTERM, signal.SIGINT) for b in data):
                    break
            self.begin()

        threading.Thread(target=watch, name="shutdown-watch", daemon=True).start()
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.begin()

    def begin(self) -> None:
        """Start the countdown (also for a stop that does not come from a signal)."""
        self.stop.set()
        with self._lock:
            if self._timer is not None:
                return
            self.signalled_at = time.monotonic()
            self._timer = threading.Timer(self.timeout_s, self._expired)
            self._timer.daemon = True
            self._timer.name = "shutdown-deadline"
            self._timer.start()

    def remaining(self, default_s: float | None = None) -> float:
        """Seconds left before the deadline (minus a margin to report), or `default_s` when not stopping."""
        if self.signalled_at is None:
            return self.timeout_s if default_s is None else default_s
        left = self.timeout_s - (time.monotonic() - self.signalled_at) - 2.0
        return max(0.0, left)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expired(self) -> None:
        if os.environ.get("GPUPIPE_SHUTDOWN_TRACEBACK"):  # diagnosis: where every thread is stuck
            import faulthandler

            faulthandler.dump_traceback(all_threads=True)
        try:
            sys.stderr.write(
                f"gpupipe: error: {self.service} did not stop within {self.timeout_s:g}s of the stop "
                "signal (broker unreachable?); exiting now, unfinished work is redone on restart\n"
            )
            sys.stderr.flush()
        finally:
            os._exit(1)


class StuckCallError(GpupipeError):
    """A client call did not return within its deadline (see :func:`with_deadline`)."""


def with_deadline(
    fn: Callable[..., T], deadline_s: float, what: str, stop: threading.Event | None = None
) -> Callable[..., T]:
    """``fn`` run in a helper thread that the caller waits on for at most ``deadline_s``.

    For the few librdkafka calls that can block past their own timeout (send_offsets_to_transaction
    with the group coordinator gone, confluentinc/librdkafka#5456): the caller gets
    StuckCallError instead of hanging, and replaces the client. The stuck thread is left behind
    (a daemon; it cannot be interrupted) along with the abandoned client. A set `stop` ends the
    wait early (the service is shutting down: it must not wait out the deadline)."""

    def call(*args: Any) -> T:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=target, name=f"deadline:{what}", daemon=True)
        t.start()
        end = time.monotonic() + deadline_s
        while t.is_alive() and time.monotonic() < end:
            t.join(0.1)
            if stop is not None and stop.is_set() and t.is_alive():
                raise StuckCallError(f"{what} still running when the service was asked to stop")
        if t.is_alive():
            raise StuckCallError(f"{what} did not return within {deadline_s:g}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return call


# -- quiet outages ---------------------------------------------------------------------------------
class RepeatThrottle(logging.Filter):
    """Let a log line through once per `every_s` per shape (digits ignored), counting the rest.

    Why: while the broker is down, librdkafka reports every reconnect attempt of every client
    ("Connect to ... failed: Connection refused"), about 20 lines a second per service; the first
    line and a periodic reminder with how many were held back say the same."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = _DIGITS.sub("N", record.getMessage())
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (-1e18, 0))
            if now - last < self.every_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
            if len(self._seen) > 1000:  # bounded: forget the oldest shapes
                for k in sorted(self._seen, key=lambda k: self._seen[k][0])[:500]:
                    del self._seen[k]
        if held:
            record.msg = f"{record.getMessage()} ({held} similar lines held back)"
            record.args = ()
        return True


_DIGITS = re.compile(r"\d+")
