"""Whether a consumed record's hostname is the node that wrote it, before a service believes it.

The contract: a service that acts on a record's ``hostname`` (alerts pages and cordons, metrics
serves, chargeback bills, recommend names a pod's GPU) asks :meth:`NodeCheck.refuse` with the record
type, the decoded hostname and the consumed Kafka message, and gets None (take it) or the detail of
a refusal (``wrong-node: hostname 'node-b'``), which it dead-letters with reason
:data:`DEADLETTER_REASON` (the alerts service drops refused samples instead; see its docs).

Every node's producer shares one Kafka principal, so a record's own ``hostname`` proves nothing.
With ``--node-ca-file`` the service asks :class:`gpupipe.domain.node_identity.NodeVerifier` whether the
record was signed by that node's certificate (checked once per certificate and remembered; the
signature is verified per record). ``enforce`` refuses a record that fails; ``audit`` takes it
anyway, so a fleet can turn the check on, watch the counts fall to zero, then enforce. Each outcome
is counted by record type, result and mode; refusals are logged at most once a minute. Any failure
inside the check is a refusal (``bad-certificate``), never an exception.

This module is light (the flags' choices, the counting, the policy); the verifier, which loads the
cryptography package, is imported only when a service is given ``--node-ca-file``.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from gpupipe.common.logs import fields
from gpupipe.domain.node_choices import NODE_CERT_RULES, NODE_IDENTITY_MODES

__all__ = [
    "DEADLETTER_REASON",
    "NODE_CERT_RULES",
    "NODE_IDENTITY_MODES",
    "NodeCheck",
    "NodeCheckCollector",
    "NodeIdentity",
    "from_args",
]

#: The dead-letter reason of a refused record.
DEADLETTER_REASON = "node-identity"
#: Refusals are logged at most this often (the counter has every one).
_LOG_EVERY_MS = 60_000


class Verifier(Protocol):
    def check(self, hostname: str, value: bytes, headers: Any, at: float | None = None) -> str | None: ...


def _broker_time(raw: Any) -> float | None:
    """When the broker took ``raw`` (epoch seconds), on a LogAppendTime topic; else None (now).

    A certificate valid when its record was written stays valid for that record: a consumer
    catching up after an outage, or a chargeback replaying an open window past a certificate's
    rotation, decides as the first read did. Only broker time: a producer chooses CreateTime."""
    try:
        ts_type, ts = raw.timestamp()
    except Exception:  # a record without Kafka's metadata (tests, replays from files)
        return None
    return ts / 1000.0 if ts_type == TIMESTAMP_LOG_APPEND_TIME and ts and ts > 0 else None


class NodeCheck:
    """A verifier and a mode; ``results[(record, result, mode)]`` counts ``verified`` and each refusal.

    ``service`` names the logger (``gpupipe.<service>``); ``records`` are the record types whose
    ``verified`` count is shown from the start. Thread-safe, as the verifier is (the metrics service
    checks samples in its consume loop and XIDs in its XID reader)."""

    def __init__(
        self,
        verifier: Verifier,
        mode: str,
        *,
        service: str,
        records: Sequence[str] = ("XidEvent", "GpuSample"),
    ) -> None:
        if mode not in NODE_IDENTITY_MODES:
            raise ValueError(f"node identity mode {mode!r} is not one of {NODE_IDENTITY_MODES}")
        self._verifier = verifier
        self.mode = mode
        self._log = logging.getLogger(f"gpupipe.{service}")
        self.results: dict[tuple[str, str, str], int] = {(record, "verified", mode): 0 for record in records}
        self._logged_ms = -_LOG_EVERY_MS
        self._lock = threading.Lock()
        # The latest record checked passed: the alerts service's admission, which reads it right
        # after its own refuse() on its one consume thread, trusts a verified node more.
        self.last_verified = False

    def refuse(self, record: str, hostname: Any, raw: Any, now_ms: int) -> str | None:
        """Why the ``record`` (type name) in ``raw`` (the consumed Kafka message) must be refused, or None."""
        problem: str | None
        if raw is None or not isinstance(hostname, str):
            problem = "unsigned"
        else:
            try:
                problem = self._verifier.check(
                    hostname, raw.value() or b"", raw.headers(), at=_broker_time(raw)
                )
            except Exception:  # a hostile record must not stop the service
                problem = "bad-certificate"
        self.last_verified = problem is None
        key = (record, problem or "verified", self.mode)
        with self._lock:
            self.results[key] = self.results.get(key, 0) + 1
            if problem is None:
                return None
            due = now_ms - self._logged_ms >= _LOG_EVERY_MS
            if due:
                self._logged_ms = now_ms
                refused = sum(n for (_, r, _), n in self.results.items() if r != "verified")
        if due:
            self._log.warning(
                "record not proven to come from the node it names",
                extra=fields(
                    hostname=str(hostname)[:253],
                    reason=problem,
                    mode=self.mode,
                    record=record,
                    refused=refused,
                ),
            )
        if self.mode == "audit":
            return None
        return f"{problem}: hostname {str(hostname)[:253]!r}"

    def family(self, name: str, documentation: str) -> CounterMetricFamily:
        """The counts as one counter family ``name`` with labels record, result and mode."""
        fam = CounterMetricFamily(name, documentation, labels=["record", "result", "mode"])
        with self._lock:
            results = sorted(self.results.items())
        for (record, result, mode), n in results:
            fam.add_metric([record, result, mode], n)
        return fam


class NodeCheckCollector(Collector):
    """``gpupipe_<service>_node_identity_total`` of a service whose refusals are dead-lettered."""

    def __init__(self, check: NodeCheck, service: str) -> None:
        self._check, self._name = check, f"gpupipe_{service}_node_identity"

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield self._check.family(
            self._name,
            "Records checked against the certificate of the node they name (--node-ca-file), by record, "
            "result (verified, or why not) and mode (enforce: refused records are dead-lettered, reason "
            "node-identity; audit: taken anyway).",
        )


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """The node identity flags of a service that was given ``--node-ca-file``, checked."""

    ca_file: str
    mode: str  # one of NODE_IDENTITY_MODES
    cert_names: str  # one of NODE_CERT_RULES

    def check(self, service: str, records: Sequence[str]) -> NodeCheck:
        """A :class:`NodeCheck` with the CA bundle read now (ConfigError, one line, when it is bad)."""
        from gpupipe.domain.node_identity import NodeVerifier  # cryptography, only when asked for

        verifier = NodeVerifier.from_file(self.ca_file, rule=self.cert_names)
        return NodeCheck(verifier, self.mode, service=service, records=records)


def from_args(args: argparse.Namespace) -> NodeIdentity | None:
    """The flags of :func:`gpupipe.lifecycle.service_flags.add_node_identity`, checked (a bad bundle: one
    line, before any network); None without ``--node-ca-file`` (a hostname is taken as written)."""
    if not args.node_ca_file:
        return None
    ident = NodeIdentity(args.node_ca_file, args.node_identity, args.node_cert_names)
    ident.check("config", ())  # read the bundle now: a mistake is one line at start
    return ident
