"""Least privilege per role, the exact table `gpupipe acls` prints and applies."""

from __future__ import annotations

import json

import pytest

from gpupipe.commands import cli
from gpupipe.commands.acls_command import render
from gpupipe.kafka import acls
from gpupipe.kafka.auth import classify_client_error, denied_line, needs_for, principal_of
from tests.paths import REPO


def _ops(role: str, prefix: str = "") -> set[tuple[str, str, str, str]]:
    return {(a.resource_type, a.pattern_type, a.name, a.operation) for a in acls.role_acls(role, prefix)}


def test_producer_writes_samples_xid_and_topology_and_reads_nothing() -> None:
    assert _ops("producer", "staging.") == {
        ("TOPIC", "LITERAL", "staging.gpu.samples.v1", "WRITE"),
        ("TOPIC", "LITERAL", "staging.gpu.xid.v1", "WRITE"),
        ("TOPIC", "LITERAL", "staging.gpu.topology.v1", "WRITE"),
        ("CLUSTER", "LITERAL", "kafka-cluster", "IDEMPOTENT_WRITE"),
    }


def test_chargeback_has_its_group_and_transactional_ids() -> None:
    ops = _ops("chargeback")
    assert ("TRANSACTIONAL_ID", "PREFIXED", "gpupipe-chargeback.", "WRITE") in ops
    assert ("GROUP", "LITERAL", "gpupipe-chargeback", "READ") in ops
    assert ("TOPIC", "LITERAL", "gpu.samples.v1", "READ") in ops
    assert ("TOPIC", "LITERAL", "gpu.chargeback.v1", "WRITE") in ops
    # its own output, read back after an offset reset, through never-committing private groups only
    assert ("TOPIC", "LITERAL", "gpu.chargeback.v1", "READ") in ops
    assert ("GROUP", "PREFIXED", "gpupipe-chargeback.dedupe-", "READ") in ops
    assert not any(o == "READ" and n in ("gpu.alerts.v1", "gpu.xid.v1") for _, _, n, o in ops)
    # a service started with --group-id billing gets transactional ids billing.<instance>
    custom = {(a.resource_type, a.name) for a in acls.role_acls("chargeback", group="billing")}
    assert ("TRANSACTIONAL_ID", "billing.") in custom and ("GROUP", "billing") in custom


def test_the_group_ids_match_what_the_services_use() -> None:
    """Read from the services' code: a renamed group must change the ACL table too."""
    parser = cli.build_parser()
    for role in ("metrics", "alerts", "recommend"):
        args = parser.parse_args([role])
        assert args.group_id == acls.DEFAULT_GROUPS[role]
    assert parser.parse_args(["lake", "write"]).group_id == acls.DEFAULT_GROUPS["lake"]
    from gpupipe_consumers.chargeback.identity import default_group_id

    assert default_group_id("") == acls.DEFAULT_GROUPS["chargeback"]
    assert {a.name for a in acls.role_acls("chargeback", "staging.") if a.resource_type == "GROUP"} == {
        default_group_id("staging."),
        default_group_id("staging.") + ".progress",
        default_group_id("staging.") + ".dedupe-",
    }
    import inspect

    from gpupipe.kafka import replay as kafka_replay
    from gpupipe_consumers import tail
    from gpupipe_consumers.alerts import handler as alerts_service
    from gpupipe_consumers.metrics import service as metrics_service
    from gpupipe_consumers.plumbing import topic_reader
    from gpupipe_consumers.report import reader as report_command  # the report's Kafka reader

    readers = {"gpupipe-read-": topic_reader.READ_GROUP_PREFIX}  # report idle and recommend
    for module, role in (
        (tail, "tail"),
        (report_command, "report"),
        (metrics_service, "metrics"),
        (alerts_service, "alerts"),
    ):
        for prefix in acls.PRIVATE_GROUP_PREFIXES[role]:
            src = inspect.getsource(module)
            if prefix in readers:
                assert readers[prefix] == prefix, (role, prefix)
            elif module is report_command:  # the report reads through topic_reader with its own prefix
                assert f'group_prefix="{prefix}"' in src, (role, prefix)
            elif module is alerts_service:  # the restore reads through topic_reader too
                assert prefix == alerts_service.RESTORE_GROUP_PREFIX
            else:
                assert f'"group.id": f"{prefix}{{' in src, (role, prefix)
    # the floor's replay joins the group prefix it is given
    assert '"group.id": f"{group_prefix}{uuid.uuid4()}"' in inspect.getsource(kafka_replay)


