"""Shared bits of the benchmarks: ratio lines and the benchmark broker.

Benchmarks compare against a baseline measured side by side in the same
process run, because absolute times on these shared 2-core machines mean little.
Each prints `NAME ratio=X target=Y` (higher is better) plus absolute figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

BENCH_KAFKA_DIR = REPO / ".run" / "bench-kafka"
BENCH_PORT = int(os.environ.get("GPUPIPE_BENCH_PORT", "19192"))


def ratio_line(name: str, ratio: float, target: float, fmt: str = "%.2f") -> str:
    ok = "ok" if ratio >= target else "BELOW TARGET"
    line = f"{name} ratio={fmt % ratio} target={fmt % target}  # {ok}"
    print(line, flush=True)
    return line


def figure(name: str, value: float | int | str, unit: str = "") -> None:
    v = f"{value:.4g}" if isinstance(value, float) else str(value)
    print(f"  {name}={v}{(' ' + unit) if unit else ''}", flush=True)


def best_of(n: int, fn: Callable[[], float]) -> float:
    """Smallest of n timings: the run least disturbed by the rest of the machine."""
    return min(fn() for _ in range(n))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def status_mb(field: str = "VmRSS", pid: int | str = "self") -> float:
    """A memory figure of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ...) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def bench_kafka() -> str:
    """Bootstrap of the benchmark broker (own state dir and port; started once, reused)."""
    env_bs = os.environ.get("GPUPIPE_BENCH_BOOTSTRAP")
    if env_bs:
        return env_bs
    env = {
        **os.environ,
        "KAFKA_LOCAL_DIR": str(BENCH_KAFKA_DIR),
        "KAFKA_PORT": str(BENCH_PORT),
        "KAFKA_CONTROLLER_PORT": str(BENCH_PORT + 1),
    }
    out = subprocess.run(
        [str(REPO / "scripts" / "kafka-local"), "start", "--port", str(BENCH_PORT)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"benchmark broker did not start:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def stop_bench_kafka() -> None:
    env = {**os.environ, "KAFKA_LOCAL_DIR": str(BENCH_KAFKA_DIR)}
    subprocess.run([str(REPO / "scripts" / "kafka-local"), "stop"], env=env, capture_output=True, check=False)
