"""The suite's hygiene guards (tests/hygiene.py) catch what a test leaves behind.

Each case runs a small inner pytest session in a subprocess with the same guards and checks its
outcome: a leaked child process or thread makes the test error (and the child is killed), a process
that outlives the whole session fails the run, and a clean test passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hygiene import live_descendants, popen, stop_group

REPO = Path(__file__).resolve().parents[2]
CONFTEST = "from tests.hygiene import _hygiene, pytest_sessionfinish, pytest_testnodedown  # noqa: F401\n"


def _inner(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            *args,
            ".",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "GPUPIPE_TEST_GRACE_S": "0.5"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_leaked_child_process_errors_the_test_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    out = _inner(
        tmp_path,
        f"""
        import subprocess
        def test_leaks():
            p = subprocess.Popen(["sleep", "300"])
            open({str(pidfile)!r}, "w").write(str(p.pid))
        """,
    )
    assert out.returncode == 1, out.stdout
    assert "left things behind" in out.stdout and "sleep 300" in out.stdout
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_leaked_thread_errors_the_test(tmp_path: Path) -> None:
    out = _inner(
        tmp_path,
        """
        import threading
        stop = threading.Event()
        def test_leaks_a_consumer_thread():
            threading.Thread(target=stop.wait, args=(30,), name="consumer-loop", daemon=True).start()
        def test_after():
            stop.set()
        """,
    )
    assert out.returncode == 1, out.stdout
    assert "threads still running after the test: consumer-loop" in out.stdout
    assert "2 passed, 1 error" in out.stdout  # the call passed, its teardown errored


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["serial", "xdist"])
def test_process_outliving_the_session_fails_the_run(tmp_path: Path, workers: list[str]) -> None:
    # Under xdist (make test runs the suite on workers) a worker's leak must fail the whole run too.
    out = _inner(
        tmp_path,
        """
        import subprocess
        import pytest
        @pytest.fixture(scope="session")
        def server():
            yield subprocess.Popen(["sleep", "301"])  # never stopped
        def test_uses(server):
            assert server.poll() is None
        """,
        *workers,
    )
    assert out.returncode == 1, out.stdout
    assert "test hygiene: 1 process(es) started by this run were still alive (killed)" in out.stdout
    assert "sleep 301" in out.stdout


def test_clean_session_passes(tmp_path: Path) -> None:
    out = _inner(
        tmp_path,
        """
        import subprocess
        def test_waits_for_its_child():
            assert subprocess.run(["true"]).returncode == 0
        """,
    )
    assert out.returncode == 0, out.stdout


def test_stop_group_ends_the_child_and_its_children() -> None:
    proc = popen(["bash", "-c", "sleep 302 & sleep 303 & wait"])
    try:
        for _ in range(100):
            if len([c for c in live_descendants(proc.pid).values() if "sleep 30" in c]) == 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert len(live_descendants(proc.pid)) == 2
    finally:
        rc = stop_group(proc, timeout=2)
    assert rc != 0
    assert not [c for c in live_descendants().values() if "sleep 302" in c or "sleep 303" in c]
