"""The whole pipeline on a secured broker, each role with only its own ACLs.

One secured broker for the module (tests/secure_kafka.py: SASL_SSL SCRAM-SHA-512, mTLS listener,
StandardAuthorizer with allow.everyone.if.no.acl.found=false). The same deterministic input goes
through produce, chargeback (transactions), alerts, metrics, report and tail on the plaintext
broker and on the secured one; the results must be equal. Then the refusals, each with its exact
line: the producer's principal reading chargeback or writing alerts, the report's principal writing
anything, a wrong password, an untrusted CA; and `ps` of running services shows no secret.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import (
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from gpupipe.kafka import acls, topics
from gpupipe.kafka.admin import ensure_topics
from tests.conftest import free_port
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000
START_MS = (int(time.time() * 1000) // HOUR_MS - 3) * HOUR_MS
SAMPLES = 2 * 2 * 60  # nodes x GPUs x (10 min / 10 s)


@dataclass
class Target:
    """How the pipeline reaches one broker: per-role CLI flags, and the test's own (admin) client conf."""

    bootstrap: str
    role_flags: Callable[[str], list[str]]
    observer: dict[str, str]
    prefix: str = field(default_factory=lambda: f"sec-{uuid.uuid4().hex[:8]}.")
    group: str = field(default_factory=lambda: f"g{uuid.uuid4().hex[:8]}")

    def topic(self, base: str) -> str:
        return self.prefix + base

    def argv(self, role: str, *args: str) -> list[str]:
        return [
            *args,
            "--bootstrap-servers",
            self.bootstrap,
            "--topic-prefix",
            self.prefix,
            *self.role_flags(role),
        ]


def _start(t: Target, role: str, log: Path, *args: str) -> subprocess.Popen:
    out = open(log, "a")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(
        [*GPUPIPE, *t.argv(role, *args), "--log-format", "text"],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )


def _stop(p: subprocess.Popen, log: Path) -> None:
    if p.poll() is None:
        p.terminate()
    assert p.wait(30) == 0, log.read_text()[-3000:]


def _committed_to_end(t: Target, group: str, names: list[str]) -> bool:
    c = Consumer({**t.observer, "group.id": group, "enable.auto.commit": False})
    try:
        for name in names:
            parts = sorted(c.list_topics(name, timeout=10).topics[name].partitions)
            for tp in c.committed([TopicPartition(name, p) for p in parts], timeout=10):
                high = c.get_watermark_offsets(TopicPartition(name, tp.partition), timeout=10)[1]
                # chargeback commits the oldest offset its open windows need, and its position
                # ("until") in the commit metadata
                done = tp.offset if tp.offset is not None and tp.offset >= 0 else 0
                if tp.metadata and tp.metadata.startswith("{"):
                    done = json.loads(tp.metadata).get("until", done)
                if high > 0 and done < high:
                    return False
        return True
    finally:
        c.close()


def _wait(pred: Callable[[], Any], timeout: float, what: str, procs: list[subprocess.Popen]) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        for p in procs:
            assert p.poll() is None, f"{what}: a service exited with {p.returncode}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def _metrics_consumed(port: int, topic: str) -> float:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    m = re.search(r'gpupipe_consumer_records_total\{topic="' + re.escape(topic) + r'"\} (\S+)', body)
    return float(m.group(1)) if m else 0.0


def _create_topics(t: Target) -> None:
    """As the admin (services run with --no-create-topics). One XID partition: the alerts service
    sees the events in one order on both brokers (node bursts depend on it), so alert ids compare."""
    admin_extra = {k: v for k, v in t.observer.items() if k != "bootstrap.servers"}
    specs = {**topics.DEFAULT_SPECS, topics.XID: topics.TopicSpec(1, 86_400_000)}
    ensure_topics(t.bootstrap, topics.ALL, prefix=t.prefix, specs=specs, extra=admin_extra)


