"""Wait until Kafka is usable: retry with backoff, report not-ready, fail at once only for good.

:func:`retry` calls a function until it succeeds, waiting with capped, jittered backoff on transient
errors and raising at once what waiting will not fix (:func:`is_fatal`: configuration,
authentication, authorization). :func:`prepare_kafka` uses it to wait for the broker and the topics'
leaders; :class:`StartupState` is what ``/healthz`` shows meanwhile (docs/operations.md).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from gpupipe.common.errors import BrokerUnavailableError, ConfigError, GpupipeError
from gpupipe.common.logs import fields
from gpupipe.kafka import topics

log = logging.getLogger("gpupipe.startup")

T = TypeVar("T")

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
