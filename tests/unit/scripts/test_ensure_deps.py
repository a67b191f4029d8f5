"""scripts/ensure-deps on a machine that lacks the Debian packages, as a user who cannot install them.

A PATH with only the few tools the script itself needs stands in for a fresh machine; the run must
stop at once with exactly one line that names the apt-get command, and change nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.paths import REPO

REPO = REPO
SCRIPT = REPO / "scripts" / "ensure-deps"


def _bare_path(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "id", "dirname"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return bin_dir


def _as_user(cmd: list[str]) -> list[str]:
    if os.getuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to run the check as an unprivileged user"
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


def test_non_root_stops_with_one_line_naming_the_command() -> None:
    with tempfile.TemporaryDirectory(prefix="gpupipe-deps-") as tmp:  # pytest's tmp is root-only
        Path(tmp).chmod(0o755)
        bin_dir = _bare_path(Path(tmp))
        out = subprocess.run(
            _as_user([str(bin_dir / "bash"), str(SCRIPT)]),
            env={"PATH": str(bin_dir)},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "sudo apt-get install -y --no-install-recommends" in lines[0]
    for pkg in ("prometheus", "prometheus-alertmanager", "openssl", "kcat"):
        assert f" {pkg}" in lines[0]


def test_check_mode_passes_on_this_machine() -> None:
    out = subprocess.run([str(SCRIPT), "--check"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def _helm_local(tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "GPUPIPE_GO_FALLBACK": str(tmp_path / "no-go")}
    return subprocess.run(
        [str(REPO / "scripts" / "helm-local")], env=env, capture_output=True, text=True, timeout=30
    )


def test_helm_local_without_helm_or_go_names_how_to_get_one(tmp_path: Path) -> None:
    bin_dir = _bare_path(tmp_path)
    for tool in ("mktemp", "rm", "mkdir", "sed", "date", "mv"):
        (bin_dir / tool).symlink_to(shutil.which(tool))  # type: ignore[arg-type]
    out = _helm_local(tmp_path, bin_dir)
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("helm-local: neither helm nor Go is installed; install helm (")
    assert "HELM=/path/to/helm" in line


def test_helm_local_refuses_a_go_older_than_1_24_in_one_line(tmp_path: Path) -> None:
    bin_dir = _bare_path(tmp_path)
    (bin_dir / "sed").symlink_to(shutil.which("sed"))  # type: ignore[arg-type]
    fake_go = bin_dir / "go"
    fake_go.write_text("#!/bin/sh\necho go1.19.8\n")  # Debian bookworm's golang-go
    fake_go.chmod(0o755)
    (bin_dir / "sh").symlink_to(shutil.which("sh"))  # type: ignore[arg-type]
    out = _helm_local(tmp_path, bin_dir)
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"helm-local: Go 1.19.8 at {fake_go} is older than 1.24; install helm (")


def _deps_tree(tmp: Path) -> tuple[Path, Path]:
    """A copy of ensure-deps beside stub kafka-local/helm-local, every Debian command on a stub PATH;
    the helm stub leaves a mark when it runs."""
    (tmp / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp / "scripts" / "ensure-deps")
    mark = tmp / "helm-ran"
    stubs = {
        "kafka-local": "exit 0",
        "otelcol-local": "exit 0",
        "kube-local": "exit 0",
        "prometheus3-local": "exit 0",
        "spark-jars": f"touch {mark}-spark",
        "duckdb-iceberg": "exit 0",
        "iceberg-rest-local": "exit 0",
        "helm-local": f"touch {mark}; echo /fake/helm",
    }
    for name, body in stubs.items():
        (tmp / "scripts" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp / "scripts" / name).chmod(0o755)
    bin_dir = _bare_path(tmp)
    (bin_dir / "touch").symlink_to(shutil.which("touch"))  # type: ignore[arg-type]
    (bin_dir / "sh").symlink_to(shutil.which("sh"))  # type: ignore[arg-type]
    for cmd in (
        "prometheus",
        "promtool",
        "prometheus-alertmanager",
        "openssl",
        "kcat",
        "chromium",
        "docker-compose",
        "docker-registry",
        "buildah",
        "podman",
        "mmdebstrap",
    ):
        (bin_dir / cmd).write_text("#!/bin/sh\n")
        (bin_dir / cmd).chmod(0o755)
    return bin_dir, mark


@pytest.mark.parametrize(("argv", "helm"), [([], True), (["--no-helm"], False), (["--demo"], False)])
def test_helm_is_built_for_the_tests_but_not_for_the_demo(
    tmp_path: Path, argv: list[str], helm: bool
) -> None:
    bin_dir, mark = _deps_tree(tmp_path)
    out = subprocess.run(
        [str(bin_dir / "bash"), str(tmp_path / "scripts" / "ensure-deps"), *argv],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert mark.exists() is helm
    assert Path(f"{mark}-spark").exists() is helm  # Spark's jars too are for the tests only


def test_an_unknown_option_is_one_line(tmp_path: Path) -> None:
    bin_dir, mark = _deps_tree(tmp_path)
    out = subprocess.run(
        [str(bin_dir / "bash"), str(tmp_path / "scripts" / "ensure-deps"), "--no-hlem"],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and not mark.exists()
    assert out.stderr == "ensure-deps: unknown option --no-hlem (use --check, --demo or --no-helm)\n"


def test_the_demo_never_stops_a_non_root_user_on_a_package() -> None:
    """`make demo` as anyone but root on a machine with none of the Debian packages: one note naming
    what the demo runs without (never a test-only package), then Kafka's jars, and on (exit 0)."""
    with tempfile.TemporaryDirectory(prefix="gpupipe-deps-") as tmp:  # pytest's tmp is root-only
        Path(tmp).chmod(0o755)
        bin_dir, mark = _deps_tree(Path(tmp))
        for cmd in ("prometheus", "promtool", "prometheus-alertmanager", "openssl", "kcat", "chromium"):
            (bin_dir / cmd).unlink()
        (bin_dir / "docker-compose").unlink()
        (bin_dir / "docker-registry").unlink()
        marks = Path(tmp) / "marks"
        marks.mkdir(mode=0o777)
        marks.chmod(0o777)  # the unprivileged user leaves its mark here
        kafka_mark = marks / "kafka-fetched"
        (Path(tmp) / "scripts" / "kafka-local").write_text(f"#!/bin/sh\ntouch {kafka_mark}\n")
        out = subprocess.run(
            _as_user([str(bin_dir / "bash"), str(Path(tmp) / "scripts" / "ensure-deps"), "--demo"]),
            env={"PATH": str(bin_dir)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert kafka_mark.exists() and not mark.exists()
    note, jars = out.stderr.splitlines()
    assert note.startswith("ensure-deps: the demo runs without prometheus prometheus-alertmanager openssl;")
    for test_only in ("chromium", "docker-compose", "docker-registry", "kcat"):
        assert test_only not in note
    assert jars.startswith("ensure-deps: Kafka's jars")