def test_the_lake_reads_what_it_keeps_as_tables_and_writes_only_dead_letters() -> None:
    from gpupipe_consumers.lake.tables import TABLES

    ops = _ops("lake")
    read = {n for t, _, n, o in ops if t == "TOPIC" and o == "READ"}
    assert read == {t.topic for t in TABLES} == set(acls.LAKE_TOPICS)
    assert {(t, n, o) for t, _, n, o in ops if o == "WRITE"} == {("TOPIC", "gpu.deadletter.v1", "WRITE")}
    assert ("GROUP", "LITERAL", "gpupipe-lake", "READ") in ops
    assert acls.COMMAND_ROLES[("lake", "write")] == "lake"


def test_report_is_read_only_and_only_chargeback_and_recommendations() -> None:
    ops = _ops("report")
    assert {o for *_, o in ops} == {"READ"}
    assert {n for t, _, n, _ in ops if t == "TOPIC"} == {"gpu.chargeback.v1", "gpu.recommendations.v1"}


def test_the_alerts_ha_pair_may_read_its_lease_and_join_its_group() -> None:
    from gpupipe_consumers.alerts.leader import LEASE_TOPIC

    ops = _ops("alerts")
    assert ("TOPIC", "LITERAL", LEASE_TOPIC, "READ") in ops
    assert ("GROUP", "LITERAL", "gpupipe-alerts-leader", "READ") in ops


def test_admin_creates_topics_but_reads_and_writes_nothing() -> None:
    ops = {o for *_, o in _ops("admin")}
    assert ops == {"CREATE", "DESCRIBE", "DESCRIBE_CONFIGS"}


def test_print_formats() -> None:
    bindings = acls.acls_for(["producer"], "p.", {"producer": "User:node-agent"})
    table = render(bindings, "table")
    assert "ALLOW User:node-agent    WRITE            TOPIC            LITERAL  p.gpu.samples.v1" in table
    cmds = render(bindings, "kafka-acls").splitlines()
    assert cmds[0].endswith(
        "--add --allow-principal 'User:node-agent' --operation Write --topic 'p.gpu.samples.v1' "
        "--resource-pattern-type literal"
    )
    assert "--operation IdempotentWrite --cluster" in cmds[3]
    assert json.loads(render(bindings, "json"))[0]["resource_name"] == "p.gpu.samples.v1"


def test_role_maps_are_checked() -> None:
    with pytest.raises(ValueError, match="ROLE one of"):
        acls.parse_role_map(["nobody=User:x"], "--principal")


def test_error_lines_name_principal_resource_and_operation() -> None:
    conf = {"security.protocol": "SASL_SSL", "sasl.username": "report"}
    assert principal_of(conf) == "User:report"
    assert principal_of({}) == "User:ANONYMOUS"
    line = classify_client_error(
        "_AUTHENTICATION",
        "sasl_ssl://h:1/bootstrap: SASL authentication error: Authentication failed (invalid credentials)",
        "h:1",
        "User:report",
    )
    assert line is not None and line.startswith(
        "Kafka at h:1 refused to authenticate User:report: wrong user"
    )
    line = classify_client_error(
        "_SSL", "ssl://h:1/b: SSL handshake failed: certificate verify failed", "h:1", "U"
    )
    assert line is not None and "not signed by a CA we trust" in line
    assert classify_client_error("_TRANSPORT", "Connection refused", "h:1", "U") is None
    need = ("GROUP", "gpupipe-report-2f1c1f4e-0c55-4c1b-9d2f-1a2b3c4d5e6f", "READ")
    assert denied_line("User:x", need, "report").startswith(
        "Kafka denied User:x READ on group gpupipe-report-*:"
    )


def test_tail_checks_only_the_topic_it_reads() -> None:
    needs = needs_for("tail", "p.", None, only_topic="p.gpu.xid.v1")
    assert [n for n in needs if n[0] == "TOPIC"] == [("TOPIC", "p.gpu.xid.v1", "READ")]


class _Ops:
    def __init__(self, names: list[str]) -> None:
        self.authorized_operations = [type("Op", (), {"name": n})() for n in names]


