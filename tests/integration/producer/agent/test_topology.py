"""The node agent publishes each node's GPU topology once to the compacted topology topic.

Two agents run through the real CLI with the NVML double (tests/fake_nvml_cli.py): an 8-GPU
NVSwitch H100 node and a 4-GPU PCIe-only L40S node. Each ticks many times; the topic holds exactly
one record per node, keyed by hostname, and was created compacted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from gpupipe.kafka import topics
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene  # own process group, dies with pytest, recorded for the leak guard
from tests.conftest import REPO, free_port
from tests.integration.kafka_util import read_to_end

pytestmark = pytest.mark.integration

NODES = {"topo-nvswitch": "H100:8", "topo-pcie": "L40S:4"}
GPUS = {node: int(spec.split(":")[1]) for node, spec in NODES.items()}
#: Ticks each agent makes after its first (the one that publishes the topology) before it stops.
TICKS = 10


def _await_ticks(kafka: str, samples: str, procs: dict[str, subprocess.Popen[str]], ticks: int) -> None:
    """Until each node's samples on ``samples`` cover ``ticks`` ticks; the agents create the topic."""
    c = Consumer({"bootstrap.servers": kafka, "group.id": f"t-{uuid.uuid4()}", "enable.auto.commit": False})
    codec = AvroCodec()
    per_node: Counter[str] = Counter()
    deadline = time.monotonic() + 120
    try:
        while not (parts := c.list_topics(samples, timeout=10).topics[samples].partitions):
            assert all(p.poll() is None for p in procs.values()), "an agent exited before its topics existed"
            assert time.monotonic() < deadline, f"{samples} not created"
            time.sleep(0.2)
        c.assign([TopicPartition(samples, p, OFFSET_BEGINNING) for p in parts])
        while any(per_node[n] < GPUS[n] * (ticks + 1) for n in NODES):
            assert all(p.poll() is None for p in procs.values()), "an agent exited"
            assert time.monotonic() < deadline, f"samples per node: {dict(per_node)}"
            for m in c.consume(1000, timeout=0.5):
                if not m.error():
                    per_node[codec.decode(m.value(), m.headers()).record["hostname"]] += 1
    finally:
        c.close()


def _agent(kafka: str, prefix: str, node: str, spec: str, tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GPUPIPE_FAKE_NVML": spec, "NODE_NAME": node}
    cmd = [
        sys.executable,
        str(REPO / "tests" / "fake_nvml_cli.py"),
        "produce",
        "--source",
        "nvml",
        "--interval",
        "100ms",
        "--shutdown-timeout",
        "30s",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        prefix,
        "--kubelet-socket",
        str(tmp_path / f"{node}-no-kubelet.sock"),
        "--spool-dir",
        str(tmp_path / node),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--log-format",
        "text",
    ]
    return hygiene.popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_one_topology_record_per_node_on_a_compacted_topic(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    procs = {node: _agent(kafka, topic_prefix, node, spec, tmp_path) for node, spec in NODES.items()}
    topic = topic_prefix + topics.TOPOLOGY
    try:
        # Both topologies arrive; then many more ticks pass (the samples keep coming) with nothing new.
        _await_ticks(kafka, topic_prefix + topics.SAMPLES, procs, TICKS)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        errs = {node: proc.communicate(timeout=45)[1] for node, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for node, proc in procs.items():
        assert proc.returncode == 0, errs[node][-3000:]
    msgs = read_to_end(kafka, topic)  # the agents are done: all they wrote
    codec = AvroCodec()
    got = {m.key().decode(): codec.decode(m.value()) for m in msgs}
    assert len(msgs) == 2 and set(got) == set(NODES)
    assert {d.name for d in got.values()} == {"GpuTopology"}

    nvswitch = got["topo-nvswitch"].record
    assert [g["gpu_index"] for g in nvswitch["gpus"]] == list(range(8))
    assert all(len(g["nvlinks"]) == 18 and g["nvlink_domain"] == 0 for g in nvswitch["gpus"])
    assert len(nvswitch["pairs"]) == 28 and all(p["nvlink_p2p"] for p in nvswitch["pairs"])
    assert {g["numa_node"] for g in nvswitch["gpus"]} == {0, 1}

    pcie = got["topo-pcie"].record
    assert len(pcie["gpus"]) == 4 and all(
        g["nvlinks"] == [] and g["nvlink_domain"] is None for g in pcie["gpus"]
    )
    assert [p["pcie_ancestor"] for p in pcie["pairs"]] == ["single", "node", "node", "node", "node", "single"]

    admin = AdminClient({"bootstrap.servers": kafka})
    res = ConfigResource("topic", topic)
    config = admin.describe_configs([res])[res].result(timeout=10)
    assert config["cleanup.policy"].value == "compact"
