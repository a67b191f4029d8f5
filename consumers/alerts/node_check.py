"""Whether a record's hostname is the node that wrote it, before the engine believes it.

An XID decides which node a drain alert cordons, and a sample can raise one (a GPU lost, a failed
row remap, a recovery action) or end one (the GPU healthy again); every node's producer shares one
Kafka principal, so the record's own ``hostname`` proves nothing. With ``--node-ca-file`` the service
asks :class:`gpupipe.node_identity.NodeVerifier` whether the record was signed by that node's
certificate. ``enforce`` refuses a record that fails (the caller dead-letters an XID and drops a
sample); ``audit`` takes it anyway, so a fleet can turn the check on, watch the counts fall to zero,
then enforce. Each outcome is counted by record type, result and mode; refusals are logged at most
once a minute. Any failure inside the check is a refusal (``bad-certificate``), never an exception.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from gpupipe.logs import fields

__all__ = ["NODE_IDENTITY_MODES", "NodeCheck"]

log = logging.getLogger("gpupipe.alerts")

#: ``--node-identity``: the first is the default.
NODE_IDENTITY_MODES = ("enforce", "audit")
#: ``--node-cert-names``, as :data:`gpupipe.node_identity.NAME_RULES` (that module loads the
#: cryptography package, which a service without node identity never needs): the first is the default.
NODE_CERT_RULES = ("kubelet", "dedicated-ca")
#: The dead-letter reason of a refused record.
DEADLETTER_REASON = "node-identity"


class Verifier(Protocol):
    def check(self, hostname: str, value: bytes, headers: Any) -> str | None: ...


class NodeCheck:
    """A verifier and a mode; ``results[(result, mode)]`` counts ``verified`` and each refusal."""

    def __init__(self, verifier: Verifier, mode: str) -> None:
        if mode not in NODE_IDENTITY_MODES:
            raise ValueError(f"node identity mode {mode!r} is not one of {NODE_IDENTITY_MODES}")
        self._verifier = verifier
        self.mode = mode
        self.results: dict[tuple[str, str, str], int] = {
            (record, "verified", mode): 0 for record in ("XidEvent", "GpuSample")
        }
        self._logged_ms = -60_000
        self.last_verified = False  # the latest record checked passed (admission trusts it more)

    def refuse(self, record: str, hostname: Any, raw: Any, now_ms: int) -> str | None:
        """Why the ``record`` (type name) in ``raw`` (the consumed Kafka message) must be refused, or None."""
        problem: str | None
        if raw is None or not isinstance(hostname, str):
            problem = "unsigned"
        else:
            try:
                problem = self._verifier.check(hostname, raw.value() or b"", raw.headers())
            except Exception:  # a hostile record must not stop the service
                problem = "bad-certificate"
        self.last_verified = problem is None
        key = (record, problem or "verified", self.mode)
        self.results[key] = self.results.get(key, 0) + 1
        if problem is None:
            return None
        if now_ms - self._logged_ms >= 60_000:
            self._logged_ms = now_ms
            log.warning(
                "record not proven to come from the node it names",
                extra=fields(
                    hostname=str(hostname)[:253],
                    reason=problem,
                    mode=self.mode,
                    record=record,
                    refused=sum(n for (_, r, _), n in self.results.items() if r != "verified"),
                ),
            )
        if self.mode == "audit":
            return None
        return f"{problem}: hostname {str(hostname)[:253]!r}"
