"""Whether an XID's hostname is the node that wrote it, before the engine believes it.

An XID decides which node a drain alert cordons, and every node's producer shares one Kafka
principal, so the record's own ``hostname`` proves nothing. With ``--node-ca-file`` the service asks
:class:`gpupipe.node_identity.NodeVerifier` whether the record was signed by that node's certificate.
``enforce`` dead-letters a record that fails (reason ``node-identity``); ``audit`` takes it anyway,
so a fleet can turn the check on, watch the counts fall to zero, then enforce. Each outcome is
counted by result and mode; refusals are logged at most once a minute.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from gpupipe.logs import fields

__all__ = ["NODE_IDENTITY_MODES", "NodeCheck"]

log = logging.getLogger("gpupipe.alerts")

#: ``--node-identity``: the first is the default.
NODE_IDENTITY_MODES = ("enforce", "audit")
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
        self.results: dict[tuple[str, str], int] = {("verified", mode): 0}
        self._logged_ms = -60_000

    def refuse(self, hostname: Any, raw: Any, now_ms: int) -> str | None:
        """The dead-letter detail when the XID in ``raw`` (a consumed Kafka message) must be refused."""
        if raw is None or not isinstance(hostname, str):
            problem: str | None = "unsigned"
        else:
            problem = self._verifier.check(hostname, raw.value() or b"", raw.headers())
        result = problem or "verified"
        self.results[(result, self.mode)] = self.results.get((result, self.mode), 0) + 1
        if problem is None:
            return None
        if now_ms - self._logged_ms >= 60_000:
            self._logged_ms = now_ms
            log.warning(
                "XID not proven to come from the node it names",
                extra=fields(
                    hostname=str(hostname)[:253],
                    reason=problem,
                    mode=self.mode,
                    refused=sum(n for (r, _), n in self.results.items() if r != "verified"),
                ),
            )
        if self.mode == "audit":
            return None
        return f"{problem}: hostname {str(hostname)[:253]!r}"
