"""`gpupipe alerts --ha` as a pair: kill -9 the leader, the standby takes over.

Real Kafka, real Alertmanager, the CLI in subprocesses, the Kubernetes API faked. Checks: takeover within
30 s with the open-alert state (same alert id, sequence continues, no contradictory revision), nothing
lost (an XID produced while no leader ran is alerted), nothing sent twice to Alertmanager (one entry per
alert, the same label set), a cordon in flight when the leader died is done by the standby,
and the cordon rate limit held across the failover.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from tests.integration.consumers.alerts.test_service import (
    REPO,
    Alertmanager,
    AlertsProcess,
    TopicReader,
    _topics,
    alertmanager,
    produce,
    wait_until,
    xid_event,
)
from tests.k8s_api_fake import FakeKubeApi

__all__ = ["alertmanager"]  # the fixture, imported for pytest

pytestmark = pytest.mark.integration


def role(p: AlertsProcess) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/healthz", timeout=1) as r:
            return str(json.loads(r.read())["role"])
    except OSError:
        return "down"


def alerts_json(p: AlertsProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/alerts.json", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_standby_takes_over_with_state_and_limits(
    kafka: str, topic_prefix: str, alertmanager: Alertmanager, tmp_path: Path
) -> None:
    t = _topics(kafka, topic_prefix)
    token = tmp_path / "token"
    token.write_text("tok")
    reader = TopicReader(kafka, t[topics.ALERTS])
    with FakeKubeApi([f"node-{x}" for x in "abcdefgh"], token="tok") as kube:
        flags = [
            "--ha",
            "--ha-session-timeout",
            "6s",
            "--alertmanager-url",
            alertmanager.url,
            "--resend-interval",
            "2s",
            "--update-interval",
            "1s",
            "--cordon",
            "--cordon-max-per-hour",
            "2",
            "--kube-api-url",
            kube.url,
            "--kube-token-file",
            str(token),
            "--no-health-signals",
        ]
        group = f"alerts-ha-{topic_prefix}"
        a = AlertsProcess(kafka, topic_prefix, tmp_path, *flags, "--instance-id", "a", group=group).start()
        b = None
        try:
            wait_until(lambda: role(a) == "leader", 30, "instance a to lead")
            b = AlertsProcess(
                kafka, topic_prefix, tmp_path, *flags, "--instance-id", "b", group=group
            ).start()
            assert role(b) == "standby"
            page = alerts_json(b)  # a standby's page says why it is empty
            assert page["role"] == "standby" and page["open_alerts"] == 0 and "standby" in page["note"]
            now = int(time.time() * 1000)
            produce(kafka, t[topics.XID], "XidEvent", [xid_event("node-a", "0000:18:00", 79, now)])

            def first79() -> dict[str, Any] | None:
                return next((r for r in reader.latest().values() if r["hostname"] == "node-a"), None)

            x79 = wait_until(first79, 20, "the Xid 79 alert from the leader")
            assert x79["instance"] == "a" and x79["status"] == "firing"
            wait_until(lambda: len(kube.patches("node-a")) == 1, 15, "node-a cordoned by the leader")
            wait_until(lambda: alertmanager.alerts(), 15, "the alert in Alertmanager")
            # a's next cordon is in flight (the API answers slowly) when a is killed
            kube.set_delay(8.0)
            produce(kafka, t[topics.XID], "XidEvent", [xid_event("node-d", "0000:18:00", 79, now + 1)])
            wait_until(
                lambda: any(r["hostname"] == "node-d" for r in reader.latest().values()), 20, "node-d alert"
            )
            time.sleep(1.5)  # let a's offsets commit (auto-commit) like a leader that ran a while

            assert a.proc is not None
            a.proc.kill()  # kill -9: no goodbye, the group coordinator must notice
            killed = time.monotonic()
            kube.set_delay(0.0)
            assert len(kube.patches()) == 1  # node-d's cordon died with a
            later = int(time.time() * 1000)
            produce(  # while nobody leads: must not be lost
                kafka,
                t[topics.XID],
                "XidEvent",
                [
                    xid_event("node-b", "0000:28:00", 13, later, pid=4),
                    xid_event("node-c", "0000:38:00", 95, later, message="Uncontained: FBHUB. RST: Yes"),
                ],
            )
            wait_until(lambda: role(b) == "leader", 30, "instance b to take over")

            def from_b() -> list[dict[str, Any]] | None:
                got = [r for r in reader.latest().values() if r["hostname"] in ("node-b", "node-c")]
                return got if len(got) == 2 and all(r["instance"] == "b" for r in got) else None

            wait_until(from_b, 30, "the standby to alert on what arrived during the failover")
            wait_until(  # the new leader's page lists what it restored and what it raised
                lambda: (
                    {"node-a", "node-b", "node-c", "node-d"} <= {x["node"] for x in alerts_json(b)["alerts"]}
                ),
                10,
                "b's /alerts.json to list the open alerts",
                interval_s=0.5,
            )
            takeover_s = time.monotonic() - killed
            assert takeover_s < 30, takeover_s
            # the cordon lost with a is reconciled by b, and the limit (2 per hour: a's node-a, b's node-d)
            # holds: node-c's drain is refused, not cordoned
            wait_until(lambda: len(kube.patches("node-d")) == 1, 20, "b to cordon node-d")
            annotations = kube.node("node-d")["metadata"]["annotations"]
            assert annotations["gpupipe.io/cordoned-by"] == "gpupipe-alerts/b"
            acts = wait_until(
                lambda: [r for r in reader.poll() if r["status"] == "action" and r["hostname"] == "node-c"],
                15,
                "node-c's cordon decision",
            )
            rem = acts[0]["remediation"]
            assert rem["outcome"] == "rate_limited" and "--cordon-max-per-hour" in rem["detail"], rem
            assert acts[0]["instance"] == "b"
            assert "unschedulable" not in kube.node("node-c")["spec"] and len(kube.patches()) == 2

            # the open alert continued: same id, no contradictory revision, one Alertmanager entry
            revs = [r for r in reader.poll() if r["alert_id"] == x79["alert_id"] and r["status"] != "action"]
            assert all(r["status"] == "firing" for r in revs)
            seqs = [r["sequence"] for r in revs]
            assert len(seqs) == len(set(seqs)), seqs  # no sequence published twice by two instances
            am = wait_until(
                lambda: (lambda got: got if len(got) == 4 else None)(alertmanager.alerts()),
                15,
                "four alerts in Alertmanager",
            )
            ids = [x["annotations"]["alert_id"] for x in am]
            assert sorted(ids) == sorted(set(ids)) and x79["alert_id"] in ids
            print(f"HA takeover: {takeover_s:.1f}s from kill -9 to the standby's first alerts")
        finally:
            if b is not None:
                assert b.stop() == 0, b.log_text()[-3000:]
            a.stop()
    reader.close()


def test_a_plain_instance_refuses_the_group_of_ha_instances(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A `gpupipe alerts` without --ha and with the HA pair's --group-id (a debugging run with the
    default) would take half of the leader's input partitions unfenced: it refuses to start instead,
    and the leader keeps its input. Another group id starts."""
    _topics(kafka, topic_prefix)
    group = f"alerts-ha-{topic_prefix}"
    flags = ("--ha", "--ha-session-timeout", "6s", "--no-health-signals")
    a = AlertsProcess(kafka, topic_prefix, tmp_path, *flags, "--instance-id", "a", group=group).start()
    try:
        wait_until(lambda: role(a) == "leader", 30, "instance a to lead")
        plain = AlertsProcess(kafka, topic_prefix, tmp_path, "--no-health-signals", group=group)
        res = subprocess.run(plain.cmd, cwd=REPO, capture_output=True, text=True, timeout=90)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "used by --ha instances (gpupipe-alerts-a)" in res.stderr
        assert role(a) == "leader"
        other = AlertsProcess(kafka, topic_prefix, tmp_path, "--no-health-signals", group=f"{group}-debug")
        other.start()
        assert role(other) == "single"
        other.stop()
    finally:
        a.stop()


