"""`make demo`: a local broker, a simulated fleet, and every consumer service that exists.

Ctrl-C (or SIGTERM) stops the services in reverse order, then the broker.
Ports: Kafka 9092 (GPUPIPE_DEMO_KAFKA_PORT), producer self-metrics 9400,
metrics 9401, chargeback 9402, alerts 9403.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KAFKA = str(REPO / "scripts" / "kafka-local")
PORT = os.environ.get("GPUPIPE_DEMO_KAFKA_PORT", "9092")
GP = [sys.executable, "-m", "gpupipe"]
LOGS = REPO / ".run" / "demo"

# (module that must exist, name, argv, what to tell the user)
SERVICES = [
    (
        "producer.command",
        "producer",
        [
            "produce",
            "--source",
            "simulated",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--interval",
            "1s",
            "--speed",
            "1",
            "--xid-rate",
            "20",
            "--listen",
            "127.0.0.1:9400",
        ],
        "simulated fleet: 4 nodes x 8 GPUs, 1 sample/s each; own metrics http://127.0.0.1:9400/metrics",
    ),
    (
        "consumers.metrics.command",
        "metrics",
        ["metrics", "--listen", "127.0.0.1:9401"],
        "dcgm-exporter-compatible metrics: curl -s http://127.0.0.1:9401/metrics | grep DCGM_FI_DEV_GPU_UTIL",
    ),
    (
        "consumers.chargeback.command",
        "chargeback",
        ["chargeback", "--window", "1m", "--grace", "10s", "--listen", "127.0.0.1:9402"],
        "chargeback windows (1 min in the demo): gpupipe report chargeback --from 2000-01-01 --to 2100-01-01",
    ),
    (
        "consumers.alerts.command",
        "alerts",
        ["alerts", "--listen", "127.0.0.1:9403"],
        "XID alerts: gpupipe tail gpu.alerts.v1",
    ),
]


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    print("demo: starting local Kafka (first run downloads the jars from Maven Central) ...", flush=True)
    out = subprocess.run([KAFKA, "start", "--port", PORT], capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    bootstrap = out.stdout.strip().splitlines()[-1]
    env = {**os.environ, "GPUPIPE_BOOTSTRAP_SERVERS": bootstrap, "GPUPIPE_LOG_FORMAT": "text"}
    procs: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"demo: Kafka at {bootstrap}")
        for module, name, argv, hint in SERVICES:
            if importlib.util.find_spec(module) is None:
                continue
            log = open(LOGS / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
            p = subprocess.Popen(
                [*GP, *argv], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )
            procs.append((name, p))
            print(f"demo: started {name:<10} {hint}")
            time.sleep(1.0 if name == "producer" else 0.2)
        print(
            f"demo: records as JSON:  .venv/bin/gpupipe tail gpu.samples.v1 --bootstrap-servers {bootstrap}"
        )
        print(f"demo: logs in {LOGS}/   Ctrl-C stops everything.", flush=True)
        while not stopping:
            for name, p in procs:
                if p.poll() is not None:
                    print(f"demo: {name} exited with {p.returncode}; see {LOGS}/{name}.log", file=sys.stderr)
                    stopping = True
            time.sleep(0.5)
    finally:
        for _, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            print(f"demo: stopped {name}")
        subprocess.run([KAFKA, "stop"], capture_output=True)
        print("demo: Kafka stopped. Bye.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