def run_pipeline(
    t: Target, tmp: Path, during: Callable[[list[subprocess.Popen]], None] | None = None
) -> dict:
    """Every stage with its own role; returns what is compared between brokers."""
    _create_topics(t)
    start_iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(START_MS / 1000))
    res = gpupipe(
        *t.argv(
            "producer",
            "produce", "--source", "simulated", "--nodes", "2", "--gpus-per-node", "2",
            "--interval", "10s", "--duration", "10m", "--start-time", start_iso, "--speed", "max",
            "--seed", "12", "--xid-rate", "60", "--no-create-topics", "--log-level", "warning",
        ),
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    mport = free_port()
    logs = {n: tmp / f"{n}.log" for n in ("chargeback", "alerts", "metrics", "recommend")}
    procs = [
        _start(t, "chargeback", logs["chargeback"], "chargeback", "--window", "5m", "--grace", "1m",
               "--group-id", f"{t.group}-cb", "--instance-id", "i1", "--start", "earliest",
               "--no-create-topics"),
        _start(t, "alerts", logs["alerts"], "alerts", "--group-id", f"{t.group}-al", "--from-beginning",
               "--no-create-topics", "--no-health-signals"),
        _start(t, "metrics", logs["metrics"], "metrics", "--group-id", f"{t.group}-m", "--from-beginning",
               "--no-create-topics", "--listen", f"127.0.0.1:{mport}", "--max-sample-age", "0s"),
        _start(t, "recommend", logs["recommend"], "recommend", "--group-id", f"{t.group}-rc",
               "--from-beginning", "--no-create-topics", "--idle-after", "2m", "--update-interval", "10m"),
    ]  # fmt: skip
    try:
        _wait(lambda: _metrics_consumed(mport, t.topic(topics.SAMPLES)) >= SAMPLES, 90, "metrics", procs)
        _wait(
            lambda: _committed_to_end(t, f"{t.group}-cb", [t.topic(topics.SAMPLES)]), 90, "chargeback", procs
        )
        _wait(lambda: _committed_to_end(t, f"{t.group}-al", [t.topic(topics.XID)]), 90, "alerts", procs)
        _wait(
            lambda: _committed_to_end(t, f"{t.group}-rc", [t.topic(topics.SAMPLES)]), 90, "recommend", procs
        )
        if during:
            during(procs)
    finally:
        for p, name in zip(procs, logs, strict=True):
            _stop(p, logs[name])
    report = gpupipe(
        *t.argv("report", "report", "chargeback", "--format", "json", "--period", "all", "--by", "namespace"),
        timeout=60,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    out: dict[str, Any] = {"report": json.loads(report.stdout)}
    for base in (topics.XID, topics.ALERTS, topics.RECOMMENDATIONS):
        tail = gpupipe(*t.argv("tail", "tail", base, "--from-beginning", "--idle-timeout", "2"), timeout=60)
        assert tail.returncode == 0, tail.stderr[-2000:]
        out[base] = [json.loads(line) for line in tail.stdout.splitlines()]
    out["alert_ids"] = sorted({a["alert_id"] for a in out.pop(topics.ALERTS)})
    out["xid"] = sorted(json.dumps(x, sort_keys=True) for x in out.pop(topics.XID))
    out["recommendations"] = sorted(
        (r["recommendation_id"], r["status"], r["namespace"], r["pod"])
        for r in out.pop(topics.RECOMMENDATIONS)
    )
    return out


def _apply_acls(sk: Any, t: Target) -> None:
    res = gpupipe(
        "acls", "--apply", "--bootstrap-servers", sk.bootstrap,
        "--kafka-config-file", sk.config_file("admin"), "--topic-prefix", t.prefix,
        "--group", f"chargeback={t.group}-cb", "--group", f"alerts={t.group}-al",
        "--group", f"metrics={t.group}-m", "--group", f"recommend={t.group}-rc",
    )  # fmt: skip
    n = len(
        acls.acls_for(
            list(acls.ROLES),
            t.prefix,
            groups={
                "chargeback": f"{t.group}-cb",
                "alerts": f"{t.group}-al",
                "metrics": f"{t.group}-m",
                "recommend": f"{t.group}-rc",
            },
        )
    )
    assert res.returncode == 0 and f"applied {n} of {n} ACLs" in res.stdout, res.stdout + res.stderr


def _secure_target(sk: Any) -> Target:
    return Target(sk.bootstrap, lambda role: ["--kafka-config-file", sk.config_file(role)], sk.conf("admin"))


@pytest.fixture(scope="module")
def secured(kafka_secure: Any) -> tuple[Any, Target]:
    t = _secure_target(kafka_secure)
    _apply_acls(kafka_secure, t)
    _create_topics(t)
    return kafka_secure, t


def test_pipeline_on_the_secured_broker_matches_plaintext(
    kafka: str, secured: tuple[Any, Target], tmp_path: Path
) -> None:
    sk, st = secured
    secrets = [
        sk.password(r)
        for r in ("producer", "metrics", "chargeback", "alerts", "recommend", "report", "tail", "admin")
    ]

    def no_secret_in_ps(procs: list[subprocess.Popen]) -> None:
        ps = subprocess.run(
            ["ps", "-ww", "-eo", "pid,args", "--no-headers"], capture_output=True, text=True
        ).stdout
        ours = [line for line in ps.splitlines() if int(line.split()[0]) in {p.pid for p in procs}]
        assert len(ours) == 4 and all("--kafka-config-file" in line for line in ours), ours
        assert not [s for s in secrets if s in ps]

    (tmp_path / "plain").mkdir()
    (tmp_path / "secure").mkdir()
    # both at once: most of the time is waiting for consumers, and the test budget is small
    with ThreadPoolExecutor(1) as pool:
        plain_run = pool.submit(
            run_pipeline, Target(kafka, lambda role: [], {"bootstrap.servers": kafka}), tmp_path / "plain"
        )
        secure = run_pipeline(st, tmp_path / "secure", during=no_secret_in_ps)
        plain = plain_run.result()
    assert plain["report"] and len(plain["alert_ids"]) > 0 and len(plain["xid"]) > 0
    assert plain["recommendations"], "the idle notebook of the fleet gives a recommendation"
    assert secure == plain


def _deliver(conf: dict[str, str], topic: str) -> KafkaError | None:
    errs: list[KafkaError | None] = []
    p = Producer({**conf, "message.timeout.ms": 10000})
    p.produce(topic, b"x", on_delivery=lambda err, msg: errs.append(err))
    p.flush(15)
    return errs[0] if errs else None


def test_each_role_is_refused_what_it_does_not_need(secured: tuple[Any, Target]) -> None:
    sk, t = secured
    base = ["--bootstrap-servers", sk.bootstrap, "--topic-prefix", t.prefix, "--kafka-authz-wait", "0s"]
    # the node producer's principal cannot read chargeback ...
    res = gpupipe("tail", "gpu.chargeback.v1", "--kafka-config-file", sk.config_file("producer"), *base)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"gpupipe tail: error: Kafka denied User:producer READ on topic {t.prefix}gpu.chargeback.v1 "
        "(and 1 more): no ACL allows it; grant the 'tail' role's ACLs (gpupipe acls --print --role tail)"
    )
    # ... nor write alerts: the broker itself refuses, whatever the client does
    err = _deliver(sk.conf("producer"), t.topic(topics.ALERTS))
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert _deliver(sk.conf("producer"), t.topic(topics.SAMPLES)) is None  # its own topic works
    # the report's principal writes nothing
    for base_topic in topics.ALL:
        err = _deliver(sk.conf("report"), t.topic(base_topic))
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, base_topic
    res = gpupipe(
        "produce",
        "--source",
        "simulated",
        "--duration",
        "10s",
        "--no-create-topics",
        "--kafka-config-file",
        sk.config_file("report"),
        *base,
    )
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"gpupipe produce: error: Kafka denied User:report WRITE on topic {t.prefix}gpu.samples.v1 "
        "(and 2 more): no ACL allows it; grant the 'producer' role's ACLs "
        "(gpupipe acls --print --role producer)"
    )
    # a service needing topic creation rights it does not have says so
    res = gpupipe(
        "produce", "--source", "simulated", "--duration", "10s",
        "--kafka-config-file", sk.config_file("producer"), *base,
    )  # fmt: skip
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"gpupipe produce: error: Kafka denied User:producer CREATE on topic {t.prefix}gpu.chargeback.v1: "
        "create the topics with the admin role (gpupipe acls --role admin) and run with --no-create-topics"
    )


