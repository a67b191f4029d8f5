"""The XID spool's memory: a spool file of any size loads and replays in about its bound.

A spool at a third of the old 64 MiB default bound took the agent past the DaemonSet's 160 Mi
memory limit at start (the whole file read at once, every record listed, then every pending
event copied into librdkafka), so a node whose broker had been away crash-looped until someone
deleted the spool. Here a spool file four times the default bound is loaded and replayed in a
subprocess, and its peak RSS is compared with a stated bound and with the shipped limit.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import yaml

from gpupipe_producer.xid.spool_format import SPOOL_FILE, encode_record
from tests.conftest import REPO

MiB = 1024 * 1024
#: Peak RSS the load and replay of the large spool may add: three times the default bound.
GROWTH_BOUND = 48 * MiB
#: Left of the pod's limit for what the agent holds besides its spool (NVML, threads, samples).
AGENT_MARGIN = 48 * MiB

_CHILD = r"""
import json, sys
import gpupipe_producer.agent.node_agent  # what the agent process has loaded
from gpupipe_producer.xid.sender import XidSender
from gpupipe_producer.xid.spool import XidSpool

class Broker:
    # Holds every message handed over, as librdkafka does while the broker is away.
    def __init__(self):
        self.held = []
    def produce(self, topic, value, key, on_delivery):
        self.held.append((bytes(value), bytes(key), on_delivery))
    def poll(self, timeout=0.0):
        return 0

def peak():
    # VmHWM is this process image's own high-water mark; ru_maxrss is kept across exec on Linux,
    # so a child of a big test worker would report the worker's peak.
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

before = peak()
spool = XidSpool(sys.argv[1])
sender = XidSender(Broker(), "gpu.xid.v1", spool)
print(json.dumps({"before": before, "after": peak(), "pending": len(spool), "bytes": spool.pending_bytes}))
"""


def _fill(path: Path, size: int) -> int:
    """A spool file of ``size`` bytes of XidEvent-sized records (as a long outage leaves it)."""
    rng = random.Random(7)
    n = written = 0
    with (path / SPOOL_FILE).open("wb") as fh:
        while True:
            rec = encode_record(n + 1, b"GPU-%036d" % n, rng.randbytes(200) + b"x" * 200)
            if written + len(rec) > size:
                return n
            fh.write(rec)
            written += len(rec)
            n += 1


def _limit_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", text)
    assert m, text
    return int(m.group(1)) * (MiB if m.group(2) == "Mi" else 1024 * MiB)


def _shipped_limits() -> list[int]:
    limits = []
    for doc in yaml.safe_load_all((REPO / "deploy/kubernetes/producer-daemonset.yaml").read_text()):
        if doc and doc.get("kind") == "DaemonSet":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] != "kmsg-relay":
                    limits.append(_limit_bytes(c["resources"]["limits"]["memory"]))
    values = yaml.safe_load((REPO / "deploy/helm/gpupipe/values.yaml").read_text())
    limits.append(_limit_bytes(values["producer"]["resources"]["limits"]["memory"]))
    return limits


def test_a_spool_four_times_its_bound_loads_and_replays_in_bounded_memory(tmp_path: Path) -> None:
    events = _fill(tmp_path, 64 * MiB)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    growth = got["after"] - got["before"]
    assert growth <= GROWTH_BOUND, f"load and replay of a 64 MiB spool grew RSS by {growth / MiB:.0f} MiB"
    assert 0 < got["pending"] < events and got["bytes"] <= 16 * MiB, got
    for limit in _shipped_limits():
        assert got["after"] + AGENT_MARGIN <= limit, (got["after"] / MiB, limit / MiB)
