"""`make demo`: what it needs, where it listens, what it shows, and how it ends.

A newcomer's first `make demo` built helm from Go for minutes (the demo never runs helm), stopped
everything when one port was taken, showed no GPU series on :9400 (dcgm-exporter's port; the
demo had the producer's own metrics there), showed neither a MIG nor a time-sliced GPU, and
exited 0 after a service died.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from gpupipe.commands import cli
from gpupipe_producer.command import fleet_config
from gpupipe_producer.simulated.fleet import SimulatedFleet
from tests.conftest import free_port
from tests.paths import REPO

REPO = REPO


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpupipe_demo", REPO / "scripts" / "demo.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _service_argv(name: str) -> list[str]:
    demo = _demo()
    (argv,) = [a for _, n, a, _ in demo.services(demo.demo_ports({})) if n == name]
    return argv


def test_gpu_metrics_are_served_on_dcgm_exporters_port() -> None:
    argv = _service_argv("metrics")
    assert argv[0] == "metrics" and argv[argv.index("--listen") + 1] == "127.0.0.1:9400"
    producer = _service_argv("producer")
    assert producer[producer.index("--listen") + 1] != "127.0.0.1:9400"


def test_demo_fleet_has_a_mig_gpu_and_a_time_sliced_gpu() -> None:
    args = cli.build_parser().parse_args(_service_argv("producer"))
    fleet = SimulatedFleet(fleet_config(args))
    samples: list[dict] = []
    for k in range(60):
        samples += fleet.tick(1_795_000_000_000 + k * 1000)[0]
    assert any(r["mig"] for r in samples), "a MIG slice"
    assert any(len(r["allocations"]) > 1 for r in samples), "a GPU time-sliced between pods"


def test_the_demo_writes_where_its_variable_says(tmp_path: Path) -> None:
    demo = _demo()
    assert demo.demo_dir({}) == REPO / ".run" / "demo"
    assert demo.demo_dir({"GPUPIPE_DEMO_DIR": str(tmp_path)}) == tmp_path
    binaries = {"prometheus": "/usr/bin/prometheus", "alertmanager": "/usr/bin/prometheus-alertmanager"}
    argv = {name: a for name, a, _ in demo.side_services(demo.demo_ports({}), binaries, tmp_path)}
    assert f"--storage.tsdb.path={tmp_path}/prometheus" in argv["prometheus"]  # its lock, not another demo's
    assert f"--storage.path={tmp_path}/am" in argv["alertmanager"]
    assert (tmp_path / "prometheus.yml").is_file()


def test_ports_come_from_their_variables() -> None:
    demo = _demo()
    ports = demo.demo_ports({"GPUPIPE_DEMO_PROMETHEUS_PORT": "19090"})
    assert ports["prometheus"] == 19090 and ports["metrics"] == 9400 and ports["kafka"] == 9092
    with pytest.raises(SystemExit, match="GPUPIPE_DEMO_METRICS_PORT='x' is not a port number"):
        demo.demo_ports({"GPUPIPE_DEMO_METRICS_PORT": "x"})
    moved = demo.services(demo.demo_ports({"GPUPIPE_DEMO_METRICS_PORT": "19400"}))
    assert ["metrics", "--listen", "127.0.0.1:19400"] in [a for _, _, a, _ in moved]


def test_a_taken_port_is_one_line_naming_it_and_its_variable() -> None:
    demo = _demo()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = demo.demo_ports({"GPUPIPE_DEMO_PROMETHEUS_PORT": str(port)})
        line = demo.taken_ports_line(ports, ["prometheus"])
    assert line == (
        f"demo: port {port} (Prometheus) is in use; set GPUPIPE_DEMO_PROMETHEUS_PORT to a free port"
    )
    assert demo.taken_ports_line(ports, ["prometheus"]) is None  # freed


def test_demo_with_its_kafka_port_taken_stops_before_starting_anything() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # Every other port free, so a demo running beside the test (default ports) changes nothing.
        env = {**os.environ, **{p.variable: str(free_port()) for p in _demo().PORTS}}
        env["GPUPIPE_DEMO_KAFKA_PORT"] = str(port)
        env["KAFKA_LOCAL_DIR"] = tempfile.mkdtemp(prefix="gpupipe-demo-")  # no broker of ours there
        try:
            res = subprocess.run(
                [sys.executable, str(REPO / "scripts" / "demo.py")],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            shutil.rmtree(env["KAFKA_LOCAL_DIR"], ignore_errors=True)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"demo: port {port} (Kafka) is in use; set GPUPIPE_DEMO_KAFKA_PORT to a free port"
    ]
    assert f"http://127.0.0.1:{env['GPUPIPE_DEMO_METRICS_PORT']}/metrics" in res.stdout  # ports printed first


def test_the_ports_are_printed_with_their_urls_and_variables() -> None:
    demo = _demo()
    text = demo.ports_banner(demo.demo_ports({}), absent=["alertmanager"])
    assert "http://127.0.0.1:9400/metrics" in text
    assert "http://127.0.0.1:9090/graph" in text
    for p in demo.PORTS:
        assert p.variable in text
    assert re.search(r"Alertmanager .*not installed", text)


def test_the_demo_points_to_the_alerts_page_and_alertmanagers_api_not_its_missing_ui(tmp_path: Path) -> None:
    """Debian's Alertmanager answers ``/#/alerts`` with "does not include a web application"."""
    demo = _demo()
    ports = demo.demo_ports({})
    banner = demo.ports_banner(ports)
    binaries = {"prometheus": "/usr/bin/prometheus", "alertmanager": "/usr/bin/prometheus-alertmanager"}
    hints = [h for _, _, h in demo.side_services(ports, binaries, tmp_path)]
    hints += [h for _, _, _, h in demo.services(ports, tmp_path)]
    for text in (banner, *hints):
        assert "#/alerts" not in text
    assert "http://127.0.0.1:9403/alerts" in banner and "http://127.0.0.1:9093/api/v2/alerts" in banner
    assert any("http://127.0.0.1:9403/alerts" in h for h in hints)
    quick = (REPO / "README.md").read_text()
    quick = quick[quick.index("## Quickstart") : quick.index("### With Docker")]
    assert "http://127.0.0.1:9403/alerts" in quick and "9093/api/v2/alerts" in quick