class _Fut:
    def __init__(self, value: object) -> None:
        self.value = value

    def result(self) -> object:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _Admin:
    """Answers describe_topics like the broker: authorization failed until `grant_after` calls."""

    def __init__(self, grant_after: int) -> None:
        self.calls = 0
        self.grant_after = grant_after

    def describe_topics(self, coll: object, **kw: object) -> dict[str, _Fut]:
        from confluent_kafka import KafkaError, KafkaException

        self.calls += 1
        if self.calls > self.grant_after:
            return {"gpu.chargeback.v1": _Fut(_Ops(["READ", "DESCRIBE"]))}
        return {"gpu.chargeback.v1": _Fut(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))}


def test_a_transient_authorization_race_at_start_is_retried_for_a_bounded_time() -> None:
    from gpupipe.kafka.auth import KafkaAuthError, check_access

    now = [0.0]
    needs = [("TOPIC", "gpu.chargeback.v1", "READ")]
    conf = {"security.protocol": "SASL_SSL", "sasl.username": "report"}

    def sleep(s: float) -> None:
        now[0] += s

    admin = _Admin(grant_after=3)  # the ACL lands 1.5 s after start
    check_access(lambda c: admin, conf, "report", needs, 10.0, sleep=sleep, clock=lambda: now[0])
    assert admin.calls == 4 and now[0] == pytest.approx(1.5)

    now[0] = 0.0
    never = _Admin(grant_after=10**9)
    with pytest.raises(KafkaAuthError) as exc:
        check_access(lambda c: never, conf, "report", needs, 2.0, sleep=sleep, clock=lambda: now[0])
    assert str(exc.value) == (
        "Kafka denied User:report READ on topic gpu.chargeback.v1: no ACL allows it; "
        "grant the 'report' role's ACLs (gpupipe acls --print --role report)"
    )
    assert now[0] == pytest.approx(2.0)


def test_the_operator_doc_lists_exactly_what_gpupipe_acls_prints() -> None:

    doc = (REPO / "deploy" / "kafka-security.md").read_text()
    assert render(acls.acls_for(list(acls.ROLES)), "table") in doc


def test_the_example_secrets_and_manifests_agree(tmp_path) -> None:
    """The manifests mount gpupipe-kafka-<role>; the example Secret's client.properties is valid for us."""

    import yaml

    from gpupipe.kafka import config as kafka_config

    deploy = REPO / "deploy" / "kubernetes"
    secrets = {
        d["metadata"]["name"]: d["stringData"]
        for d in yaml.safe_load_all((deploy / "kafka-credentials.example.yaml").read_text())
    }
    mounted = set()
    for f in ("producer-daemonset.yaml", "consumers.yaml"):
        for d in yaml.safe_load_all((deploy / f).read_text()):
            for v in (d or {}).get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
                if "secret" in v:
                    mounted.add(v["secret"]["secretName"])
                    assert v["secret"]["optional"] is True
    assert (
        mounted
        == set(secrets)
        == {f"gpupipe-kafka-{r}" for r in ("producer", "metrics", "chargeback", "alerts")}
    )
    for name, data in secrets.items():
        props = tmp_path / "client.properties"
        props.write_text(data["client.properties"].replace("/var/run/secrets/gpupipe/kafka", str(tmp_path)))
        (tmp_path / "password").write_text(data["password"] + "\n")
        conf = kafka_config.resolve([], str(props), {})
        assert conf["sasl.password"] == "CHANGE-ME" and conf["sasl.username"] == name.rsplit("-", 1)[1]


def test_run_time_denials_are_named_once() -> None:
    import argparse

    from gpupipe.kafka.auth import describe_denial
    from gpupipe.kafka.config import KafkaSettings

    args = argparse.Namespace(
        kafka_config=KafkaSettings({"security.protocol": "SASL_SSL", "sasl.username": "chargeback"}),
        group_id="billing",
        instance_id="cb-0",
    )
    msg = "fatal Kafka error (TRANSACTIONAL_ID_AUTHORIZATION_FAILED): Transactional Id authorization failed."
    assert describe_denial(msg, args, ("chargeback",)) == (
        "Kafka denied User:chargeback WRITE on transactional id billing.cb-0; grant the 'chargeback' role's "
        f"ACLs (gpupipe acls --print --role chargeback) ({msg})"
    )
    named = "Kafka denied User:alerts READ on topic gpu.xid.v1 (TOPIC_AUTHORIZATION_FAILED)"
    assert describe_denial(named, args, ("alerts",)) is None
    assert describe_denial("some other failure", args, ("alerts",)) is None
