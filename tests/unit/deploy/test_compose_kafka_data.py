"""docker-compose.yml's Kafka writes into its volume, and `make compose-check` says so when not.

The volume was mounted at /var/lib/kafka/data while apache/kafka wrote to its default
/tmp/kraft-combined-logs, so recreating the container emptied every topic; `docker-compose config`
accepts that file. scripts/compose_kafka_data.py (run by `make compose-check`) is checked here on the
real file and on files that get it wrong.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.paths import REPO

REPO = REPO
SCRIPT = REPO / "scripts" / "compose_kafka_data.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_kafka_data", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kafka(env: Any, volumes: list[Any]) -> dict[str, Any]:
    return {"services": {"kafka": {"image": "apache/kafka:4.1.0", "environment": env, "volumes": volumes}}}


def test_the_compose_kafka_writes_into_its_volume() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(REPO / "docker-compose.yml")], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr


@pytest.mark.parametrize(
    ("env", "volumes", "problem"),
    [
        ({"KAFKA_NODE_ID": "1"}, ["kafka-data:/var/lib/kafka/data"], "KAFKA_LOG_DIRS is not set"),
        (
            {"KAFKA_LOG_DIRS": "/tmp/kraft-combined-logs"},
            ["kafka-data:/var/lib/kafka/data"],
            "KAFKA_LOG_DIRS /tmp/kraft-combined-logs is in none of its writable volumes",
        ),
        (["KAFKA_LOG_DIRS=/var/lib/kafka/data"], ["kafka-data:/var/lib/kafka/data:ro"], "none of its"),
        (
            {"KAFKA_LOG_DIRS": "/var/lib/kafka/data,/data2"},
            ["kafka-data:/var/lib/kafka"],
            "/data2 is in none",
        ),
        ({"KAFKA_LOG_DIRS": "/var/lib/kafka/data/a"}, ["kafka-data:/var/lib/kafka/data"], None),
        (["KAFKA_LOG_DIRS=/data"], [{"type": "volume", "source": "k", "target": "/data"}], None),
    ],
)
def test_a_log_dir_outside_the_volume_is_one_line(env: Any, volumes: list[Any], problem: str | None) -> None:
    lines = _checker().problems(_kafka(env, volumes))
    if problem is None:
        assert lines == []
    else:
        (line,) = lines
        assert line.startswith("kafka: ") and problem in line


def test_make_compose_check_runs_the_kafka_data_check() -> None:
    res = subprocess.run(["make", "-n", "compose-check"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert re.search(r"scripts/compose_kafka_data\.py docker-compose\.yml$", res.stdout, re.M), res.stdout


def test_compose_chargeback_windows_are_demo_sized_with_production_values_documented() -> None:
    text = (REPO / "docker-compose.yml").read_text()
    env = yaml.safe_load(text)["services"]["chargeback"]["environment"]
    assert env["GPUPIPE_WINDOW"] == "1m" and env["GPUPIPE_GRACE"] == "10s"
    assert "In production: 1h and 5m" in text
    assert "GPUPIPE_WINDOW" in (REPO / "docs" / "deploy.md").read_text()
