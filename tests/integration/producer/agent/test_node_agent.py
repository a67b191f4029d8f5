"""The NVML node agent end to end: fake NVML, fake kubelet (real gRPC), a kmsg file, a real broker.

The agent runs in-process (a thread) with an 8-GPU H100 fake whose GPU 7 is in MIG mode; records
are read back from Kafka and decoded with the project's Avro codec.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.agent.node_agent import AgentConfig
from gpupipe_producer.publish import Publisher, producer_config
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard
from tests.agent_harness import (
    MIG_ALICE,
    SHARED,
    UUIDS,
    combined_fixture,
    find_line,
    kmsg_lines,
    metric,
    node_for_fixtures,
    running_agent,
    wait_for,
)
from tests.conftest import REPO, free_port
from tests.integration.kafka_util import read_all
from tests.kubelet_fake import FakeKubelet, load_fixture

pytestmark = pytest.mark.integration

CODEC = AvroCodec()
CHURN = [f"GPU-d3e4f5a6-b7c8-d9e0-f1a2-b3c4d5e6f7a{i}" for i in range(3)]


def _config(tmp_path: Path, **kw: Any) -> AgentConfig:
    base: dict[str, Any] = {
        "hostname": "gpu-node-1",
        "interval_s": 0.2,
        "kubelet_timeout_s": 0.3,
        "kmsg_path": None,
        "spool_dir": str(tmp_path / "spool"),
        "xid_merge_window_s": 2.0,
        "resolve_pids": False,
    }
    base.update(kw)
    return AgentConfig(**base)


def _topics(kafka: str, prefix: str) -> tuple[str, str]:
    ensure_topics(kafka, [topics.SAMPLES, topics.XID], prefix=prefix)
    return prefix + topics.SAMPLES, prefix + topics.XID


def _records(kafka: str, topic: str, n: int) -> list[tuple[bytes, dict[str, Any]]]:
    msgs = read_all(kafka, topic, expect=n, timeout_s=30)
    assert len(msgs) == n
    return [(m.key(), CODEC.decode(m.value()).record) for m in msgs]


def test_enriched_samples_and_xid_events_reach_kafka(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    t_samples, t_xid = _topics(kafka, topic_prefix)
    fake = node_for_fixtures()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("old line before the agent started: NVRM: Xid (PCI:0000:9b:00): 13, ignored\n")
    pub = Publisher(producer_config(kafka, linger_ms=5))
    with FakeKubelet(combined_fixture()) as kubelet:
        cfg = _config(tmp_path, kubelet_socket=kubelet.socket_path, kmsg_path=str(kmsg))
        with running_agent(cfg, pub, fake, t_samples=t_samples, t_xid=t_xid) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
            with kmsg.open("a") as f:
                # The same XID from the kernel log and from NVML: one event.
                f.write(find_line("xid_real.txt", "Xid (PCI:0000:9b:00): 119", "16:24:18") + "\n")
                f.flush()
                fake.gpus[1].inject_xid(119)
                # Kernel log only, MIG-attributed.
                f.write(find_line("xid_real.txt", "GPU-I:05") + "\n")
                # Malformed, and plain noise.
                f.write("NVRM: Xid (PCI:0000:9b:00 truncated garbage\n")
                f.writelines(ln + "\n" for ln in kmsg_lines("non_xid_real.txt")[:20])
                # The real multi-line fallen-off-the-bus report (GPU 3's bus id), the failed probe and
                # the driver's load line that follow it; then GPU 3 is lost.
                f.writelines(ln + "\n" for ln in kmsg_lines("fallen_off_bus_real.txt"))
            wait_for(lambda: ra.agent.xids_sent >= 4, 10, "four XID events")
            fake.gpus[3].lose()
            wait_for(lambda: ra.agent.xids_sent >= 5, 10, "gpu_lost event")
            ra.ticks_after(3)
            ra.stop()
        assert fake.init_count == 0
    reg = ra.registry
    assert metric(reg, "gpupipe_producer_kmsg_malformed_lines_total") == 1
    assert metric(reg, "gpupipe_producer_xid_merged_total") == 1
    assert metric(reg, "gpupipe_producer_xid_spool_depth") == 0
    assert metric(reg, "gpupipe_producer_gpus_lost") == 1
    assert metric(reg, "gpupipe_producer_records_sent_total", {"topic": t_xid}) == 5

    xids = _records(kafka, t_xid, 5)
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for key, e in xids:
        assert key.decode() == (e["uuid"] or e["mig_uuid"] or e["pci_bus_id"] or e["hostname"])
        by_kind.setdefault(e["kind"], []).append(e)
    assert sorted(by_kind) == ["driver_loaded", "fallen_off_bus", "gpu_lost", "xid"]
    (loaded,) = by_kind["driver_loaded"]  # node-wide: no GPU, no code
    assert (loaded["pci_bus_id"], loaded["xid"], loaded["driver_version"]) == ("", None, "570.158.01")
    (merged,) = [e for e in by_kind["xid"] if e["xid"] == 119]
    assert (merged["source"], merged["pid"], merged["process_name"], merged["uuid"], merged["gpu_index"]) == (
        "nvml_kmsg",
        2024380,
        "nvidia-smi",
        UUIDS[1],
        1,
    )
    assert merged["pci_bus_id"] == "00000000:9B:00.0" and merged["model_name"] == "NVIDIA H100 80GB HBM3"
    assert [a["pod"] for a in merged["allocations"]] == ["llama-ft-0"]
    (mig,) = [e for e in by_kind["xid"] if e["xid"] == 94]
    assert (mig["source"], mig["mig_uuid"], mig["gpu_instance_id"], mig["uuid"]) == (
        "kmsg",
        MIG_ALICE,
        5,
        UUIDS[7],
    )
    assert [a["pod"] for a in mig["allocations"]] == ["notebook-alice"]
    (fallen,) = by_kind["fallen_off_bus"]
    assert (fallen["uuid"], fallen["gpu_index"], fallen["xid"], fallen["source"]) == (
        UUIDS[3],
        3,
        None,
        "kmsg",
    )
    (lost,) = by_kind["gpu_lost"]
    assert (lost["uuid"], lost["source"], [a["pod"] for a in lost["allocations"]]) == (
        UUIDS[3],
        "nvml",
        ["llama-ft-0"],
    )
    assert len({e["event_id"] for _, e in xids}) == 5

    samples = _records(kafka, t_samples, pub.sent_by_topic[t_samples])
    last: dict[str, dict[str, Any]] = {}
    for key, s in samples:
        assert key.decode() == s["uuid"]  # a slice is keyed by its GPU, so shares its partition
        last[s["mig"]["mig_uuid"] if s["mig"] else s["uuid"]] = s
    assert len(last) == 8 + 4  # 8 GPUs + 4 MIG slices
    assert [a["pod"] for a in last[UUIDS[0]]["allocations"]] == ["llama-ft-0"]
    assert [(a["pod"], a["replica"]) for a in last[SHARED]["allocations"]] == [
        ("dev-pod-1", 0),
        ("dev-pod-2", 1),
    ]
    assert [a["pod"] for a in last[MIG_ALICE]["allocations"]] == ["notebook-alice"]
    assert last[UUIDS[3]]["gpu_lost"] is True and last[UUIDS[3]]["power_w"] is None
    assert [a["pod"] for a in last[UUIDS[3]]["allocations"]] == ["llama-ft-0"]
    assert last[UUIDS[4]]["gpu_lost"] is False and last[UUIDS[4]]["power_w"] is not None
    assert last[UUIDS[1]]["last_xid"] == 119 and last[MIG_ALICE]["last_xid"] == 94


def test_kubelet_absent_churn_odd_and_slow(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    t_samples, _ = _topics(kafka, topic_prefix)
    fake = node_for_fixtures([*CHURN, *UUIDS[3:]])
    sock_dir = tempfile.mkdtemp(prefix="kagent-")  # short: unix socket paths are limited to ~107 bytes
    sock = os.path.join(sock_dir, "kubelet.sock")
    pub = Publisher(producer_config(kafka, linger_ms=5))
    kubelet = FakeKubelet(load_fixture("churn_before"), socket_path=sock, start=False)
    marks: dict[str, int] = {}
    try:
        cfg = _config(tmp_path, kubelet_socket=sock, kubelet_timeout_s=0.8)
        with running_agent(cfg, pub, fake, t_samples=t_samples) as ra:
            reg = ra.registry
            # 1. Socket absent: samples go out without allocations, a counter says why.
            wait_for(
                lambda: metric(reg, "gpupipe_producer_kubelet_errors_total", {"kind": "socket_absent"}) >= 2
            )
            ra.ticks_after(2)
            # 2. The kubelet comes up: attribution starts.
            kubelet.start()
            wait_for(lambda: CHURN[1] in ra.agent.allocations, 5, "churn_before map")
            ra.ticks_after(2)
            marks["before"] = int(time.time() * 1000)
            # 3. job-old ends: it loses attribution at the next refresh.
            kubelet.set_fixture(load_fixture("churn_after"))
            wait_for(lambda: CHURN[1] not in ra.agent.allocations, 5, "churn_after map")
            marks["after"] = int(time.time() * 1000)
            ra.ticks_after(2)
            # 4. Unexpected answers: unknown resource names, odd ids, garbage bytes: counted, no crash.
            kubelet.set_fixture(load_fixture("odd"))
            wait_for(lambda: metric(reg, "gpupipe_producer_kubelet_odd_device_ids") > 0, 5, "odd map")
            assert metric(reg, "gpupipe_producer_kubelet_ignored_devices") > 0
            kubelet.set_garbage(True)
            wait_for(
                lambda: metric(reg, "gpupipe_producer_kubelet_errors_total", {"kind": "bad_response"}) >= 1
            )
            # 5. A slow kubelet (2 s > the 0.8 s deadline): counted, samples keep their 0.2 s cadence
            # (a tick waiting on the kubelet would manage at most one per second).
            kubelet.clear_failures()
            kubelet.set_delay(2.0)
            t0, n0 = time.monotonic(), ra.agent.ticks
            wait_for(
                lambda: (
                    metric(reg, "gpupipe_producer_kubelet_errors_total", {"kind": "deadline_exceeded"}) >= 1
                )
            )
            ra.ticks_after(3, timeout=3)
            assert (ra.agent.ticks - n0) / (time.monotonic() - t0) > 2.5  # 5/s nominal
            kubelet.clear_failures()
            ra.stop()
    finally:
        kubelet.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    samples = [s for _, s in _records(kafka, t_samples, pub.sent_by_topic[t_samples])]
    gpu0 = sorted((s for s in samples if s["uuid"] == CHURN[0]), key=lambda s: s["timestamp_ms"])
    gpu1 = sorted((s for s in samples if s["uuid"] == CHURN[1]), key=lambda s: s["timestamp_ms"])
    pods0 = [tuple(a["pod"] for a in s["allocations"]) for s in gpu0]
    assert pods0[0] == ()  # socket absent
    assert ("job-old",) in pods0 and ("job-new",) in pods0
    first_new = pods0.index(("job-new",))
    assert ("job-old",) not in pods0[first_new:], "no stale label after the pod ended"
    # Failed Lists (garbage, a slow kubelet) keep the last good map for the grace period, flagged
    # allocations_stale: those samples say so and are not a stale label.
    assert all(
        not s["allocations"]
        for s in gpu1
        if s["timestamp_ms"] > marks["after"] + 1000 and not s["allocations_stale"]
    ), "GPU 1 is free after the churn"
    assert any(s["allocations"] for s in gpu1 if s["timestamp_ms"] < marks["before"])


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except OSError:
        return 0, b""


def test_cli_produce_source_nvml_runs_and_stops_on_sigterm(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    port = free_port()
    # A stop that runs past its deadline prints every thread's stack: the failure says where it hung.
    env = {
        **os.environ,
        "GPUPIPE_FAKE_NVML": "H100:8:mig=7:procs=2",
        "NODE_NAME": "cli-node",
        "GPUPIPE_SHUTDOWN_TRACEBACK": "1",
    }
    cmd = [
        sys.executable,
        str(REPO / "tests" / "fake_nvml_cli.py"),
        "produce",
        "--source",
        "nvml",
        "--interval",
        "200ms",
        # The stop is bounded well inside 10 s; a loaded test machine may stall a thread for
        # seconds, so this clean-stop check allows Kubernetes' default grace instead.
        "--shutdown-timeout",
        "30s",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        topic_prefix,
        "--kubelet-socket",
        str(tmp_path / "no-kubelet.sock"),
        "--kmsg-path",
        str(kmsg),
        "--spool-dir",
        str(tmp_path / "spool"),
        "--listen",
        f"127.0.0.1:{port}",
        "--log-format",
        "text",
    ]
    proc = hygiene.popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/metrics")[0] == 200, 20, "/metrics")
        wait_for(
            lambda: (
                b"gpupipe_producer_samples_built_total 0.0" not in _get(f"http://127.0.0.1:{port}/metrics")[1]
            )
        )
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 200 and json.loads(body)["status"] == "ok"
        _, text = _get(f"http://127.0.0.1:{port}/metrics")
        for name in (
            b'gpupipe_producer_collect_duration_seconds_count{group="fast"}',
            b'gpupipe_producer_kubelet_errors_total{kind="socket_absent"}',
            b"gpupipe_producer_xid_spool_depth",
            b"gpupipe_producer_records_dropped_total",
            b'gpupipe_producer_source_up{input="nvml_events"} 1.0',
        ):
            assert name in text, name
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "node agent stopped" in err
    msgs = read_all(kafka, topic_prefix + topics.SAMPLES, expect=None, timeout_s=20)
    recs = [CODEC.decode(m.value()).record for m in msgs]
    assert recs and {r["hostname"] for r in recs} == {"cli-node"}
    assert len({r["mig"]["mig_uuid"] if r["mig"] else r["uuid"] for r in recs}) == 8 + 3
    assert any(r["processes"] for r in recs)


def test_cli_nvml_init_failure_exits_non_zero_with_a_clear_message(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    env = {**os.environ, "GPUPIPE_FAKE_NVML": "H100:2:init-error"}
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "fake_nvml_cli.py"),
            "produce",
            "--source",
            "nvml",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            topic_prefix,
            "--no-kmsg",
            "--spool-dir",
            str(tmp_path / "spool"),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1
    assert "gpupipe produce: error: NVML init failed: Driver Not Loaded" in res.stderr
    assert "Traceback" not in res.stderr


def test_xid_and_sample_records_carry_the_nodes_signature(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    from gpupipe.domain.node_identity import SIG_HEADER, NodeSigner, NodeVerifier
    from tests.pki import Pki

    t_samples, t_xid = _topics(kafka, topic_prefix)
    pki = Pki(tmp_path)
    signer = NodeSigner(str(pki.node("kubelet-client-current", "system:node:gpu-node-1")), None, "gpu-node-1")
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    pub = Publisher(producer_config(kafka, linger_ms=5))
    cfg = _config(tmp_path, kubelet_socket=None, kmsg_path=str(kmsg), signer=signer)
    with running_agent(cfg, pub, node_for_fixtures(), t_samples=t_samples, t_xid=t_xid) as ra:
        with kmsg.open("a") as f:
            f.write(find_line("xid_real.txt", "Xid (PCI:0000:9b:00): 119", "16:24:18") + "\n")
        wait_for(lambda: ra.agent.xids_sent >= 1, 10, "the XID event")
        ra.ticks_after(1)
        ra.stop()
    (msg,) = read_all(kafka, t_xid, expect=1, timeout_s=30)
    verifier = NodeVerifier.from_file(str(pki.ca))
    hostname = CODEC.decode(msg.value()).record["hostname"]
    assert hostname == "gpu-node-1"
    assert verifier.check(hostname, msg.value(), msg.headers()) is None
    assert verifier.check("gpu-node-2", msg.value(), msg.headers()) == "wrong-node"
    samples = read_all(kafka, t_samples, expect=1, timeout_s=30)
    assert samples and all(SIG_HEADER in dict(m.headers() or []) for m in samples)
    for m in samples:
        assert verifier.check("gpu-node-1", m.value(), m.headers()) is None
