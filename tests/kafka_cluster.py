"""A three-broker KRaft cluster from ``KAFKA_BROKERS=3 scripts/kafka-local``, for the tests about the cluster.

:class:`KafkaCluster` names the bootstrap list and acts on one broker (``kill``: SIGKILL, ``pause``:
SIGSTOP, ``resume``: SIGCONT, ``start``: again on its data) through the script, and answers what a
test awaits: a partition's leader and in-sync replicas, read from the cluster's metadata.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from confluent_kafka.admin import AdminClient

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "scripts" / "kafka-local")
T = TypeVar("T")


def free_run(n: int, ports: range) -> int:
    """The first of ``n`` consecutive free ports (node i of kafka-local uses base + 2(i-1) and the next)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.choice(ports[: len(ports) - n])
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


@dataclass
class KafkaCluster:
    bootstrap: str
    env: dict[str, str]
    brokers: int = 3

    def broker(self, node: int, action: str, timeout: float = 300) -> str:
        """``scripts/kafka-local broker NODE ACTION``; its stdout (the broker's address on start)."""
        out = subprocess.run(
            [SCRIPT, "broker", str(node), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert out.returncode == 0, f"broker {node} {action}: {out.stderr[-2000:]}"
        return out.stdout.strip()

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap, "socket.connection.setup.timeout.ms": 2000})

    def partition(self, topic: str, partition: int = 0, admin: AdminClient | None = None):
        """The partition's metadata (``leader``, ``replicas``, ``isrs``), as the cluster answers now."""
        md = (admin or self.admin()).list_topics(topic, timeout=5)
        return md.topics[topic].partitions[partition]

    def leader(self, topic: str, partition: int = 0) -> int:
        return self.partition(topic, partition).leader

    def alive(self) -> set[int]:
        """Brokers the cluster lists (registered and not fenced)."""
        return set(self.admin().list_topics(timeout=5).brokers)


def await_true(what: str, check: Callable[[], T], timeout: float = 60, every: float = 0.1) -> T:
    """Poll ``check`` until it returns something true (exceptions count as not yet); return that."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            got = check()
            if got:
                return got
            last = got
        except Exception as exc:  # a broker away answers with errors until it is back
            last = exc
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s (last: {last!r})"
        time.sleep(every)


def start_cluster(state: Path, ports: range, start_timeout: dict[str, str]) -> Iterator[KafkaCluster]:
    """Start the cluster in ``state`` for the session and stop it after; a start that fails fails the test."""
    import pytest

    base = free_run(6, ports)
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(state),
        "KAFKA_BROKERS": "3",
        "KAFKA_PORT": str(base),
        "KAFKA_STOP_TIMEOUT": "15",
        **start_timeout,
    }
    t0 = time.monotonic()
    proc = subprocess.run([SCRIPT, "start", "--fresh"], env=env, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
        pytest.fail(f"the 3-broker Kafka cluster did not start:\n{proc.stderr[-3000:]}", pytrace=False)
    cluster = KafkaCluster(proc.stdout.strip().splitlines()[-1], env)
    print(f"3-broker cluster started in {time.monotonic() - t0:.1f}s")  # shown with -s / on failure
    try:
        yield cluster
    finally:
        subprocess.run([SCRIPT, "stop"], env=env, capture_output=True, timeout=120)
