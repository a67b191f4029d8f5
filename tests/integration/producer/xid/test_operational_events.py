"""GPU Operational Events end to end: one record per incident on the real XID topic.

The real ``gpupipe produce`` process (tests/fake_nvml_cli.py, the NVML double as an R620 driver with
GPU Operational Events), a kernel-log file and a real broker. GPU 1 reports one incident three ways
(NVML's Xid 185 event, the structured GPU-RAS SPARING_EVENT naming Xid 185, and the kernel's Xid 185
line); GPU 2 reports a structured event with a code no catalog lists. The XID topic holds exactly one
record per incident: the structured one, listing the legacy reports it absorbed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.agent_harness import UUIDS
from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.consumers.alerts.test_service import TopicReader, wait_until

pytestmark = pytest.mark.integration

HOST = "goe-node"
XID185_LINE = "[Sun Dec 13 10:00:00 2026] NVRM: Xid (PCI:0000:9b:00): 185, pid=4242, name=trainer, sparing\n"


def _agent(kafka: str, prefix: str, tmp: Path, faults: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "GPUPIPE_FAKE_NVML": "H100:8:fixtures:driver=620.10.01",
        "GPUPIPE_FAKE_NVML_FAULTS": str(faults),
        "NODE_NAME": HOST,
    }
    argv = [sys.executable, str(REPO / "tests" / "fake_nvml_cli.py"), "produce", "--source", "nvml"]
    argv += ["--bootstrap-servers", kafka, "--topic-prefix", prefix, "--no-create-topics"]
    argv += ["--interval", "200ms", "--kmsg-path", str(tmp / "kmsg.log"), "--spool-dir", str(tmp / "spool")]
    argv += ["--listen", f"127.0.0.1:{free_port()}", "--log-format", "text"]
    return popen(argv, cwd=REPO, env=env, stdout=(tmp / "agent.log").open("wb"), stderr=subprocess.STDOUT)


def _topic_size(reader: TopicReader) -> int:
    """Records on the reader's topic now (sum of the partitions' high watermarks)."""
    return sum(reader.c.get_watermark_offsets(tp, timeout=10)[1] for tp in reader.c.assignment())


def test_each_incident_is_one_record_on_the_xid_topic(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    ensure_topics(
        kafka, [topics.XID, topics.SAMPLES, topics.TOPOLOGY, topics.DEADLETTER], prefix=topic_prefix
    )
    samples = TopicReader(kafka, topics.with_prefix(topic_prefix, topics.SAMPLES))
    xids = TopicReader(kafka, topics.with_prefix(topic_prefix, topics.XID))
    faults = tmp_path / "faults"
    faults.write_text("")
    (tmp_path / "kmsg.log").write_text("")
    agent = _agent(kafka, topic_prefix, tmp_path, faults)
    try:

        def running() -> bool:
            if agent.poll() is not None:
                raise AssertionError((tmp_path / "agent.log").read_text()[-3000:])
            return any(r["uuid"] == UUIDS[1] for r in samples.poll())

        wait_until(running, 60, "a sample of GPU 1")
        with faults.open("a") as f:
            f.write("incident 1 sparing_event\ngoe 2 unknown_code_memory\n")
        with (tmp_path / "kmsg.log").open("a") as f:
            f.write(XID185_LINE)

        def published() -> list[dict[str, Any]]:
            got = xids.poll()  # every record of the topic so far
            return got if len(got) >= 2 else []

        wait_until(published, 30, "the two incidents")
    finally:
        stop_group(agent)  # a clean stop flushes whatever the agent still held
        on_topic = _topic_size(xids)
        got = wait_until(lambda: xids.poll() if len(xids.poll()) >= on_topic else [], 30, "the whole topic")
        samples.close()
        xids.close()
    assert len(got) == 2, got
    by_gpu = {r["gpu_index"]: r for r in got}
    sparing, unknown = by_gpu[1], by_gpu[2]
    assert (sparing["kind"], sparing["xid"], sparing["uuid"], sparing["source"]) == (
        "xid",
        185,
        UUIDS[1],
        "nvml_kmsg",
    )
    assert sorted(sparing["operational"]["legacy_sources"]) == ["kmsg", "nvml"]
    assert (sparing["pid"], sparing["operational"]["module_signature"]) == (4242, "GPU-RAS")
    assert (unknown["kind"], unknown["xid"], unknown["uuid"]) == ("operational", None, UUIDS[2])
    assert unknown["operational"]["category"] == "MEMORY_INTEGRITY_ERROR"
