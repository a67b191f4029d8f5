"""docker-compose.yml publishes each host port once, and `make compose-check` says so when not.

`docker-compose config -q` accepted recommend and metrics-2 both publishing host port 9404; only
`docker compose up` would have failed. The file is read here with yaml, on its own terms, and
scripts/compose_ports.py (run by `make compose-check`) is checked on files that clash.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.paths import REPO

REPO = REPO
SCRIPT = REPO / "scripts" / "compose_ports.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_ports", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docker_compose_publishes_every_host_port_once() -> None:
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    hosts = Counter(
        str(p).split("/")[0].rsplit(":", 1)[0].rsplit(":", 1)[-1]
        for svc in doc["services"].values()
        for p in svc.get("ports", [])
        if ":" in str(p)
    )
    assert hosts and not [port for port, n in hosts.items() if n > 1], hosts


def test_gpu_metrics_are_on_dcgm_exporters_port() -> None:
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert "9400:9400" in doc["services"]["metrics-1"]["ports"]


@pytest.mark.parametrize(
    ("ports_a", "ports_b", "clash"),
    [
        (["9404:9404"], ["9404:9400"], True),
        (["9404:9404"], ["9405:9400"], False),
        (["127.0.0.1:9404:9404"], ["9404:9400"], True),  # 0.0.0.0 covers 127.0.0.1
        (["127.0.0.1:9404:9404"], ["127.0.0.2:9404:9400"], False),
        (["9404:9404/udp"], ["9404:9400"], False),
        (["9400-9402:9400-9402"], ["9401:9401"], True),
        ([{"target": 9400, "published": "9404"}], ["9404:9404"], True),
        (["9404"], ["9404"], False),  # container ports only: the host picks free ones
    ],
)
def test_checker_finds_host_ports_published_twice(ports_a: list, ports_b: list, clash: bool) -> None:
    doc = {"services": {"a": {"ports": ports_a}, "b": {"ports": ports_b}}}
    lines = _checker().clashes(doc)
    assert bool(lines) is clash, lines
    if clash:
        assert "published by more than one service: a, b" in lines[0]


def test_compose_check_fails_on_a_duplicate(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text(
        "services:\n  recommend:\n    ports: ['9404:9404']\n  metrics-2:\n    ports: ['9404:9400']\n"
    )
    res = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f"compose-check: {bad}: host port 9404/tcp is published by more than one service: "
        "recommend, metrics-2"
    ]
    ok = subprocess.run([sys.executable, str(SCRIPT), str(REPO / "docker-compose.yml")], capture_output=True)
    assert ok.returncode == 0, ok.stderr


def test_make_compose_check_runs_the_port_check() -> None:
    res = subprocess.run(["make", "-n", "compose-check"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "scripts/compose_ports.py docker-compose.yml" in res.stdout