def test_wrong_password_and_untrusted_ca_fail_fast_with_one_line(
    secured: tuple[Any, Target], tmp_path: Path
) -> None:
    sk, _ = secured
    base = [
        "tail",
        "gpu.xid.v1",
        "--bootstrap-servers",
        sk.bootstrap,
        "--kafka-config-file",
        sk.config_file("tail"),
    ]
    began = time.monotonic()
    res = gpupipe(*base, env={"GPUPIPE_KAFKA_SASL_PASSWORD": "not-the-password"})
    assert res.returncode == 1
    assert re.fullmatch(
        rf"gpupipe tail: error: Kafka at {sk.bootstrap} refused to authenticate User:tail: "
        r"wrong user name or password \(operation: SASL authenticate; broker said: SASL authentication "
        r"error: Authentication failed during authentication due to invalid credentials with SASL "
        r"mechanism SCRAM-SHA-512 \(after \d+ms in state AUTH_REQ\)\)",
        res.stderr.strip(),
    ), res.stderr
    other_ca = tmp_path / "other-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k"),
         "-out", str(other_ca), "-days", "1", "-subj", "/CN=someone-else"],
        check=True, capture_output=True,
    )  # fmt: skip
    res = gpupipe(*base, env={"GPUPIPE_KAFKA_SSL_CA_LOCATION": str(other_ca)})
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"gpupipe tail: error: TLS to Kafka at {sk.bootstrap} failed: the broker's certificate is not "
        "signed by a CA we trust (set ssl.ca.location to the cluster's CA; principal User:tail, "
        "operation: TLS handshake)"
    )
    assert time.monotonic() - began < 10


