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
