"""`make demo`: a local broker, a simulated fleet, and every consumer service that exists.

Ctrl-C (or SIGTERM) stops the services in reverse order, then the broker.
GPUPIPE_DEMO_SECURE=1: the broker runs with `kafka-local start --secure` (SASL_SSL, ACLs; state in
.run/kafka-secure), the ACLs of every role are applied and each service runs as its own role.
Ports: Kafka 9092 (GPUPIPE_DEMO_KAFKA_PORT), producer self-metrics 9400, metrics 9401,
chargeback 9402, alerts 9403, recommend 9404; Prometheus 9090 and Alertmanager 9093 when their binaries are
installed (Debian packages prometheus, prometheus-alertmanager).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
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
CLI = ".venv/bin/gpupipe"

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
        f"chargeback windows (1 min in the demo): {CLI} report chargeback --by team --period all",
    ),
    (
        "consumers.alerts.command",
        "alerts",
        ["alerts", "--listen", "127.0.0.1:9403", "--dry-run"],
        f"XID alerts: {CLI} tail gpu.alerts.v1 (cordon decisions are dry-run only)",
    ),
    (
        "consumers.recommend.command",
        "recommend",
        [
            "recommend",
            "--listen",
            "127.0.0.1:9404",
            "--idle-after",
            "5m",  # demo scale (default 2h)
            "--update-interval",
            "1m",
            "--prices",
            str(REPO / "deploy" / "prices.example.yaml"),
        ],
        f"idle-GPU recommendations (idle 5 min in the demo): {CLI} report idle --since 1h --by owner",
    ),
]

PROMETHEUS_YML = """global: {scrape_interval: 5s, evaluation_interval: 5s}
rule_files: ['%(rules)s']
alerting:
  alertmanagers: [{static_configs: [{targets: ['127.0.0.1:9093']}]}]
scrape_configs:
  - job_name: gpupipe-metrics
    honor_labels: true
    static_configs: [{targets: ['127.0.0.1:9401']}]
    metric_relabel_configs:
      - {source_labels: [Hostname, hostname], separator: "", regex: "(.+)", target_label: instance}
  - job_name: gpupipe-services
    static_configs: [{targets: ['127.0.0.1:9400', '127.0.0.1:9402', '127.0.0.1:9403', '127.0.0.1:9404']}]
"""


def side_services() -> list[tuple[str, list[str], str]]:
    """Alertmanager and Prometheus from the machine's packages, when installed."""
    out = []
    am = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if am:
        out.append(
            (
                "alertmanager",
                [
                    am,
                    f"--config.file={REPO}/deploy/alertmanager/alertmanager.yml",
                    f"--storage.path={LOGS}/am",
                    "--web.listen-address=127.0.0.1:9093",
                    "--cluster.listen-address=",
                ],
                "Alertmanager: http://127.0.0.1:9093/#/alerts",
            )
        )
    prom = shutil.which("prometheus")
    if prom and importlib.util.find_spec("consumers.metrics.command") is not None:
        cfg = LOGS / "prometheus.yml"
        cfg.write_text(
            PROMETHEUS_YML % {"rules": REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml"}
        )
        out.append(
            (
                "prometheus",
                [
                    prom,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={LOGS}/prometheus",
                    "--web.listen-address=127.0.0.1:9090",
                ],
                "Prometheus: http://127.0.0.1:9090/graph?g0.expr=DCGM_FI_DEV_GPU_UTIL",
            )
        )
    return out


def secure_roles(bootstrap: str, secure_dir: Path) -> dict[str, dict[str, str]]:
    """GPUPIPE_DEMO_SECURE=1: apply every role's ACLs, create the topics as admin, and return each
    service's environment (its role's --kafka-config-file; no topic creation rights needed)."""
    from gpupipe import kafka_config, topics
    from gpupipe.kafka_admin import ensure_topics

    clients = secure_dir / "clients"
    admin = kafka_config.resolve([], str(clients / "admin.properties"), {})
    ensure_topics(bootstrap, topics.ALL, extra=admin)
    res = subprocess.run(
        [
            *GP,
            "acls",
            "--apply",
            "--bootstrap-servers",
            bootstrap,
            "--kafka-config-file",
            str(clients / "admin.properties"),
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"demo: applying ACLs failed: {res.stderr.strip()}")
    roles = {r: r for r in ("producer", "metrics", "chargeback", "alerts", "recommend")}
    return {
        name: {
            "GPUPIPE_KAFKA_CONFIG_FILE": str(clients / f"{role}.properties"),
            "GPUPIPE_CREATE_TOPICS": "false",
        }
        for name, role in roles.items()
    }


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    print("demo: starting local Kafka (first run downloads the jars from Maven Central) ...", flush=True)
    # The broker's controller listener would take port+1 = 9093, Alertmanager's port: move it.
    kenv = {
        **os.environ,
        "KAFKA_CONTROLLER_PORT": os.environ.get("GPUPIPE_DEMO_KAFKA_CONTROLLER_PORT", "29093"),
    }
    secure = os.environ.get("GPUPIPE_DEMO_SECURE", "").lower() in ("1", "true", "yes")
    if secure:
        kenv["KAFKA_LOCAL_DIR"] = str(REPO / ".run" / "kafka-secure")
    out = subprocess.run(
        [KAFKA, "start", "--port", PORT, *(["--secure"] if secure else [])],
        capture_output=True,
        text=True,
        env=kenv,
    )
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    bootstrap = out.stdout.strip().splitlines()[-1]
    role_env = secure_roles(bootstrap, Path(kenv["KAFKA_LOCAL_DIR"]) / "secure") if secure else {}
    if secure:
        print("\n".join(line for line in out.stderr.splitlines() if "secure:" in line), flush=True)
    env = {**os.environ, "GPUPIPE_BOOTSTRAP_SERVERS": bootstrap, "GPUPIPE_LOG_FORMAT": "text"}
    procs: list[tuple[str, subprocess.Popen]] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def start(name: str, argv: list[str], hint: str, child_env: dict[str, str] | None = None) -> None:
        log = open(LOGS / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the process)
        p = subprocess.Popen(
            argv, env=child_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        procs.append((name, p))
        print(f"demo: started {name:<12} {hint}", flush=True)

    try:
        print(f"demo: Kafka at {bootstrap}")
        extra = side_services()
        for name, argv, hint in extra:
            start(name, argv, hint)
        have_am = any(name == "alertmanager" for name, _, _ in extra)
        for module, name, argv, hint in SERVICES:
            if importlib.util.find_spec(module) is None:
                continue
            if name == "alerts" and have_am:
                argv = [*argv, "--alertmanager-url", "http://127.0.0.1:9093"]
            start(name, [*GP, *argv], hint, {**env, **role_env.get(name, {})})
            time.sleep(1.0 if name == "producer" else 0.2)
        tail_cfg = (
            f" --kafka-config-file {kenv['KAFKA_LOCAL_DIR']}/secure/clients/tail.properties" if secure else ""
        )
        print(f"demo: records as JSON:  {CLI} tail gpu.samples.v1 --bootstrap-servers {bootstrap}{tail_cfg}")
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
        subprocess.run([KAFKA, "stop"], capture_output=True, env=kenv)
        print("demo: Kafka stopped. Bye.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
