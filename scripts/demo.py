"""`make demo`: a local broker, a simulated fleet, and every consumer service that exists.

Ctrl-C (or SIGTERM) stops the services in reverse order, then the broker. The demo exits 0 after
Ctrl-C, 1 naming the service when one of them died (the others are stopped then), 2 when a port it
needs is taken.
GPUPIPE_DEMO_SECURE=1: the broker runs with `kafka-local start --secure` (SASL_SSL, ACLs; state in
.run/kafka-secure), the ACLs of every role are applied and each service runs as its own role.
Ports (see PORTS; each has a GPUPIPE_DEMO_*_PORT variable, printed at start): the GPU metrics on
9400, where dcgm-exporter serves them, so `curl http://127.0.0.1:9400/metrics` shows GPUs as a
dcgm-exporter user expects; producer self-metrics 9401, chargeback 9402, alerts 9403, recommend
9404, Kafka 9092 (its controller 29093); Prometheus 9090 and Alertmanager 9093 when their binaries
are installed (Debian packages prometheus, prometheus-alertmanager). All are checked before anything
starts: a taken port is one line naming it and its variable, rather than a service dying mid-start.
Files: logs and Prometheus's and Alertmanager's data in GPUPIPE_DEMO_DIR (default .run/demo); the
broker's state in kafka-local's KAFKA_LOCAL_DIR (default .run/kafka; a new directory is a fresh
broker). One demo per GPUPIPE_DEMO_DIR: a running demo holds a lock on its demo.pid there (released
when it exits, however it exits), and a second start says in one line that one runs and how to stop
it, and exits 2 before it checks a port or starts anything.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, NamedTuple

REPO = Path(__file__).resolve().parent.parent
KAFKA = str(REPO / "scripts" / "kafka-local")
GP = [sys.executable, "-m", "gpupipe"]
#: Logs, and Prometheus's and Alertmanager's data; GPUPIPE_DEMO_DIR moves them, so that a second demo
#: of the same checkout (or a test) keeps its own and no Prometheus finds its storage locked.
DEFAULT_DIR = REPO / ".run" / "demo"
CLI = ".venv/bin/gpupipe"


class Port(NamedTuple):
    key: str
    variable: str
    default: int
    what: str
    url: str  # how to reach it ("{port}" filled in)


PORTS: tuple[Port, ...] = (
    Port(
        "metrics",
        "GPUPIPE_DEMO_METRICS_PORT",
        9400,
        "GPU metrics (dcgm-exporter names)",
        "http://127.0.0.1:{port}/metrics",
    ),
    Port(
        "producer",
        "GPUPIPE_DEMO_PRODUCER_PORT",
        9401,
        "producer self-metrics",
        "http://127.0.0.1:{port}/metrics",
    ),
    Port("chargeback", "GPUPIPE_DEMO_CHARGEBACK_PORT", 9402, "chargeback", "http://127.0.0.1:{port}/metrics"),
    Port(
        "alerts",
        "GPUPIPE_DEMO_ALERTS_PORT",
        9403,
        "open alerts (page; /alerts.json)",
        "http://127.0.0.1:{port}/alerts",
    ),
    Port(
        "recommend",
        "GPUPIPE_DEMO_RECOMMEND_PORT",
        9404,
        "idle-GPU recommendations",
        "http://127.0.0.1:{port}/metrics",
    ),
    Port("lake", "GPUPIPE_DEMO_LAKE_PORT", 9406, "lake writer", "http://127.0.0.1:{port}/metrics"),
    Port(
        "prometheus",
        "GPUPIPE_DEMO_PROMETHEUS_PORT",
        9090,
        "Prometheus",
        "http://127.0.0.1:{port}/graph?g0.expr=DCGM_FI_DEV_GPU_UTIL",
    ),
    Port(
        "alertmanager",
        "GPUPIPE_DEMO_ALERTMANAGER_PORT",
        9093,
        "Alertmanager API (Debian: no UI)",
        "http://127.0.0.1:{port}/api/v2/alerts",
    ),
    Port("kafka", "GPUPIPE_DEMO_KAFKA_PORT", 9092, "Kafka", "127.0.0.1:{port}"),
    Port(
        "kafka-controller",
        "GPUPIPE_DEMO_KAFKA_CONTROLLER_PORT",
        29093,
        "Kafka's controller",
        "127.0.0.1:{port}",
    ),
)


def demo_ports(environ: Mapping[str, str]) -> dict[str, int]:
    """Each port of the demo: its GPUPIPE_DEMO_*_PORT variable, else its default."""
    out = {}
    for p in PORTS:
        text = environ.get(p.variable, "").strip() or str(p.default)
        if not text.isdigit() or not 0 < int(text) < 65536:
            raise SystemExit(f"demo: {p.variable}={text!r} is not a port number (1-65535)")
        out[p.key] = int(text)
    return out


def demo_dir(environ: Mapping[str, str]) -> Path:
    """Where the demo writes: GPUPIPE_DEMO_DIR, else .run/demo of the checkout."""
    text = environ.get("GPUPIPE_DEMO_DIR", "").strip()
    return Path(text).resolve() if text else DEFAULT_DIR


def claim(data: Path) -> tuple[IO[str] | None, str | None]:
    """Take the demo's lock in ``data`` (held while the returned file stays open): (file, None), or
    (None, the one line to print) when a running demo holds it."""
    data.mkdir(parents=True, exist_ok=True)
    f = open(data / "demo.pid", "a+")  # noqa: SIM115 (open as long as the demo runs)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        return None, f"demo: already running (pid {pid}); stop it with Ctrl-C in its terminal, or: kill {pid}"
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f, None


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on host:port (a bind as the services do it fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def taken_ports_line(ports: Mapping[str, int], keys: Sequence[str]) -> str | None:
    """One line naming every taken port of `keys` and the variable that moves it; None when all are free."""
    by_key = {p.key: p for p in PORTS}
    taken = [by_key[k] for k in keys if port_taken(ports[k])]
    if not taken:
        return None
    if len(taken) == 1:
        (p,) = taken
        return f"demo: port {ports[p.key]} ({p.what}) is in use; set {p.variable} to a free port"
    # Several at once is most likely another demo (another GPUPIPE_DEMO_DIR): one short line, not one
    # clause per port.
    numbers = ", ".join(str(ports[p.key]) for p in taken)
    return (
        f"demo: ports {numbers} are in use (another demo?); stop it, or move each with its "
        "GPUPIPE_DEMO_*_PORT variable"
    )


def ports_banner(ports: Mapping[str, int], absent: Sequence[str] = ()) -> str:
    """Where to look, printed before anything starts (README's quick start lists the same)."""
    lines = ["demo: ports (each movable with its variable):"]
    for p in PORTS:
        note = "  (not installed: skipped)" if p.key in absent else ""
        where = p.url.format(port=ports[p.key])
        lines.append(f"demo:   {p.what:<34} {where:<58} {p.variable}{note}")
    return "\n".join(lines)


#: The demo fleet's forced node kinds: seed 1's four nodes draw neither a MIG GPU nor a time-sliced one,
#: and those are what the chargeback split and the "MIG slices" / "time-sliced" panels are about.
DEMO_MIG_NODES = "3"
DEMO_SHARED_NODES = "0"


def services(ports: Mapping[str, int], data: Path = DEFAULT_DIR) -> list[tuple[str, str, list[str], str]]:
    """(module that must exist, name, argv, what to tell the user) of every gpupipe service; ``data``
    is the demo's folder (the lake's catalog and warehouse go there)."""
    lake = data / "lake"
    return [
        (
            "gpupipe_producer.command",
            "producer",
            [
                "produce",
                "--source",
                "simulated",
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--mig-nodes",
                DEMO_MIG_NODES,
                "--shared-nodes",
                DEMO_SHARED_NODES,
                "--interval",
                "1s",
                "--speed",
                "1",
                "--xid-rate",
                "20",
                "--listen",
                f"127.0.0.1:{ports['producer']}",
            ],
            "simulated fleet: 4 nodes x 8 GPUs (node 3 with a MIG GPU, node 0 time-sliced), 1 sample/s "
            f"each; own metrics http://127.0.0.1:{ports['producer']}/metrics",
        ),
        (
            "gpupipe_consumers.metrics.command",
            "metrics",
            ["metrics", "--listen", f"127.0.0.1:{ports['metrics']}"],
            "dcgm-exporter-compatible metrics: "
            f"curl -s http://127.0.0.1:{ports['metrics']}/metrics | grep DCGM_FI_DEV_GPU_UTIL",
        ),
        (
            "gpupipe_consumers.chargeback.command",
            "chargeback",
            [
                "chargeback",
                "--window",
                "1m",
                "--grace",
                "10s",
                "--listen",
                f"127.0.0.1:{ports['chargeback']}",
            ],
            f"chargeback windows (1 min in the demo): {CLI} report chargeback --by team --period all",
        ),
        (
            "gpupipe_consumers.alerts.command",
            "alerts",
            ["alerts", "--listen", f"127.0.0.1:{ports['alerts']}", "--dry-run"],
            f"open alerts: http://127.0.0.1:{ports['alerts']}/alerts (records: {CLI} tail gpu.alerts.v1; "
            "cordons are dry-run only)",
        ),
        (
            "gpupipe_consumers.recommend.command",
            "recommend",
            [
                "recommend",
                "--listen",
                f"127.0.0.1:{ports['recommend']}",
                "--idle-after",
                "5m",  # demo scale (default 2h)
                "--update-interval",
                "1m",
                "--prices",
                str(REPO / "deploy" / "prices.example.yaml"),
            ],
            f"idle-GPU recommendations (idle 5 min in the demo): {CLI} report idle --since 1h --by owner",
        ),
        (
            "gpupipe_consumers.lake.command",
            "lake",
            [
                "lake",
                "write",
                "--listen",
                f"127.0.0.1:{ports['lake']}",
                "--flush-interval",
                "30s",  # demo scale: rows are queryable within a minute
                "--catalog-uri",
                f"sqlite:///{lake}/catalog.db",
                "--warehouse",
                str(lake / "warehouse"),
            ],
            f"lake tables (Iceberg): GPUPIPE_CATALOG_URI=sqlite:///{lake}/catalog.db "
            f"GPUPIPE_WAREHOUSE={lake}/warehouse {CLI} lake query "
            '"SELECT hostname, count(*) AS samples FROM samples GROUP BY 1"',
        ),
    ]


def watch(
    procs: Sequence[tuple[str, subprocess.Popen]], stopping: Callable[[], bool]
) -> tuple[str, int] | None:
    """Wait until asked to stop or until a process ends; the first one that ended, with its status."""
    while not stopping():
        for name, p in procs:
            if p.poll() is not None:
                return name, p.returncode
        time.sleep(0.5)
    return None


PROMETHEUS_YML = """global: {scrape_interval: 5s, evaluation_interval: 5s}
rule_files: ['%(rules)s']
alerting:
  alertmanagers: [{static_configs: [{targets: ['127.0.0.1:%(alertmanager)d']}]}]
scrape_configs:
  - job_name: gpupipe-metrics
    honor_labels: true
    static_configs: [{targets: ['127.0.0.1:%(metrics)d']}]
    metric_relabel_configs:
      - {source_labels: [Hostname, hostname], separator: "", regex: "(.+)", target_label: instance}
  - job_name: gpupipe-services
    static_configs:
      - targets: ['127.0.0.1:%(producer)d', '127.0.0.1:%(chargeback)d', '127.0.0.1:%(alerts)d',
                  '127.0.0.1:%(recommend)d']
"""


def side_binaries() -> dict[str, str]:
    """Alertmanager's and Prometheus's binaries from the machine's packages, those installed."""
    found = {
        "alertmanager": shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"),
        "prometheus": shutil.which("prometheus")
        if importlib.util.find_spec("gpupipe_consumers.metrics.command") is not None
        else None,
    }
    return {k: v for k, v in found.items() if v}


def side_services(
    ports: Mapping[str, int], binaries: Mapping[str, str], logs: Path
) -> list[tuple[str, list[str], str]]:
    """Alertmanager and Prometheus from the machine's packages, when installed (their data in `logs`)."""
    out = []
    am = binaries.get("alertmanager")
    if am:
        out.append(
            (
                "alertmanager",
                [
                    am,
                    f"--config.file={REPO}/deploy/alertmanager/alertmanager.yml",
                    f"--storage.path={logs}/am",
                    f"--web.listen-address=127.0.0.1:{ports['alertmanager']}",
                    "--cluster.listen-address=",
                ],
                f"Alertmanager's API: http://127.0.0.1:{ports['alertmanager']}/api/v2/alerts",
            )
        )
    prom = binaries.get("prometheus")
    if prom:
        cfg = logs / "prometheus.yml"
        cfg.write_text(
            PROMETHEUS_YML % {"rules": REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml", **ports}
        )
        out.append(
            (
                "prometheus",
                [
                    prom,
                    f"--config.file={cfg}",
                    f"--storage.tsdb.path={logs}/prometheus",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                f"Prometheus: http://127.0.0.1:{ports['prometheus']}/graph?g0.expr=DCGM_FI_DEV_GPU_UTIL",
            )
        )
    return out


def secure_roles(bootstrap: str, secure_dir: Path) -> dict[str, dict[str, str]]:
    """GPUPIPE_DEMO_SECURE=1: apply every role's ACLs, create the topics as admin, and return each
    service's environment (its role's --kafka-config-file; no topic creation rights needed)."""
    from gpupipe.kafka import config as kafka_config
    from gpupipe.kafka import topics
    from gpupipe.kafka.admin import ensure_topics

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


def _kafka_running(kenv: Mapping[str, str]) -> bool:
    """Whether kafka-local's broker for this state directory already runs (start then reuses it)."""
    return subprocess.run([KAFKA, "status"], capture_output=True, env=dict(kenv)).returncode == 0


def main() -> int:
    ports = demo_ports(os.environ)
    logs = demo_dir(os.environ)
    lock, running = claim(logs)  # before anything else: a second demo changes nothing
    if lock is None:
        print(running, file=sys.stderr)
        return 2
    binaries = side_binaries()
    absent = [k for k in ("prometheus", "alertmanager") if k not in binaries]
    # The broker's controller listener would take port+1 = 9093, Alertmanager's port: move it.
    kenv = {**os.environ, "KAFKA_CONTROLLER_PORT": str(ports["kafka-controller"])}
    secure = os.environ.get("GPUPIPE_DEMO_SECURE", "").lower() in ("1", "true", "yes")
    if secure:
        kenv["KAFKA_LOCAL_DIR"] = str(REPO / ".run" / "kafka-secure")
    needed = [p.key for p in PORTS if p.key not in absent]
    if _kafka_running(kenv):
        needed = [k for k in needed if not k.startswith("kafka")]
    print(ports_banner(ports, absent), flush=True)
    if line := taken_ports_line(ports, needed):
        print(line, file=sys.stderr)
        return 2
    logs.mkdir(parents=True, exist_ok=True)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    # From here on Ctrl-C is a request to stop, also while the broker starts: it runs in its own
    # session and would outlive a demo that a KeyboardInterrupt ended.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print("demo: starting local Kafka (first run downloads the jars from Maven Central) ...", flush=True)
    out = subprocess.run(
        [KAFKA, "start", "--port", str(ports["kafka"]), *(["--secure"] if secure else [])],
        capture_output=True,
        text=True,
        env=kenv,
    )
    if stopping:
        subprocess.run([KAFKA, "stop"], capture_output=True, env=kenv)
        print("demo: stopped while Kafka was starting. Bye.", flush=True)
        return 0
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    bootstrap = out.stdout.strip().splitlines()[-1]
    role_env = secure_roles(bootstrap, Path(kenv["KAFKA_LOCAL_DIR"]) / "secure") if secure else {}
    if secure:
        print("\n".join(line for line in out.stderr.splitlines() if "secure:" in line), flush=True)
    env = {**os.environ, "GPUPIPE_BOOTSTRAP_SERVERS": bootstrap, "GPUPIPE_LOG_FORMAT": "text"}
    procs: list[tuple[str, subprocess.Popen]] = []
    died: tuple[str, int] | None = None

    def start(name: str, argv: list[str], hint: str, child_env: dict[str, str] | None = None) -> None:
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 (lives as long as the process)
        p = subprocess.Popen(
            argv, env=child_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        procs.append((name, p))
        print(f"demo: started {name:<12} {hint}", flush=True)

    try:
        print(f"demo: Kafka at {bootstrap}")
        extra = side_services(ports, binaries, logs)
        for name, argv, hint in extra:
            start(name, argv, hint)
        have_am = any(name == "alertmanager" for name, _, _ in extra)
        for module, name, argv, hint in services(ports, logs):
            if stopping:  # Ctrl-C while starting: start no more
                break
            if importlib.util.find_spec(module) is None:
                continue
            if name == "alerts" and have_am:
                argv = [*argv, "--alertmanager-url", f"http://127.0.0.1:{ports['alertmanager']}"]
            start(name, [*GP, *argv], hint, {**env, **role_env.get(name, {})})
            time.sleep(1.0 if name == "producer" else 0.2)
        tail_cfg = (
            f" --kafka-config-file {kenv['KAFKA_LOCAL_DIR']}/secure/clients/tail.properties" if secure else ""
        )
        print(f"demo: records as JSON:  {CLI} tail gpu.samples.v1 --bootstrap-servers {bootstrap}{tail_cfg}")
        print(f"demo: logs in {logs}/   Ctrl-C stops everything.", flush=True)
        died = watch(procs, lambda: stopping)
        if died is not None:
            print(f"demo: {died[0]} exited with {died[1]}; see {logs}/{died[0]}.log", file=sys.stderr)
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
    lock.close()  # the next demo may start
    if died is not None:
        print(f"demo: failed: {died[0]} exited with {died[1]} (log: {logs}/{died[0]}.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