def test_mtls_principal_from_the_client_certificate(secured: tuple[Any, Target]) -> None:
    sk, t = secured
    args = ["--bootstrap-servers", sk.mtls_bootstrap, "--topic-prefix", t.prefix, "--kafka-authz-wait", "0s"]
    ok = gpupipe("tail", "gpu.xid.v1", "--from-beginning", "--idle-timeout", "1", "--kafka-config-file",
                 sk.config_file("tail", mtls=True), *args)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    res = gpupipe("tail", "gpu.xid.v1", "--kafka-config-file", sk.config_file("report", mtls=True), *args)
    assert res.returncode == 1
    assert f"Kafka denied User:report READ on topic {t.prefix}gpu.xid.v1" in res.stderr
    # the broker's own configuration holds no password either (users are created over mTLS)
    server = (sk.dir.parent / "server.properties").read_text()
    assert "allow.everyone.if.no.acl.found=false" in server
    assert not [r for r in ("admin", "producer", "report") if sk.password(r) in server]


def test_a_missing_transactional_id_acl_is_named(secured: tuple[Any, Target]) -> None:
    """What the start-up check cannot ask the broker about fails at run time, still as one line."""
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    sk, t = secured
    group = f"txn-{uuid.uuid4().hex[:6]}"
    res = gpupipe("acls", "--apply", "--role", "chargeback", "--group", f"chargeback={group}",
                  "--topic-prefix", t.prefix, "--bootstrap-servers", sk.bootstrap,
                  "--kafka-config-file", sk.config_file("admin"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    txn = AclBindingFilter(
        ResourceType.TRANSACTIONAL_ID, f"{group}.", ResourcePatternType.PREFIXED, "User:chargeback", "*",
        AclOperation.ANY, AclPermissionType.ANY,
    )  # fmt: skip
    admin = AdminClient(sk.conf("admin"))
    for fut in admin.delete_acls([txn], request_timeout=30).values():
        assert len(fut.result()) == 1
    res = gpupipe("chargeback", "--group-id", group, "--instance-id", "i1", "--no-create-topics",
                  "--bootstrap-servers", sk.bootstrap, "--topic-prefix", t.prefix,
                  "--kafka-config-file", sk.config_file("chargeback"), timeout=60)  # fmt: skip
    assert res.returncode == 1
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"gpupipe chargeback: error: Kafka denied User:chargeback WRITE on transactional id {group}.i1; "
            "grant the 'chargeback' role's ACLs (gpupipe acls --print --role chargeback) (fatal Kafka error "
            "(TRANSACTIONAL_ID_AUTHORIZATION_FAILED)"
        )
    ), res.stderr


