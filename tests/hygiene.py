"""Test hygiene: every process and thread a test starts ends with it, and the run proves it.

Why: a failed test used to leave `gpupipe metrics` / `gpupipe produce` children running, and
consumer threads that outlived their test wrote "Logging error ... I/O operation on closed file"
after pytest had closed its capture. Three parts:

- :func:`popen` starts a child in its own process group (so one signal reaches its children too),
  asks the kernel to kill it if pytest itself dies (``PR_SET_PDEATHSIG``), and records it;
  :func:`stop_group` ends a group: SIGTERM, a grace period, then SIGKILL.
- a per-test guard (autouse fixture ``_hygiene``): a thread or child process born during a test
  and still alive after its teardown (plus a short grace) is ended and the test ERRORS, naming it.
- a session guard (``pytest_sessionfinish``): anything this pytest process started that is still
  alive once every fixture is torn down fails the run. Only descendants of this process and
  brokers whose pid files lie under this session's temporary directory are looked at: other
  pytest sessions run on the same machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_PR_SET_PDEATHSIG = 1
_RECORDED: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
GRACE_S = float(os.environ.get("GPUPIPE_TEST_GRACE_S", "5"))  # how long a test's leftovers may take to end


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def popen(cmd: Any, **kw: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen` for a test's child: own process group, dies with pytest, recorded."""
    kw.setdefault("start_new_session", True)
    kw.setdefault("preexec_fn", _die_with_parent)
    proc: subprocess.Popen[Any] = subprocess.Popen(cmd, **kw)
    _RECORDED.add(proc)
    return proc


def stop_group(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = GRACE_S) -> int:
    """Signal the child's process group, wait `timeout`, then SIGKILL the group; return its status."""
    for s, wait in ((sig, timeout), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        _signal_group(proc.pid, s)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    _signal_group(proc.pid, signal.SIGKILL)  # grandchildren left in the group
    return proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- what this process started ------------------------------------------------------------------
def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def live_descendants(root: int | None = None) -> dict[int, str]:
    """pid -> command line of every live (not zombie) descendant of `root` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is None:
            continue
        children.setdefault(st[0], []).append(int(entry))
        states[int(entry)] = st[1]
    out: dict[int, str] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if states.get(pid) not in (None, "Z", "X"):
            out[pid] = _cmdline(pid)
    return out


def recorded_brokers(basetemp: Path) -> dict[int, str]:
    """Brokers started by scripts/kafka-local with a state dir of this session (they daemonize)."""
    out: dict[int, str] = {}
    if not basetemp.is_dir():
        return out
    for pidfile in basetemp.rglob("kafka.pid"):
        try:
            pid = int(pidfile.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        st = _stat(pid) if pid else None
        if st is not None and st[1] not in ("Z", "X") and str(pidfile.parent) in _cmdline(pid):
            out[pid] = _cmdline(pid)
    return out


def _kill(pids: dict[int, str]) -> None:
    for pid in pids:
        _signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: dict[int, str], timeout: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    left = dict(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p: c for p, c in left.items() if (st := _stat(p)) is not None and st[1] not in ("Z", "X")}
    return left


def _describe(pids: dict[int, str]) -> str:
    return "; ".join(f"pid {p}: {c}" for p, c in sorted(pids.items()))


# -- the guards -----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a thread or a child process behind (after a short grace)."""
    threads_before = set(threading.enumerate())
    procs_before = set(live_descendants())
    yield
    deadline = time.monotonic() + GRACE_S
    threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    threads = [t for t in threads if t.is_alive()]
    procs = {p: c for p, c in live_descendants().items() if p not in procs_before}
    procs = _wait_gone(procs, max(0.5, deadline - time.monotonic()))
    problems = []
    if procs:
        _kill(procs)
        problems.append(f"processes still running after the test (now killed): {_describe(procs)}")
    if threads:
        problems.append("threads still running after the test: " + ", ".join(t.name for t in threads))
    if problems:
        pytest.fail(f"{request.node.nodeid} left things behind: " + " | ".join(problems), pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every fixture's teardown: nothing this session started may still be alive.

    Under pytest-xdist each worker runs this for what it started and hands its finding to the
    controller (a worker's own report is not shown), which fails the run for it.
    """
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for msg in getattr(config, "_hygiene_worker_leaks", []):
        _fail_session(session, reporter, msg)
    left = live_descendants()
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        with contextlib.suppress(OSError, ValueError):
            left.update(recorded_brokers(factory.getbasetemp()))
    left = _wait_gone(left, 2.0)
    if not left:
        return
    _kill(left)
    msg = f"test hygiene: {len(left)} process(es) started by this run were still alive (killed): "
    msg += _describe(left)
    workeroutput = getattr(config, "workeroutput", None)  # set in an xdist worker only
    if workeroutput is not None:
        workeroutput["hygiene_leaks"] = msg
        return
    _fail_session(session, reporter, msg)


def _fail_session(session: pytest.Session, reporter: Any, msg: str) -> None:
    if reporter is not None:
        reporter.write_line(msg, red=True)
    else:  # pragma: no cover
        print(msg)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: collect what a finished worker's session guard found."""
    msg = getattr(node, "workeroutput", {}).get("hygiene_leaks")
    if msg:
        leaks = getattr(node.config, "_hygiene_worker_leaks", None)
        if leaks is None:
            leaks = node.config._hygiene_worker_leaks = []
        leaks.append(f"[{node.gateway.id}] {msg}")
