"""Helpers for integration tests against the real broker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

REPO = Path(__file__).resolve().parents[2]
GPUPIPE = [sys.executable, "-m", "gpupipe"]


def read_all(bootstrap: str, topic: str, expect: int | None = None, timeout_s: float = 60.0) -> list:
    """Every message of `topic` from the beginning; waits until `expect` arrived (or the topic goes quiet)."""
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4()}", "enable.auto.commit": False}
    )
    md = c.list_topics(topic, timeout=10).topics[topic]
    c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
    out = []
    deadline = time.monotonic() + timeout_s
    quiet_since = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = [m for m in c.consume(1000, timeout=0.5) if not m.error()]
            if batch:
                out += batch
                quiet_since = time.monotonic()
            if expect is not None and len(out) >= expect:
                break
            if expect is None and time.monotonic() - quiet_since > 3.0:
                break
    finally:
        c.close()
    return out


def read_to_end(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list:
    """Every message of `topic` up to its partitions' high watermarks now: for a topic whose writers
    are done, the whole topic without waiting for it to go quiet (not a transactional topic: its
    commit markers take offsets no message holds)."""
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4()}", "enable.auto.commit": False}
    )
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        assert md.partitions, f"{topic} does not exist"
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in md.partitions}
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p, end in ends.items() if end > 0])
        out: list = []
        left = {p: end for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + timeout_s
        while left:
            assert time.monotonic() < deadline, f"{topic}: still short of {left} (partition: high watermark)"
            for m in c.consume(1000, timeout=0.5):
                if m.error() or m.offset() >= ends[m.partition()]:
                    continue
                out.append(m)
                if m.offset() + 1 == ends[m.partition()]:
                    left.pop(m.partition(), None)
        return out
    finally:
        c.close()


def gpupipe(*args: str, timeout: float = 300, env: dict | None = None, input: str | None = None):
    return subprocess.run(
        [*GPUPIPE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        input=input,
    )
