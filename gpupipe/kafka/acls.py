"""Least privilege per gpupipe role: the exact Kafka ACLs each service needs, and nothing more.

Pure data and logic (no Kafka import): one table, unit-tested, printed (``gpupipe acls --print``),
applied (``gpupipe acls --apply``) and checked at start-up by every service (:mod:`gpupipe.kafka.auth`).
Topic names carry ``--topic-prefix``; group and transactional ids are the services' own, overridable
per role. DESCRIBE is listed only where READ or WRITE does not imply it.
More (each role's ACLs): docs/architecture.md, "Module notes", ``kafka/acls.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpupipe.kafka import topics

#: Chargeback's private groups that read its own output back: ``<group id>.dedupe-<uuid>``.
CHARGEBACK_DEDUPE_SUFFIX = ".dedupe-"

ROLES = ("producer", "metrics", "chargeback", "alerts", "recommend", "report", "lake", "tail", "admin")
#: The topics ``gpupipe lake write`` keeps as tables (gpupipe_consumers.lake.tables; named here so that the
#: ACL table imports no service code, and checked against it by the tests).
LAKE_TOPICS = (topics.SAMPLES, topics.XID, topics.ALERTS, topics.CHARGEBACK)

# The alerts HA pair's lease topic (gpupipe_consumers.alerts.leader.LEASE_TOPIC; kept here as a string so the
# ACL table imports no service code). Its group is ``<alerts group>-leader``.
ALERTS_LEADER = "gpu.alerts.leader.v1"

DEFAULT_GROUPS = {
    "metrics": "gpupipe-metrics",
    "chargeback": "gpupipe-chargeback",
    "alerts": "gpupipe-alerts",
    "recommend": "gpupipe-recommend",
    "lake": "gpupipe-lake",
}
"""The `--group-id` defaults of the services that commit offsets."""

# Private groups that never commit: a fixed prefix plus a uuid per run.
PRIVATE_GROUP_PREFIXES = {
    "metrics": ("gpupipe-metrics-xid-",),
    "alerts": ("gpupipe-alerts-restore-",),
    "recommend": ("gpupipe-read-",),
    "report": ("gpupipe-report-", "gpupipe-read-"),
    "tail": ("gpupipe-tail-",),
}

CLUSTER = "kafka-cluster"


@dataclass(frozen=True, slots=True, order=True)
class Acl:
    """One ALLOW binding, in the words of `kafka-acls.sh` and the AdminClient."""

    principal: str
    resource_type: str  # TOPIC | GROUP | TRANSACTIONAL_ID | CLUSTER
    pattern_type: str  # LITERAL | PREFIXED
    name: str
    operation: str  # READ | WRITE | DESCRIBE | CREATE | DESCRIBE_CONFIGS | IDEMPOTENT_WRITE
    host: str = "*"

    def line(self) -> str:
        return (
            f"ALLOW {self.principal:<18} {self.operation:<16} {self.resource_type:<16} "
            f"{self.pattern_type:<8} {self.name}"
        )

    def kafka_acls_command(self) -> str:
        """The same binding as a `kafka-acls.sh` command line (for clusters managed elsewhere)."""
        res = {
            "TOPIC": f"--topic '{self.name}'",
            "GROUP": f"--group '{self.name}'",
            "TRANSACTIONAL_ID": f"--transactional-id '{self.name}'",
            "CLUSTER": "--cluster",
        }[self.resource_type]
        op = self.operation.replace("_", "").title() if "_" in self.operation else self.operation.title()
        op = {"Idempotentwrite": "IdempotentWrite", "Describeconfigs": "DescribeConfigs"}.get(op, op)
        return (
            f'kafka-acls.sh --bootstrap-server "$BOOTSTRAP" --command-config admin.properties --add '
            f"--allow-principal '{self.principal}' --operation {op} {res} "
            f"--resource-pattern-type {self.pattern_type.lower()}"
        )


def _topic(principal: str, prefix: str, base: str, *ops: str) -> list[Acl]:
    return [Acl(principal, "TOPIC", "LITERAL", topics.with_prefix(prefix, base), op) for op in ops]


def role_acls(
    role: str,
    prefix: str = "",
    principal: str | None = None,
    group: str | None = None,
) -> list[Acl]:
    """The ACLs `role` needs; `group` overrides the service's `--group-id` (and the txn-id prefix)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    p = principal or f"User:{role}"
    g = group or DEFAULT_GROUPS.get(role)
    if role == "chargeback" and group is None and prefix:
        g = f"{prefix}{g}"  # chargeback's group (and so its transactional ids) carries the prefix
    out: list[Acl] = []
    idem = Acl(p, "CLUSTER", "LITERAL", CLUSTER, "IDEMPOTENT_WRITE")
    if role == "producer":
        out += _topic(p, prefix, topics.SAMPLES, "WRITE") + _topic(p, prefix, topics.XID, "WRITE")
        out += [*_topic(p, prefix, topics.TOPOLOGY, "WRITE"), idem]
    elif role == "metrics":
        out += _topic(p, prefix, topics.SAMPLES, "READ") + _topic(p, prefix, topics.XID, "READ")
        out += [*_topic(p, prefix, topics.DEADLETTER, "WRITE"), idem]
    elif role == "chargeback":
        out += _topic(p, prefix, topics.SAMPLES, "READ")
        out += _topic(p, prefix, topics.CHARGEBACK, "READ", "WRITE") + _topic(
            p, prefix, topics.DEADLETTER, "WRITE"
        )
        out += [Acl(p, "TRANSACTIONAL_ID", "PREFIXED", f"{g}.", "WRITE"), idem]
        # Progress offsets (position vs end, for lag tooling) are committed to ``<group>.progress``.
        out.append(Acl(p, "GROUP", "LITERAL", f"{g}.progress", "READ"))
        # After an offset reset, its own output is read back (``<group>.dedupe-<uuid>``, never
        # committing) for the ids its dashboard counters must not count twice.
        out.append(Acl(p, "GROUP", "PREFIXED", f"{g}{CHARGEBACK_DEDUPE_SUFFIX}", "READ"))
    elif role == "alerts":
        out += _topic(p, prefix, topics.XID, "READ") + _topic(p, prefix, topics.SAMPLES, "READ")
        out += _topic(p, prefix, topics.ALERTS, "READ", "WRITE")
        out += _topic(p, prefix, topics.DEADLETTER, "WRITE")
        out += _topic(p, prefix, ALERTS_LEADER, "READ")  # --ha: leadership is this topic's one partition
        out += [idem]
        if g:
            out.append(Acl(p, "GROUP", "LITERAL", f"{g}-leader", "READ"))
    elif role == "recommend":
        out += _topic(p, prefix, topics.SAMPLES, "READ")
        out += _topic(p, prefix, topics.RECOMMENDATIONS, "READ", "WRITE")  # restores its open ones
        out += [*_topic(p, prefix, topics.DEADLETTER, "WRITE"), idem]
    elif role == "lake":
        for base in LAKE_TOPICS:
            out += _topic(p, prefix, base, "READ")
        out += [*_topic(p, prefix, topics.DEADLETTER, "WRITE"), idem]
    elif role == "report":
        out += _topic(p, prefix, topics.CHARGEBACK, "READ")
        out += _topic(p, prefix, topics.RECOMMENDATIONS, "READ")  # report idle
    elif role == "tail":
        for base in topics.ALL:
            out += _topic(p, prefix, base, "READ")
    elif role == "admin":
        for base in (*topics.ALL, ALERTS_LEADER):
            out += _topic(p, prefix, base, "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS")
    if g:
        out.append(Acl(p, "GROUP", "LITERAL", g, "READ"))
    for gp in PRIVATE_GROUP_PREFIXES.get(role, ()):
        out.append(Acl(p, "GROUP", "PREFIXED", gp, "READ"))
    return out


