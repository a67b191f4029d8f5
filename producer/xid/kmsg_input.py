"""The node agent's kernel-log input: a thread that reads XIDs from the kernel log, after a cursor.

:class:`KmsgInput` puts ``("kmsg", monotonic arrival, wall ms, event, seq)`` items; an input it cannot
open is one log line and a metric, retried, never a crash. Details: docs/producer.md.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpupipe_producer.xid.kmsg_parse import KmsgParser, parse_line
from gpupipe_producer.xid.kmsg_reader import KmsgReader, decode_kmsg_record

log = logging.getLogger("gpupipe.agent")

RETRY_S = 10.0

Put = Callable[[tuple[str, float, int, Any, int | None]], None]


def boot_wall_ms() -> float:
    """Wall-clock milliseconds at boot (kernel log times are CLOCK_MONOTONIC-like, from boot)."""
    return (time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)) * 1000.0


class KmsgInput:
    """Reads ``path`` on its own thread until ``stop`` is set; see the module docstring."""

    def __init__(
        self,
        path: str,
        put: Put,
        stop: threading.Event,
        *,
        after_seq: int | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.path = path
        self._put = put
        self._stop = stop
        self._after_seq = after_seq
        self.retry_s = retry_s
        self.reader: KmsgReader | None = None
        self.ready = threading.Event()  # set once a reader is positioned and reading
        self.malformed = 0
        #: Failed opens/reads by reason (errno name): exported as input_errors{input="kmsg"}.
        self.errors: Counter[str] = Counter()
        #: monotonic time of the last pass of the read loop (health: the reader is not stuck).
        self.heartbeat = time.monotonic()
        self.reading = False
        self._boot_wall_ms = boot_wall_ms()
        self._logged_reason: str | None = None
        self._held_seq: int | None = None  # kmsg seq of the Xid the parser holds (the reading thread's)

    def run(self) -> None:
        stop = self._stop
        while not stop.is_set():
            reader = KmsgReader(
                self.path,
                follow=True,
                from_start=self._backlog(),
                idle_ticks=True,
                stop_event=stop,
                after_seq=self._after_seq,
            )
            self.reader = reader
            try:
                self._read(reader)
            except OSError as exc:
                self.reading = False
                reason = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                self.errors[reason] += 1
                if self._logged_reason != reason:  # one line per new reason, not one per retry
                    self._logged_reason = reason
                    log.error(
                        "kernel log %s unreadable (%s); XIDs come from NVML events only until it is "
                        "(retrying every %ds quietly; see gpupipe_producer_input_errors_total)",
                        self.path,
                        exc,
                        self.retry_s,
                    )
            else:
                if self.path == "-":
                    return  # stdin ended
            if reader.last_seq is not None:
                self._after_seq = max(self._after_seq or -1, reader.last_seq)
            self.heartbeat = time.monotonic()
            if stop.wait(self.retry_s):
                return

    def _positioned(self) -> None:
        """The reader has read what was there and reads on: the input works."""
        self.heartbeat = time.monotonic()
        if not self.reading or not self.ready.is_set():
            self.reading = True
            self._logged_reason = None
            self.ready.set()

    def stalled_for(self, now: float) -> float:
        """Seconds the reader has been busy without getting round its loop; 0 while it waits for
        input (it blocks without a timeout when the kernel log is quiet: idle, not stuck)."""
        r = self.reader
        if r is not None and r.waiting:
            return 0.0
        return max(0.0, now - self.heartbeat)

    def _backlog(self) -> bool:
        """Read what is already there? Yes for kmsg records (the cursor skips what was handled);
        for a plain-text log file no (it has no sequence numbers: start at its end, as before)."""
        try:
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                return True
            with open(self.path, "rb") as fh:
                first = fh.readline(4096)
        except OSError:
            return True
        return not first or decode_kmsg_record(first) is not None

    def _read(self, reader: KmsgReader) -> None:
        parser = KmsgParser(driver_loads=True)  # the driver's load line is recovery evidence
        put = self._put
        # Idle ticks (to flush an Xid held for continuation lines) only while one is held: an idle
        # node never wakes this thread.
        reader.tick_needed = lambda: parser.pending is not None
        reader.on_wait = self._positioned
        try:
            self._feed(reader, parser)
        finally:
            # Also when a read fails while the parser holds an Xid (waiting for continuation
            # lines): run() then moves the cursor past its record, so the rebuilt reader skips it
            # and, once a later record is spooled, the persisted cursor passes it for good.
            seq = self._held_seq
            for ev in parser.flush():
                put(("kmsg", time.monotonic(), self._wall_ms(ev, seq, reader), ev, seq))

    def _feed(self, reader: KmsgReader, parser: KmsgParser) -> None:
        """Feed every line to ``parser`` and put its events (``_held_seq``: the held Xid's seq)."""
        feed, put = parser.feed, self._put
        self._held_seq = None
        for line in reader:
            self.heartbeat = time.monotonic()
            if not self.ready.is_set() or not self.reading:
                self._positioned()
            held = parser.pending
            events = feed(line)
            if "Xid (" in line and parse_line(line) is None:
                self.malformed += 1
                log.debug("kernel-log line looks like an Xid report but does not parse: %r", line[:300])
            seq = reader.line_seq if line else None
            if events:
                at = time.monotonic()
                for ev in events:
                    ev_seq = self._held_seq if ev is held else seq
                    put(("kmsg", at, self._wall_ms(ev, ev_seq, reader), ev, ev_seq))
            if parser.pending is not None and parser.pending is not held:
                self._held_seq = seq

    def _wall_ms(self, ev: Any, seq: int | None, reader: KmsgReader) -> int:
        kt = getattr(ev, "kernel_time_s", None)
        if seq is not None and kt is not None:
            return int(self._boot_wall_ms + kt * 1000.0)
        return int(time.time() * 1000)
