"""`gpupipe acls --print|--apply`: the least-privilege Kafka ACLs of every gpupipe role.

`--print` writes them (a table, `kafka-acls.sh` commands, or JSON) for operators who manage ACLs
elsewhere; `--apply` creates them with the admin client (run it with the admin role's
`--kafka-config-file`; creating an ACL that exists is a no-op). Topic names carry `--topic-prefix`;
`--group ROLE=ID` follows a service started with a non-default `--group-id`. See gpupipe.kafka.acls.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from gpupipe.common.errors import ConfigError
from gpupipe.kafka import acls

USES_KAFKA = True


#: One line for `gpupipe --help`.
HELP = "print or apply the least-privilege Kafka ACLs of each role"


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--print", dest="print_acls", action="store_true", help="print the ACLs")
    mode.add_argument("--apply", action="store_true", help="create the ACLs on the cluster")
    p.add_argument(
        "--role",
        action="append",
        default=[],
        choices=acls.ROLES,
        help="only this role, repeatable (default: every role)",
    )
    p.add_argument(
        "--principal",
        action="append",
        default=[],
        metavar="ROLE=PRINCIPAL",
        help="principal of a role, e.g. metrics=User:gpu-metrics (default: User:<role>)",
    )
    p.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="ROLE=GROUP_ID",
        help="consumer group of metrics/chargeback/alerts if started with another --group-id",
    )
    p.add_argument(
        "--format",
        default="table",
        choices=["table", "kafka-acls", "json"],
        help="--print output: a table, kafka-acls.sh command lines, or JSON",
    )


def build(args: argparse.Namespace) -> list[acls.Acl]:
    try:
        principals = acls.parse_role_map(args.principal, "--principal")
        groups = acls.parse_role_map(args.group, "--group")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for role, principal in principals.items():
        if ":" not in principal:
            raise ConfigError(
                f"--principal {role}={principal}: a principal is TYPE:NAME, e.g. User:{principal}"
            )
    return acls.acls_for(args.role or list(acls.ROLES), args.topic_prefix, principals, groups)


def render(bindings: list[acls.Acl], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(
            [
                {
                    "principal": a.principal,
                    "permission": "ALLOW",
                    "operation": a.operation,
                    "resource_type": a.resource_type,
                    "pattern_type": a.pattern_type,
                    "resource_name": a.name,
                    "host": a.host,
                }
                for a in bindings
            ],
            indent=1,
        )
    if fmt == "kafka-acls":
        return "\n".join(a.kafka_acls_command() for a in bindings)
    head = f"{'':6}{'PRINCIPAL':<18} {'OPERATION':<16} {'RESOURCE':<16} {'PATTERN':<8} NAME"
    return "\n".join([head, *(a.line() for a in bindings)])


def apply(bootstrap: str, extra: dict[str, str], bindings: list[acls.Acl], out: TextIO) -> int:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    from gpupipe.kafka.admin import client_config, wait_for_broker
    from gpupipe.kafka.auth import KafkaAuthError, principal_of

    wait_for_broker(bootstrap, extra=extra)
    conf = client_config(bootstrap, extra)
    admin = AdminClient(conf)
    wanted = [
        AclBinding(
            ResourceType[a.resource_type if a.resource_type != "CLUSTER" else "BROKER"],
            a.name,
            ResourcePatternType[a.pattern_type],
            a.principal,
            a.host,
            AclOperation[a.operation],
            AclPermissionType.ALLOW,
        )
        for a in bindings
    ]
    failed = 0
    for binding, fut in admin.create_acls(wanted, request_timeout=30).items():
        try:
            fut.result()
        except KafkaException as exc:
            err = exc.args[0]
            if err.name() in ("CLUSTER_AUTHORIZATION_FAILED", "SECURITY_DISABLED"):
                raise KafkaAuthError(
                    f"Kafka denied {principal_of(conf)} ALTER on cluster {acls.CLUSTER} (creating ACLs): "
                    "run --apply with the admin role's --kafka-config-file"
                ) from exc
            failed += 1
            print(f"gpupipe acls: cannot create {binding}: {err.str()}", file=sys.stderr)
    print(f"applied {len(wanted) - failed} of {len(wanted)} ACLs", file=out)
    return 1 if failed else 0


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    from gpupipe.kafka.admin import parse_kafka_overrides

    bindings = build(args)
    if args.print_acls:
        print(render(bindings, args.format), file=out)
        return 0
    return apply(args.bootstrap_servers, parse_kafka_overrides(args.kafka_config), bindings, out)