def test_acls_that_land_just_after_start_are_waited_for(secured: tuple[Any, Target], tmp_path: Path) -> None:
    """A transient authorization race at start: the service waits (bounded), then runs."""
    sk, _ = secured
    race = Target(sk.bootstrap, lambda role: [], sk.conf("admin"))
    _create_topics(race)
    log = tmp_path / "tail.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*GPUPIPE, "tail", "gpu.alerts.v1", "--from-beginning", "--idle-timeout", "1",
             "--bootstrap-servers", sk.bootstrap, "--topic-prefix", race.prefix,
             "--kafka-config-file", sk.config_file("report"), "--kafka-authz-wait", "60s"],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    try:
        _wait(lambda: "waiting for ACLs" in log.read_text(), 30, "the wait for ACLs", [proc])
        res = gpupipe("acls", "--apply", "--role", "tail", "--principal", "tail=User:report",
                      "--topic-prefix", race.prefix, "--bootstrap-servers", sk.bootstrap,
                      "--kafka-config-file", sk.config_file("admin"))  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert '"principal": "User:report"' in log.read_text()


def _sent(port: int, topic: str) -> float:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    m = re.search(r'gpupipe_producer_records_sent_total\{topic="' + re.escape(topic) + r'"\} (\S+)', body)
    return float(m.group(1)) if m else 0.0


