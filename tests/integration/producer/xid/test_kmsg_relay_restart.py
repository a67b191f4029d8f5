"""A node agent killed between reading an XID and spooling it loses nothing, through the shipped relay.

The DaemonSet's ``kmsg-relay`` command (``gpupipe-kmsg-relay``, a process, a file of raw records as its
device) feeds the real CLI (``tests/fake_nvml_cli.py produce``, fake NVML) on a real broker:

1. an agent reads the boot's backlog, publishes its Xid 79 and stops cleanly (cursor at that record);
2. a second agent reads a new Xid 48 and holds it for its NVML partner (a long merge window keeps
   it there), and is killed (-9: an OOM kill, a liveness kill) before it spooled it;
3. a third agent, against the same relay, publishes the Xid 48.

The topic must hold each XID once. With a FIFO fed by ``cat /dev/kmsg`` the third agent got nothing:
``cat`` re-sends the backlog only after a write into a FIFO nobody reads, and none came.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.agent_harness import wait_for
from tests.conftest import REPO, free_port
from tests.fake_nvml import FakeNvml
from tests.integration.kafka_util import read_all
from tests.kmsg_relay_proc import RelayProcess
from tests.unit.producer.agent.test_node_agent_resilience import record

pytestmark = pytest.mark.integration

GPU = FakeNvml.node("H100", 8).gpus[2]  # what fake_nvml_cli builds for GPUPIPE_FAKE_NVML=H100:8
BUS = GPU.pci_bus_id.lower().replace("00000000:", "0000:").rsplit(".", 1)[0]
XID79 = f"NVRM: Xid (PCI:{BUS}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID48 = f"NVRM: Xid (PCI:{BUS}): 48, pid=1234, name=python3, An uncorrectable double bit error"


class Agent:
    def __init__(self, kafka: str, prefix: str, tmp: Path, sock: Path, merge_window: str) -> None:
        self.port = free_port()
        self.log = tmp / f"agent-{self.port}.log"
        cmd = [
            sys.executable,
            str(REPO / "tests" / "fake_nvml_cli.py"),
            "produce",
            "--source",
            "nvml",
            "--interval",
            "1s",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            prefix,
            "--kubelet-socket",
            "",
            "--kmsg-path",
            str(sock),
            "--spool-dir",
            str(tmp / "spool"),
            "--xid-merge-window",
            merge_window,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--log-format",
            "text",
        ]
        env = {**os.environ, "GPUPIPE_FAKE_NVML": "H100:8", "NODE_NAME": "relay-node"}
        with self.log.open("wb") as out:
            self.proc = hygiene.popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._healthy, 60, "the agent's /healthz")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return hygiene.stop_group(self.proc, sig, timeout=30)


def test_an_xid_read_but_not_spooled_by_a_killed_agent_is_published_by_the_next(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ring = tmp_path / "kmsg"
    ring.write_text(record(100, "Linux version 6.8.0") + record(101, XID79))
    relay = RelayProcess(ring, tmp_path / "kmsg.sock").start()
    xid_topic = topic_prefix + topics.XID
    codec = AvroCodec()
    try:
        first = Agent(kafka, topic_prefix, tmp_path, relay.sock, "500ms")
        wait_for(lambda: first.metric('gpupipe_producer_xid_events_total{kind="xid"}') >= 1, 30, "Xid 79")
        assert first.stop() == 0
        assert (tmp_path / "spool" / "kmsg.cursor").read_text().split()[1] == "101"

        held = Agent(kafka, topic_prefix, tmp_path, relay.sock, "60s")
        lines = held.metric("gpupipe_producer_kmsg_lines_total")
        with ring.open("a") as f:
            f.write(record(102, XID48))
        wait_for(lambda: held.metric("gpupipe_producer_kmsg_lines_total") > lines, 30, "the Xid 48 read")
        assert held.metric('gpupipe_producer_xid_events_total{kind="xid"}') == 0  # held, not spooled
        held.stop(signal.SIGKILL)
        assert (tmp_path / "spool" / "kmsg.cursor").read_text().split()[1] == "101"

        last = Agent(kafka, topic_prefix, tmp_path, relay.sock, "500ms")
        wait_for(lambda: last.metric('gpupipe_producer_xid_events_total{kind="xid"}') >= 1, 30, "Xid 48")
        assert last.stop() == 0
    finally:
        relay.stop()
    xids = [codec.decode(m.value()).record for m in read_all(kafka, xid_topic, timeout_s=30)]
    assert sorted(x["xid"] for x in xids) == [48, 79]  # nothing lost, nothing twice
    assert (tmp_path / "spool" / "kmsg.cursor").read_text().split()[1] == "102"