def test_a_plain_instance_stops_when_ha_instances_join_its_group_later(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The other order: the plain instance ran first, the HA pair is deployed later. It cannot be
    fenced, so it stops itself (exit 2, one line) and the HA instance leads the whole input."""
    _topics(kafka, topic_prefix)
    group = f"alerts-late-{topic_prefix}"
    plain = AlertsProcess(
        kafka, topic_prefix, tmp_path, "--no-health-signals", "--ha-guard-interval", "1s", group=group
    ).start()
    assert role(plain) == "single"
    flags = ("--ha", "--ha-session-timeout", "6s", "--no-health-signals")
    a = AlertsProcess(kafka, topic_prefix, tmp_path, *flags, "--instance-id", "a", group=group)
    a.start()
    try:
        assert plain.proc is not None
        rc = plain.proc.wait(60)
        text = plain.log_text()
        assert rc == 2, text[-3000:]
        assert text.strip().splitlines()[-1] == (
            f"gpupipe alerts: error: --group-id {group} is used by --ha instances (gpupipe-alerts-a): a "
            "plain instance would split their input and publish beside their leader; run it with --ha (it "
            "stands by), or give it a --group-id of its own"
        ), text[-3000:]
        wait_until(lambda: role(a) == "leader", 30, "instance a to lead")
    finally:
        a.stop()
        if plain.proc is not None and plain.proc.poll() is None:
            plain.stop()
