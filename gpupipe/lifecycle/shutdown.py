"""The shutdown budget every service shares (``--shutdown-timeout``): a stop signal starts a
countdown, and past it the process says so in one line and exits."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

DEFAULT_SHUTDOWN_S = 10.0


class ShutdownDeadline:
    """SIGTERM/SIGINT set `stop` and arm a deadline: past it, one line on stderr and exit now.

    Why: with the broker gone, librdkafka's flush/close and a transaction abort can each wait for
    their own timeouts (30 s and more), longer than Kubernetes' grace period; SIGKILL would then
    lose what a clean exit could still say. Services should finish well within the budget (the
    producer sizes its flush by :meth:`remaining`); the deadline is the backstop.
    """

    def __init__(self, stop: threading.Event, timeout_ms: int, service: str) -> None:
        self.stop = stop
        self.timeout_s = max(0.1, timeout_ms / 1000.0) if timeout_ms else DEFAULT_SHUTDOWN_S
        self.service = service
        self.signalled_at: float | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._wakeup: tuple[Any, Any] | None = None

    def install(self) -> ShutdownDeadline:
        """Handle SIGTERM/SIGINT. The countdown is also armed from a watcher thread woken through
        ``signal.set_wakeup_fd``: a Python signal handler runs only when the main thread gets back
        to Python, which a librdkafka call stuck in C (see the chargeback's commit) may never do."""
        if threading.current_thread() is not threading.main_thread():
            return self
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        import socket

        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)  # kept open for the life of the process

        def watch() -> None:
            while True:
                data = reader.recv(64)
                if not data or any(b in (signal.SIGTERM, signal.SIGINT) for b in data):
                    break
            self.begin()

        threading.Thread(target=watch, name="shutdown-watch", daemon=True).start()
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.begin()

    def begin(self) -> None:
        """Start the countdown (also for a stop that does not come from a signal)."""
        self.stop.set()
        with self._lock:
            if self._timer is not None:
                return
            self.signalled_at = time.monotonic()
            self._timer = threading.Timer(self.timeout_s, self._expired)
            self._timer.daemon = True
            self._timer.name = "shutdown-deadline"
            self._timer.start()

    def remaining(self, default_s: float | None = None) -> float:
        """Seconds left before the deadline (minus a margin to report), or `default_s` when not stopping."""
        if self.signalled_at is None:
            return self.timeout_s if default_s is None else default_s
        left = self.timeout_s - (time.monotonic() - self.signalled_at) - 2.0
        return max(0.0, left)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _expired(self) -> None:
        if os.environ.get("GPUPIPE_SHUTDOWN_TRACEBACK"):  # diagnosis: where every thread is stuck
            import faulthandler

            faulthandler.dump_traceback(all_threads=True)
        try:
            sys.stderr.write(
                f"gpupipe: error: {self.service} did not stop within {self.timeout_s:g}s of the stop "
                "signal (broker unreachable?); exiting now, unfinished work is redone on restart\n"
            )
            sys.stderr.flush()
        finally:
            os._exit(1)
