"""Running a shipped Spark recipe (docs/recipes/) the way its docs say, for the lake's tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import hygiene
from tests.paths import REPO

#: One local core and a small driver: what this 2-core machine can lend Spark beside the suite.
SMALL_LOCAL_SPARK = ("--master", "local[1]", "--driver-memory", "512m")


def spark_jars() -> str:
    """The ``--jars`` list scripts/spark-jars prints (fetching the jars once)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "spark-jars")], capture_output=True, text=True, timeout=600, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def run_recipe(recipe: Path, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Any:
    """Run ``recipe`` on one local core with a small driver; its last stdout line, as JSON."""
    proc = hygiene.popen(
        [sys.executable, str(recipe), *args, "--jars", spark_jars(), *SMALL_LOCAL_SPARK],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        hygiene.stop_group(proc)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])