def acls_for(
    roles: list[str] | tuple[str, ...],
    prefix: str = "",
    principals: Mapping[str, str] | None = None,
    groups: Mapping[str, str] | None = None,
) -> list[Acl]:
    out: list[Acl] = []
    for role in roles:
        out += role_acls(role, prefix, (principals or {}).get(role), (groups or {}).get(role))
    return out


def parse_role_map(items: list[str], flag: str) -> dict[str, str]:
    """`['metrics=User:m1', ...]` -> {'metrics': 'User:m1'}; ValueError names the bad item."""
    out: dict[str, str] = {}
    for item in items:
        role, sep, value = item.partition("=")
        role = role.strip()
        if not sep or role not in ROLES or not value.strip():
            raise ValueError(f"{flag} expects ROLE=VALUE with ROLE one of {', '.join(ROLES)}, got {item!r}")
        out[role] = value.strip()
    return out


# Which role a subcommand runs as (its start-up access check uses that role's ACLs).
COMMAND_ROLES = {
    ("produce",): "producer",
    ("metrics",): "metrics",
    ("chargeback",): "chargeback",
    ("alerts",): "alerts",
    ("recommend",): "recommend",
    ("report", "chargeback"): "report",
    ("report", "idle"): "report",
    ("lake", "write"): "lake",
    ("tail",): "tail",
}
