"""gpupipe.lifecycle.shutdown: the deadline's budget, and one line and an exit past it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from gpupipe.lifecycle import shutdown


def test_shutdown_deadline_remaining_and_cancel() -> None:
    stop = threading.Event()
    d = shutdown.ShutdownDeadline(stop, 5000, "test")
    assert d.remaining(default_s=30.0) == 30.0
    d.begin()
    try:
        assert stop.is_set()
        assert 2.5 < d.remaining() <= 3.0
    finally:
        d.cancel()


def test_shutdown_deadline_exits_with_one_line() -> None:
    code = (
        "import threading, time\n"
        "from gpupipe.lifecycle import shutdown\n"
        "stop = threading.Event()\n"
        "shutdown.ShutdownDeadline(stop, 300, 'stuck').install().begin()\n"
        "time.sleep(30)\n"
    )
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert time.monotonic() - began < 10
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0
    assert "stuck did not stop within 0.3s" in out.stderr
