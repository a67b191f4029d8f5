"""Clear, fast failures on a secured cluster: wrong password, untrusted CA, missing ACL.

librdkafka answers all three with retries and a generic "Broker transport failure" (or, for a
topic the principal may not describe, "topic does not exist"). Here each becomes one line naming
the principal, the resource and the operation, and the service exits instead of spinning:

- `classify_client_error` turns the first authentication/TLS error a client reports (error_cb) into
  that line; `gpupipe.kafka.admin.wait_for_broker` fails on it at once.
- `check_access` asks the broker which operations the principal is allowed on the role's topics and
  groups (KIP-430 authorized operations) and names the first one missing. ACLs applied right
  before a service starts may not have reached the broker yet, so it retries for a bounded time
  (`--kafka-authz-wait`) before failing.
"""

from __future__ import annotations

import logging
import ssl
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from gpupipe.common.errors import GpupipeError
from gpupipe.kafka import acls

log = logging.getLogger("gpupipe.kafka")

SECURED_PROTOCOLS = frozenset({"SSL", "SASL_SSL", "SASL_PLAINTEXT"})


class KafkaAuthError(GpupipeError):
    """The broker refused who we are (credentials, certificate) or what we asked (ACL)."""


def principal_of(conf: Mapping[str, Any]) -> str:
    """The principal the broker will see, as far as the client can tell (for error lines)."""
    proto = str(conf.get("security.protocol", "PLAINTEXT")).upper()
    if proto.startswith("SASL") and conf.get("sasl.username"):
        return f"User:{conf['sasl.username']}"
    cert = conf.get("ssl.certificate.location")
    if proto == "SSL" and cert:
        try:
            decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]
            for rdn in decoded.get("subject", ()):
                for k, v in rdn:
                    if k == "commonName":
                        return f"User:{v}"
        except (OSError, ssl.SSLError, ValueError):
            pass
        return f"the certificate {cert}"
    return "User:ANONYMOUS"


def is_secured(conf: Mapping[str, Any]) -> bool:
    return str(conf.get("security.protocol", "PLAINTEXT")).upper() in SECURED_PROTOCOLS


def classify_client_error(code_name: str, text: str, bootstrap: str, principal: str) -> str | None:
    """One line for an authentication or TLS failure reported by librdkafka, None for anything else."""
    if code_name == "_AUTHENTICATION" or "SASL authentication error" in text:
        return (
            f"Kafka at {bootstrap} refused to authenticate {principal}: wrong user name or password "
            f"(operation: SASL authenticate; broker said: {_tail(text)})"
        )
    if code_name == "_SSL" or "SSL handshake failed" in text:
        if "certificate verify failed" in text:
            return (
                f"TLS to Kafka at {bootstrap} failed: the broker's certificate is not signed by a CA we "
                f"trust (set ssl.ca.location to the cluster's CA; principal {principal}, "
                "operation: TLS handshake)"
            )
        return f"TLS to Kafka at {bootstrap} failed for {principal}: {_tail(text)}"
    return None


def _tail(text: str) -> str:
    """librdkafka prefixes errors with the broker name; keep the part after it."""
    return text.split(": ", 1)[1] if text.startswith(("sasl_", "ssl://", "plaintext://")) else text


# -- start-up access check -------------------------------------------------------------------------

Need = tuple[str, str, str]  # (resource type, name, operation)


def needs_for(role: str, prefix: str, group: str | None, only_topic: str | None = None) -> list[Need]:
    """What to check at start: the role's topic and group ACLs (not cluster/txn ids: not describable).

    A PREFIXED group ACL is checked on a sample name under that prefix."""
    out: list[Need] = []
    for a in acls.role_acls(role, prefix, group=group):
        if a.resource_type == "TOPIC":
            if only_topic is not None and a.name != only_topic:
                continue
            out.append(("TOPIC", a.name, a.operation))
        elif a.resource_type == "GROUP":
            name = a.name + str(uuid.uuid4()) if a.pattern_type == "PREFIXED" else a.name
            out.append(("GROUP", name, a.operation))
    if only_topic is not None and not any(n[0] == "TOPIC" for n in out):
        out.append(("TOPIC", only_topic, "READ"))
    return out


