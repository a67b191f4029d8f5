"""An NVML XID is published on the GPU it happened on, as deployed.

The real ``gpupipe produce`` process (tests/fake_nvml_cli.py: the suite's NVML double in the mode
of NVIDIA's mock library, where a pending event goes to whichever event set waits, and the double
takes another GPU's set whenever one waits), the kubelet double over real gRPC on a unix socket, a
real broker and the real ``gpupipe alerts`` process. On an 8-GPU node GPU 5 reports Xid 94, then
GPU 0 reports Xid 79 and falls off the bus. Each XID is published once with its own GPU's UUID,
PCI bus id and pods, and each alert names that GPU; before the fix both came out on whichever
GPU's set delivered them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.agent_harness import UUIDS, combined_fixture, node_for_fixtures
from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.consumers.alerts.test_service import AlertsProcess, TopicReader, wait_until
from tests.kubelet_fake import FakeKubelet

pytestmark = pytest.mark.integration

HOST = "attr-node"
PODS = {0: {("ml-train", "llama-ft-0")}, 5: {("ml-train", "bert-sweep-7")}}


def _agent(kafka: str, prefix: str, tmp: Path, kubelet: str, port: int, faults: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "GPUPIPE_FAKE_NVML": "H100:8:fixtures:events=any-set",
        "GPUPIPE_FAKE_NVML_FAULTS": str(faults),
        "NODE_NAME": HOST,
    }
    (tmp / "kmsg.log").write_text("")
    argv = [sys.executable, str(REPO / "tests" / "fake_nvml_cli.py"), "produce", "--source", "nvml"]
    argv += ["--bootstrap-servers", kafka, "--topic-prefix", prefix, "--no-create-topics"]
    argv += ["--interval", "200ms", "--kubelet-socket", kubelet, "--kmsg-path", str(tmp / "kmsg.log")]
    argv += ["--spool-dir", str(tmp / "spool"), "--listen", f"127.0.0.1:{port}", "--log-format", "text"]
    return popen(argv, cwd=REPO, env=env, stdout=(tmp / "agent.log").open("wb"), stderr=subprocess.STDOUT)


def _pods(record: dict[str, Any]) -> set[tuple[str, str]]:
    return {(a["namespace"], a["pod"]) for a in record.get("allocations") or []}


def _metric(port: int, line_start: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_each_xid_is_published_and_alerted_on_the_gpu_it_happened_on(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    t = {n: topics.with_prefix(topic_prefix, n) for n in (topics.XID, topics.SAMPLES, topics.ALERTS)}
    ensure_topics(
        kafka,
        [topics.XID, topics.SAMPLES, topics.TOPOLOGY, topics.ALERTS, topics.DEADLETTER],
        prefix=topic_prefix,
    )
    node = node_for_fixtures()  # the GPUs the agent's double has: their identities, for the asserts
    bus = {i: node.gpus[i].pci_bus_id[-7:].lower() for i in (0, 5)}  # "18:00.0": both spellings
    faults = tmp_path / "faults"
    faults.write_text("")
    samples, xids, alerts = (TopicReader(kafka, t[n]) for n in (topics.SAMPLES, topics.XID, topics.ALERTS))
    port = free_port()
    with FakeKubelet(combined_fixture()) as kubelet:
        agent = _agent(kafka, topic_prefix, tmp_path, kubelet.socket_path, port, faults)
        svc = AlertsProcess(kafka, topic_prefix, tmp_path).start()
        try:

            def enriched() -> bool:  # the agent has the kubelet's map: XIDs will carry pods
                if agent.poll() is not None:
                    raise AssertionError((tmp_path / "agent.log").read_text()[-3000:])
                return any(r["uuid"] == UUIDS[5] and _pods(r) for r in samples.poll())

            wait_until(enriched, 60, "an enriched sample of GPU 5")
            with faults.open("a") as f:
                f.write("xid 5 94\n")
            wait_until(lambda: any(r["xid"] == 94 for r in xids.poll()), 30, "Xid 94")
            with faults.open("a") as f:
                f.write("xid 0 79\nlose 0\n")

            def published() -> list[dict[str, Any]]:
                got = [r for r in xids.poll() if r["kind"] in ("xid", "gpu_lost")]
                return got if len(got) >= 3 else []

            got = wait_until(published, 30, "Xid 79 and the lost GPU")

            def alerted() -> dict[int, dict[str, Any]]:
                by_code = {r["xid_codes"][0]: r for r in alerts.latest().values() if r["xid_codes"]}
                return by_code if {79, 94} <= set(by_code) else {}

            by_code = wait_until(alerted, 30, "the alerts of Xid 79 and 94")
            delivered = {
                d: _metric(port, f'gpupipe_producer_nvml_events_total{{delivery="{d}"}}')
                for d in ("own_set", "other_set", "unresolved")
            }
        finally:
            svc.stop()
            stop_group(agent)
            for r in (samples, xids, alerts):
                r.close()
    xid79 = [r for r in got if r["kind"] == "xid" and r["xid"] == 79]
    xid94 = [r for r in got if r["kind"] == "xid" and r["xid"] == 94]
    lost = [r for r in got if r["kind"] == "gpu_lost"]
    assert len(xid79) == 1 and len(xid94) == 1 and len(lost) == 1, got  # each once
    for gpu, rec in ((0, xid79[0]), (5, xid94[0]), (0, lost[0])):
        assert (rec["hostname"], rec["uuid"], rec["gpu_index"]) == (HOST, UUIDS[gpu], gpu), rec
        assert rec["pci_bus_id"].lower().endswith(bus[gpu]), rec
        assert _pods(rec) == PODS[gpu], rec
    for gpu, code in ((0, 79), (5, 94)):
        alert = by_code[code]
        assert (alert["hostname"], alert["gpu_uuid"]) == (HOST, UUIDS[gpu]), alert
        assert alert["pci_bus_id"].lower().endswith(bus[gpu]), alert
        assert {(a["namespace"], a["pod"]) for a in alert["allocations"]} == PODS[gpu], alert
    # The cross-check: both came through a set that was not their GPU's own, and say so.
    assert delivered == {"own_set": 0.0, "other_set": 2.0, "unresolved": 0.0}, delivered