def test_a_write_acl_revoked_while_running_stops_the_producer_with_one_line(
    secured: tuple[Any, Target], tmp_path: Path
) -> None:
    # Never spin silently. Before, every record failed, was counted, and it ran on.
    sk, _ = secured
    t = _secure_target(sk)  # its own prefix: its ACL is removed below
    res = gpupipe(
        "acls", "--apply", "--role", "producer", "--bootstrap-servers", sk.bootstrap,
        "--kafka-config-file", sk.config_file("admin"), "--topic-prefix", t.prefix,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    _create_topics(t)
    port = free_port()
    log = tmp_path / "producer.log"
    samples = t.topic(topics.SAMPLES)
    proc = _start(
        t, "producer", log, "produce", "--source", "simulated", "--nodes", "1", "--gpus-per-node", "2",
        "--interval", "200ms", "--no-create-topics", "--listen", f"127.0.0.1:{port}",
    )  # fmt: skip
    try:
        _wait(lambda: _sent(port, samples) > 0, 60, "the producer delivering", [proc])
        admin = AdminClient(sk.conf("admin"))
        write = AclBindingFilter(
            ResourceType.TOPIC, samples, ResourcePatternType.LITERAL, "User:producer", "*",
            AclOperation.WRITE, AclPermissionType.ALLOW,
        )  # fmt: skip
        for fut in admin.delete_acls([write]).values():
            assert len(fut.result(10)) == 1
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    line = f"Kafka denied User:producer WRITE on topic {samples} (TOPIC_AUTHORIZATION_FAILED)"
    assert rc == 1, text[-2000:]
    assert text.strip().splitlines()[-1] == f"gpupipe produce: error: {line}", text[-2000:]
    assert f"stopping: {line}" in text


def _read(conf: dict[str, str], topic: str) -> list[Any]:
    """Every message of ``topic`` so far, as the admin reads it (waiting out the leader elections of
    topics just created: "not leader for partition" while they settle)."""
    c = Consumer({**conf, "group.id": f"t-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False})
    try:
        settle = time.monotonic() + 30
        while True:
            try:
                parts = c.list_topics(topic, timeout=10).topics[topic].partitions
                tps = [TopicPartition(topic, p, 0) for p in parts]
                ends = {tp.partition: c.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
                break
            except KafkaException:
                if time.monotonic() > settle:
                    raise
                time.sleep(0.5)
        c.assign(tps)
        out: list[Any] = []
        left = {p for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + 30
        while left and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            out.append(m)
            if m.offset() + 1 >= ends[m.partition()]:
                left.discard(m.partition())
        return out
    finally:
        c.close()


def test_a_node_cannot_forge_an_ack_or_another_nodes_hostname(
    secured: tuple[Any, Target], tmp_path: Path
) -> None:
    """The producer principal, which every GPU node holds, against the alerts service: an ack written
    on the XID topic closes nothing, the alerts topic refuses it, an XID signed by node-a's
    certificate but naming node-b is dead-lettered, and a sample saying node-b's GPU fell off the bus,
    signed by node-a, is dropped: node-b gets no alert (let alone a cordon)."""
    from gpupipe.domain.node_identity import NodeSigner
    from gpupipe_consumers.alerts.ack import ack_record
    from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
    from gpupipe_schemas.codec import AvroCodec
    from tests.integration.consumers.alerts.test_service import xid_event
    from tests.pki import Pki

    sk, _ = secured
    t = _secure_target(sk)
    group = f"{t.group}-al"
    res = gpupipe(
        "acls", "--apply", "--role", "producer", "--role", "alerts", "--group", f"alerts={group}",
        "--bootstrap-servers", sk.bootstrap, "--kafka-config-file", sk.config_file("admin"),
        "--topic-prefix", t.prefix,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    _create_topics(t)
    pki = Pki(tmp_path)
    tag = uuid.uuid4().hex[:6]
    node_a, node_b = f"gpu-{tag}-a", f"gpu-{tag}-b"
    signer_a = NodeSigner(str(pki.node("a", f"system:node:{node_a}")), None, node_a)
    port = free_port()
    log = tmp_path / "alerts.log"
    proc = _start(
        t, "alerts", log, "alerts", "--group-id", group, "--from-beginning", "--no-create-topics",
        "--listen", f"127.0.0.1:{port}", "--node-ca-file", str(pki.ca),
    )  # fmt: skip
    codec = AvroCodec()
    now = int(time.time() * 1000)
    enc_x, enc_a = codec.encoder("XidEvent").encode, codec.encoder("GpuAlert").encode
    enc_s = codec.encoder("GpuSample").encode
    node = Producer({**sk.conf("producer"), "message.timeout.ms": 10000})

    def send(topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> Any:
        errs: list[Any] = []
        try:
            node.produce(topic, value, key, headers=headers, on_delivery=lambda err, _m: errs.append(err))
        except KafkaException as exc:
            # a refusal librdkafka already knows from its metadata comes at once, not in the report
            return exc.args[0]
        node.flush(15)
        return errs[0]

    def firing() -> list[dict[str, Any]]:
        recs = [codec.decode(m.value()).record for m in _read(t.observer, t.topic(topics.ALERTS))]
        return [r for r in recs if r["hostname"] in (node_a, node_b)]

    try:
        real = enc_x(xid_event(node_a, "0000:3b:00", 79, now))
        assert send(t.topic(topics.XID), b"real", real, signer_a.headers(real)) is None
        first = _wait(lambda: [r for r in firing() if r["status"] == "firing"], 60, "the real alert", [proc])
        ack_value = enc_a(ack_record(first[-1], "forged", "a node", int(time.time() * 1000)))
        err = send(t.topic(topics.ALERTS), b"ack", ack_value)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
        assert send(t.topic(topics.XID), b"forged-ack", ack_value) is None
        forged = enc_x(xid_event(node_b, "0000:3b:00", 79, now))
        assert send(t.topic(topics.XID), b"forged-host", forged, signer_a.headers(forged)) is None
        unsigned = enc_x(xid_event(node_b, "0000:5b:00", 79, now))
        assert send(t.topic(topics.XID), b"unsigned", unsigned) is None
        sample = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1)).tick(now)[0][0]
        lost = enc_s({**sample, "hostname": node_b, "gpu_lost": True, "timestamp_ms": now})
        assert send(t.topic(topics.SAMPLES), b"forged-lost", lost, signer_a.headers(lost)) is None
        inputs = [t.topic(topics.XID), t.topic(topics.SAMPLES)]
        _wait(lambda: _committed_to_end(t, group, inputs), 60, "alerts caught up", [proc])
        dead = {
            m.key(): dict(m.headers() or [])
            for m in _read(t.observer, t.topic(topics.DEADLETTER))
            if m.key() in (b"real", b"forged-ack", b"forged-host", b"unsigned")
        }
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        _stop(proc, log)
    assert {k: v["gpupipe.dlq.reason"] for k, v in dead.items()} == {
        b"forged-ack": b"unexpected-record-type",
        b"forged-host": b"node-identity",
        b"unsigned": b"node-identity",
    }
    assert dead[b"forged-host"]["gpupipe.dlq.detail"] == f"wrong-node: hostname {node_b!r}".encode()
    out = firing()
    assert {r["hostname"] for r in out} == {node_a}  # node-b: no alert, so no page and no cordon
    assert [r["status"] for r in out] == ["firing"]  # the forged ack ended nothing
    assert (
        'gpupipe_alerts_node_identity_total{mode="enforce",record="XidEvent",result="verified"} 1.0' in body
    )
    assert (
        'gpupipe_alerts_node_identity_total{mode="enforce",record="XidEvent",result="wrong-node"} 1.0' in body
    )
    assert (
        'gpupipe_alerts_node_identity_total{mode="enforce",record="GpuSample",result="wrong-node"} 1.0'
        in body
    )


def test_the_lake_role_writes_the_tables_and_another_role_is_refused(
    secured: tuple[Any, Target], tmp_path: Path
) -> None:
    sk, _ = secured
    t = _secure_target(sk)
    group = f"{t.group}-lk"
    res = gpupipe(
        "acls", "--apply", "--role", "producer", "--role", "lake", "--group", f"lake={group}",
        "--bootstrap-servers", sk.bootstrap, "--kafka-config-file", sk.config_file("admin"),
        "--topic-prefix", t.prefix,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    _create_topics(t)
    res = gpupipe(
        *t.argv("producer", "produce", "--source", "simulated", "--nodes", "1", "--gpus-per-node", "2",
                "--interval", "10s", "--duration", "5m", "--speed", "max", "--no-create-topics"),
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    lake = ["lake", "write", "--catalog-uri", f"sqlite:///{tmp_path}/catalog.db",
            "--warehouse", str(tmp_path / "warehouse"), "--group-id", group, "--no-create-topics",
            "--flush-interval", "300ms"]  # fmt: skip
    # another role's credentials: refused at start, in one line that names the lake role
    refused = gpupipe(*t.argv("report", *lake, "--kafka-authz-wait", "0s"), timeout=60)
    assert refused.returncode == 1
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"gpupipe lake write: error: Kafka denied User:report READ on topic {t.prefix}gpu.samples.v1"
        )
    ), refused.stderr
    assert "grant the 'lake' role's ACLs (gpupipe acls --print --role lake)" in refused.stderr
    log = tmp_path / "lake.log"
    port = free_port()
    proc = _start(t, "lake", log, *lake, "--listen", f"127.0.0.1:{port}")

    def committed() -> float:  # the service's own count of rows committed to the samples table
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return 0.0
        m = re.search(r'gpupipe_lake_rows_total\{table="samples"\} (\S+)', body)
        return float(m.group(1)) if m else 0.0

    try:
        _wait(lambda: committed() >= 2 * 30, 90, "the samples committed to the lake", [proc])
    finally:
        _stop(proc, log)
    # the analyst's reader over the same tables (a process of its own: pyiceberg's scans leave a
    # thread pool behind in the process that runs them)
    out = gpupipe("lake", "query", "--catalog-uri", f"sqlite:///{tmp_path}/catalog.db",
                  "--warehouse", str(tmp_path / "warehouse"), "--format", "jsonl",
                  "SELECT count(*) AS n FROM samples")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["n"]
    assert rows == 2 * 30  # 2 GPUs x 5 min / 10 s, once each