def test_readme_quick_start_lists_every_demo_port() -> None:
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quickstart") : readme.index("### With Docker")]
    for p in _demo().PORTS:
        assert p.variable in quick and str(p.default) in quick, p


def test_a_service_that_dies_is_named_and_ends_the_watch() -> None:
    demo = _demo()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert demo.watch([("producer", alive), ("recommend", dead)], lambda: False) == ("recommend", 3)
        assert demo.watch([("producer", alive)], lambda: True) is None  # Ctrl-C: nobody died
    finally:
        alive.kill()
        alive.wait()
        dead.wait()


def test_make_demo_does_not_build_helm_and_make_test_still_does() -> None:
    demo = subprocess.run(["make", "-n", "demo"], cwd=REPO, capture_output=True, text=True)
    assert demo.returncode == 0, demo.stderr
    assert "scripts/ensure-deps --demo" in demo.stdout
    assert not re.search(r"scripts/ensure-deps\s*$", demo.stdout, re.M)
    test = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True)
    assert re.search(r"^scripts/ensure-deps\s*$", test.stdout, re.M), test.stdout


def _dev_only_packages() -> set[str]:
    """Names of the packages only the dev (and lake-spark) extras bring, from pyproject.toml."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = set()
    for req in extras["dev"] + extras["lake-spark"]:
        names.add(re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower())
    return names - {"gpupipe"}


def test_make_demo_installs_the_runtime_dependencies_only() -> None:
    """`make demo` ran `pip install -e '.[dev]'` (4 min, 1.5 GB with pyspark) in silence."""
    # -W: as if pyproject.toml had changed, so the install step is printed even where it is done.
    res = subprocess.run(
        ["make", "-n", "-W", "pyproject.toml", "demo"], cwd=REPO, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    installs = [line for line in res.stdout.splitlines() if "pip install" in line]
    assert installs, res.stdout
    dev = _dev_only_packages()
    assert {"pytest", "pyspark", "ruff"} <= dev
    for line in installs:
        assert "[" not in line and "dev" not in line, line  # no extra at all
        assert " -q" not in line, line  # pip shows what it installs
        assert not dev & {w.lower() for w in re.split(r"[\s'\"]", line)}, line
    assert "scripts/ensure-deps --demo" in res.stdout


def _running(pid: int) -> str:
    return f"demo: already running (pid {pid}); stop it with Ctrl-C in its terminal, or: kill {pid}"


def test_a_second_demo_is_refused_in_one_line_while_the_first_holds_its_lock(tmp_path: Path) -> None:
    demo = _demo()
    first, line = demo.claim(tmp_path)
    assert first is not None and line is None
    try:
        second, line = demo.claim(tmp_path)
        assert second is None
        assert line == _running(os.getpid())
    finally:
        first.close()
    again, line = demo.claim(tmp_path)  # the first ended: its pid file is no obstacle
    assert again is not None and line is None
    again.close()


def test_a_second_demo_start_exits_2_without_starting_anything(tmp_path: Path) -> None:
    demo = _demo()
    data, kafka_dir = tmp_path / "demo", tmp_path / "kafka"
    kafka_dir.mkdir()
    first, _ = demo.claim(data)  # a demo of this folder is running
    env = {**os.environ, **{p.variable: str(free_port()) for p in demo.PORTS}}
    env.update(GPUPIPE_DEMO_DIR=str(data), KAFKA_LOCAL_DIR=str(kafka_dir))
    try:
        res = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "demo.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        assert first is not None
        first.close()
    assert res.returncode == 2
    assert res.stderr.splitlines() == [_running(os.getpid())]
    assert res.stdout == ""  # not even the ports banner
    assert [p.name for p in data.iterdir()] == ["demo.pid"] and not list(kafka_dir.iterdir())


def test_many_taken_ports_are_one_short_line() -> None:
    """A second demo beside a first printed one 700-character line asking to move 8 ports."""
    demo = _demo()
    socks = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            socks.append(s)
        keys = [p.key for p in demo.PORTS][:8]
        ports = {k: s.getsockname()[1] for k, s in zip(keys, socks, strict=True)}
        line = demo.taken_ports_line(ports, keys)
    finally:
        for s in socks:
            s.close()
    assert line is not None and "\n" not in line and len(line) < 160, line
    assert line.startswith("demo: ports ") and "another demo?" in line
    assert all(str(port) in line for port in ports.values())
