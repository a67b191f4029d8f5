"""The Flink SQL recipe (docs/recipes/flink_gpu_hours.sql, run by FlinkSql.java on Flink's own jars
from Maven Central in a local MiniCluster, no PyFlink) bills what chargeback bills, to 1e-9.

Same input as tests/integration/recipes/test_gpu_hours.py (its fixtures): an hour of whole, MIG and
time-sliced GPUs, with every case of the shared-GPU split and a MIG GPU's own record, in the raw
framing with lz4, read straight from the topic by Flink's Kafka SQL connector as shipped. A minute
or more of Flink (planner, MiniCluster): `make recipe-check` runs it, not `make test`.
"""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from typing import Any

import pytest

from gpupipe.kafka import topics
from tests.integration.recipes.test_gpu_hours import RECIPES, Bill, assert_agrees, chargeback, fleet, run
from tests.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.recipe_check, pytest.mark.timeout(900)]

__all__ = ["chargeback", "fleet"]  # the fixtures, over this module's own topic


def flink_jars() -> str:
    """The directory of Flink's jars (scripts/flink-jars fetches them once from Maven Central)."""
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the Flink recipe needs {' and '.join(missing)} (Java 17+, Maven)", pytrace=False)
    proc = subprocess.run([str(REPO / "scripts" / "flink-jars")], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"scripts/flink-jars failed:\n{proc.stderr[-3000:]}", pytrace=False)
    return proc.stdout.splitlines()[-1]


def test_flink_sql_recipe_bills_as_chargeback(kafka: str, fleet: dict[str, Any], chargeback: Bill) -> None:
    jars = flink_jars()
    out = run(
        [
            *("java", "-cp", f"{jars}/*", str(RECIPES / "FlinkSql.java")),
            f"bootstrap={kafka}",
            f"topic={fleet['prefix']}{topics.SAMPLES}",
            str(REPO / "docs" / "reference" / "engines" / "flink" / "GpuSample.sql"),
            str(RECIPES / "flink_gpu_hours.sql"),
        ],
        fleet["dir"],
        timeout=420,
    )
    rows = csv.DictReader(io.StringIO(out))
    got = {(int(r["window_ms"]), r["namespace"]): float(r["gpu_hours"]) * 3600.0 for r in rows}
    assert_agrees(got, chargeback)
