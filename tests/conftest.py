"""Shared fixtures. Services are real and started here; a missing service FAILS the run, never skips it."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # tests/fake_nvml.py, tests/kubelet_fake.py

# Every test's threads and child processes end with it; the run fails if anything outlives it.
from tests.hygiene import _hygiene, pytest_sessionfinish, pytest_testnodedown  # noqa: E402, F401

#: How long a test broker may take to answer: the start is awaited (the script polls the broker),
#: so this only bounds a failure; a loaded machine (a JVM per test worker) needs more than 60 s.
BROKER_START_TIMEOUT = {"KAFKA_START_TIMEOUT": "240"}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports for the tests' listeners come from below the kernel's ephemeral range: a port the kernel
#: hands out (bind to 0) can be taken again, between the pick and the server's bind, as the local
#: port of any outgoing connection (a client retrying a broker that is down makes hundreds).
_PORTS = range(12000, max(12001, min(_ephemeral_low(), 65536)))


def free_port() -> int:
    rng = random.Random()  # not the global one: a test that seeds it must not pick its ports
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _free_pair() -> int:
    """A port whose successor is free too (kafka-local puts its controller on port+1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real single-node KRaft broker from scripts/kafka-local, private to this test session.

    Set GPUPIPE_TEST_BOOTSTRAP to reuse a running broker instead (e.g. `make kafka-start`).
    """
    existing = os.environ.get("GPUPIPE_TEST_BOOTSTRAP")
    if existing:
        yield existing
        return
    state = tmp_path_factory.mktemp("kafka")
    port = _free_pair()
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(state),
        "KAFKA_PORT": str(port),
        "KAFKA_CONTROLLER_PORT": str(port + 1),
        **BROKER_START_TIMEOUT,
    }
    script = str(REPO / "scripts" / "kafka-local")
    proc = subprocess.run(
        [script, "start", "--port", str(port)], env=env, capture_output=True, text=True, timeout=360
    )
    if proc.returncode != 0:
        pytest.fail(
            f"local Kafka did not start (integration tests need it):\n{proc.stderr[-3000:]}", pytrace=False
        )
    bootstrap = proc.stdout.strip().splitlines()[-1]
    try:
        yield bootstrap
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> str:
    """A unique prefix per test so tests sharing the broker never see each other's records."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40]
    return f"t{os.getpid()}-{name}-{free_port()}."


@pytest.fixture(scope="session")
def kafka_secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A second, secured broker (SASL_SSL + mTLS + ACLs), started once per session: tests/secure_kafka.py."""
    from secure_kafka import start_secure_kafka

    yield from start_secure_kafka(tmp_path_factory.mktemp("kafka-secure"))


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Three brokers (replication 3, min.insync.replicas 2) for the tests about the cluster itself:
    leader elections, a broker lost or paused (tests/kafka_cluster.py). Other tests keep `kafka`."""
    from kafka_cluster import start_cluster

    yield from start_cluster(tmp_path_factory.mktemp("kafka-cluster"), _PORTS, BROKER_START_TIMEOUT)
