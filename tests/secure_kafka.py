"""The secured broker for tests: `scripts/kafka-local start --secure --mtls` in a private directory.

Separate from the plaintext `kafka` fixture (which most tests share): SASL_SSL with SCRAM-SHA-512,
an mTLS listener, the StandardAuthorizer denying everything no ACL allows, a throw-away CA, one
user per gpupipe role plus admin (a super user). One broker per test session (started on first
use) keeps the secured tests' cost to one broker start.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import BROKER_START_TIMEOUT, free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SecureKafka:
    bootstrap: str  # SASL_SSL listener
    mtls_bootstrap: str  # SSL listener with client certificates
    dir: Path  # <state>/secure: ca.pem, clients/, credentials/, certs/

    def config_file(self, role: str, mtls: bool = False) -> str:
        """The role's `--kafka-config-file` (written by kafka-local; the password is read from a file)."""
        return str(self.dir / "clients" / (f"{role}-mtls.properties" if mtls else f"{role}.properties"))

    def password(self, role: str) -> str:
        return (self.dir / "credentials" / f"{role}.password").read_text().strip()

    def conf(self, role: str) -> dict[str, str]:
        """librdkafka settings of a role, for the tests' own clients."""
        return {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": role,
            "sasl.password": self.password(role),
            "ssl.ca.location": str(self.dir / "ca.pem"),
        }


def _free_run(n: int) -> int:
    """A port whose next n-1 ports are free too (client, controller, mTLS)."""
    for _ in range(100):
        base = free_port()  # below the ephemeral range, as every test listener's
        if base + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port run")


def start_secure_kafka(state: Path) -> Iterator[SecureKafka]:
    port = _free_run(3)
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(state),
        "KAFKA_CONTROLLER_PORT": str(port + 1),
        "KAFKA_MTLS_PORT": str(port + 2),
        **BROKER_START_TIMEOUT,
    }
    script = str(REPO / "scripts" / "kafka-local")
    proc = subprocess.run(
        [script, "start", "--secure", "--mtls", "--port", str(port)],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    if proc.returncode != 0:
        pytest.fail(f"secured local Kafka did not start:\n{proc.stderr[-3000:]}", pytrace=False)
    bootstrap = proc.stdout.strip().splitlines()[-1]
    try:
        yield SecureKafka(bootstrap, f"127.0.0.1:{port + 2}", state / "secure")
    finally:
        subprocess.run([script, "stop"], env=env, capture_output=True, timeout=120)