def missing_access(admin: Any, needs: list[Need], timeout_s: float = 10.0) -> list[Need]:
    """The needs the broker does not grant. A topic that does not exist is not reported (creation
    or the service's own check handles that); a group the principal may not describe is."""
    from confluent_kafka import KafkaError, KafkaException, TopicCollection

    missing: list[Need] = []
    topic_names = sorted({n for t, n, _ in needs if t == "TOPIC"})
    group_names = sorted({n for t, n, _ in needs if t == "GROUP"})
    allowed: dict[tuple[str, str], set[str] | None] = {}
    if topic_names:
        futs = admin.describe_topics(
            TopicCollection(topic_names), include_authorized_operations=True, request_timeout=timeout_s
        )
        for name, fut in futs.items():
            try:
                ops = fut.result().authorized_operations
                allowed[("TOPIC", name)] = {o.name for o in ops or ()}
            except KafkaException as exc:
                code = exc.args[0].code()
                # absent (creation handles it) or a transient broker error: not decided here
                allowed[("TOPIC", name)] = set() if code == KafkaError.TOPIC_AUTHORIZATION_FAILED else None
    if group_names:
        futs = admin.describe_consumer_groups(
            group_names, include_authorized_operations=True, request_timeout=timeout_s
        )
        for name, fut in futs.items():
            try:
                ops = fut.result().authorized_operations
                # An unknown group comes back without operations; describing it proved DESCRIBE only.
                allowed[("GROUP", name)] = {o.name for o in ops} if ops else None
            except KafkaException as exc:
                # coordinator not ready/moved and the like: the consumer itself will retry those
                code = exc.args[0].code()
                allowed[("GROUP", name)] = set() if code == KafkaError.GROUP_AUTHORIZATION_FAILED else None
    for rtype, name, op in needs:
        ops = allowed.get((rtype, name))
        if ops is not None and op not in ops:
            missing.append((rtype, name, op))
    return missing


def denied_line(principal: str, need: Need, role: str, more: int = 0) -> str:
    rtype, name, op = need
    if rtype == "GROUP" and name[-36:].count("-") == 4:
        name = name[:-36] + "*"  # a sample name under a prefixed ACL
    extra = f" (and {more} more)" if more else ""
    return (
        f"Kafka denied {principal} {op} on {rtype.lower().replace('_', ' ')} {name}{extra}: "
        "no ACL allows it; "
        f"grant the '{role}' role's ACLs (gpupipe acls --print --role {role})"
    )


def check_access(
    admin_factory: Callable[[dict[str, Any]], Any],
    conf: dict[str, Any],
    role: str,
    needs: list[Need],
    wait_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Raise KafkaAuthError naming the first missing permission, after retrying up to `wait_s`."""
    admin = admin_factory(conf)
    principal = principal_of(conf)
    deadline = clock() + wait_s
    logged = False
    while True:
        missing = missing_access(admin, needs)
        if not missing:
            return
        if clock() >= deadline:
            raise KafkaAuthError(denied_line(principal, missing[0], role, len(missing) - 1))
        if not logged:
            log.warning(
                "waiting for ACLs",
                extra={"fields": {"principal": principal, "missing": [" ".join(m) for m in missing]}},
            )
            logged = True
        sleep(min(0.5, max(0.0, deadline - clock())))


_DENIALS = {
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": ("WRITE", "transactional id"),
    "TOPIC_AUTHORIZATION_FAILED": ("READ/WRITE", "topic"),
    "GROUP_AUTHORIZATION_FAILED": ("READ", "group"),
    "CLUSTER_AUTHORIZATION_FAILED": ("IDEMPOTENT_WRITE/CREATE", "cluster"),
}


def describe_denial(message: str, args: Any, words: tuple[str, ...]) -> str | None:
    """Name principal, resource and operation in an authorization failure a service raised at run
    time (what the start-up check cannot see, e.g. transactional ids); None if `message` is none."""
    code = next((c for c in _DENIALS if c in message), None)
    if code is None or message.startswith("Kafka denied"):  # none, or already named
        return None
    if not isinstance(getattr(args, "kafka_config", None), Mapping):
        return None
    op, rtype = _DENIALS[code]
    principal = principal_of(args.kafka_config)
    role = acls.COMMAND_ROLES.get(words, "")
    resource = rtype
    if code.startswith("TRANSACTIONAL_ID") and getattr(args, "group_id", None):
        import socket

        resource = f"{rtype} {args.group_id}.{getattr(args, 'instance_id', None) or socket.gethostname()}"
    elif code.startswith("GROUP") and getattr(args, "group_id", None):
        resource = f"{rtype} {args.group_id}"
    hint = f"; grant the '{role}' role's ACLs (gpupipe acls --print --role {role})" if role else ""
    return f"Kafka denied {principal} {op} on {resource}{hint} ({message})"


def runtime_write_denial(principal: str, code_name: str, topic: str | None) -> str:
    """The line for a producer denied while running (its topic WRITE or IDEMPOTENT_WRITE revoked)."""
    if code_name == "CLUSTER_AUTHORIZATION_FAILED" or not topic:
        return f"Kafka denied {principal} IDEMPOTENT_WRITE on the cluster ({code_name})"
    if code_name == "TRANSACTIONAL_ID_AUTHORIZATION_FAILED":
        return f"Kafka denied {principal} WRITE on its transactional id ({code_name})"
    return f"Kafka denied {principal} WRITE on topic {topic} ({code_name})"


def runtime_denial(principal: str, code_name: str, topic: str | None, group: str) -> str:
    """The line for a consumer denied while running (topic READ or group READ revoked)."""
    if code_name == "GROUP_AUTHORIZATION_FAILED" or not topic:
        return f"Kafka denied {principal} READ on group {group} ({code_name})"
    return f"Kafka denied {principal} READ on topic {topic} ({code_name})"
