"""A bounded on-disk spool so an XID is never lost while Kafka is unreachable.

:class:`XidSpool`: append (fsynced) before the hand-over, ack on delivery, replay the rest in order
after a failure or a restart. Bounded by ``max_bytes`` on disk and in memory; a directory it cannot
write keeps events in memory and never stops the agent. Format, bounds, memory: docs/producer.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from gpupipe_producer.xid.spool_format import (
    LEGACY_FILE,
    MAX_RECORD,
    SPOOL_FILE,
    Scanner,
    encode_record,
    iter_legacy,
    record_size,
)

log = logging.getLogger("gpupipe.spool")

#: The default bound. Why this size: the DaemonSet's memory limit is 160 MiB and the agent runs at
#: about 60 MB without a spool; pending events cost about 1.5 times their bytes in memory (Python
#: objects), so 16 MiB of spool stays well inside the limit, and holds some 35,000 XIDs (days of a
#: storm-prone node's output while Kafka is down).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
#: Bytes written at a time when the file is rewritten (compaction).
_WRITE_CHUNK = 1024 * 1024

#: After dropping for the bound, pending bytes are at most this fraction of it (hysteresis).
_LOW_WATER = 7 / 8


class XidSpool:
    """Durable, ordered, bounded store of unacknowledged XID events (thread-safe)."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.retry_s = retry_s
        self._clock = clock
        #: Oldest events dropped for the bound (in memory, on disk and at load).
        self.dropped = 0
        #: Damaged records skipped at load (bad checksum, garbage between records).
        self.damaged = 0
        #: Incomplete last records found at load (a write torn by a crash); they were never sent.
        self.torn = 0
        #: Failed disk operations (create, open, write, fsync, compaction).
        self.write_errors = 0
        self._lock = threading.Lock()
        self._data = self.dir / SPOOL_FILE
        self._acked_file = self.dir / "acked"
        self._pending: OrderedDict[int, tuple[bytes, bytes, int]] = OrderedDict()  # seq -> (key, value, size)
        self._bytes = 0
        self._file_bytes = 0
        self._fd = -1
        self._retry_at = 0.0
        self._legacy_to_remove: Path | None = None
        self._acked_through = 0
        self._acked_saved = 0  # the mark as last written to ``acked``
        self._next = 1
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._acked_through = self._acked_saved = self._read_acked()
            self._next = self._acked_through + 1
            needs_rewrite = self._load()
            if needs_rewrite:
                self._compact_locked()
            else:
                self._open_append()
        except OSError as exc:
            self._degrade("cannot use the XID spool directory", exc)

    # -- public -----------------------------------------------------------------------------------
    @property
    def on_disk(self) -> bool:
        """False while events are kept in memory only (directory unusable, disk full)."""
        return self._fd >= 0

    @property
    def file_bytes(self) -> int:
        return self._file_bytes

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._pending)

    def append(self, key: bytes, value: bytes) -> int:
        """Record an event (durably when the disk allows); returns its sequence number. Never raises."""
        return self.append_many([(key, value)])[0]

    def append_many(self, items: list[tuple[bytes, bytes]]) -> list[int]:
        """Record several events with one write and one fsync; their sequence numbers, in order.

        Why: in an XID storm the main loop releases thousands of events at once, and an fsync each
        (about 0.2 ms) made the storm's cost grow with its size.
        """
        with self._lock:
            seqs: list[int] = []
            recs: list[bytes] = []
            for key, value in items:
                seq = self._next
                self._next += 1
                rec = encode_record(seq, key, value)
                size = len(rec)
                if self._bytes + size > self.max_bytes:
                    self._drop_oldest(int(self.max_bytes * _LOW_WATER) - size)
                self._pending[seq] = (key, value, size)
                self._bytes += size
                seqs.append(seq)
                recs.append(rec)
            if not recs:
                return seqs
            blob = b"".join(recs) if len(recs) > 1 else recs[0]
            if self._fd < 0:
                if self._clock() >= self._retry_at:
                    self._compact_locked()  # back on disk with everything pending, or still degraded
                return seqs
            if self._file_bytes + len(blob) > self.max_bytes or any(q not in self._pending for q in seqs):
                self._compact_locked()  # rewrites the pending set (this batch's kept records included)
                return seqs
            try:
                view = memoryview(blob)
                while view:
                    view = view[os.write(self._fd, view) :]
                os.fsync(self._fd)
                self._file_bytes += len(blob)
            except OSError as exc:
                self._undo_partial_write()
                self._degrade("XID spool write failed; keeping events in memory", exc)
            return seqs

    def ack(self, seq: int) -> None:
        """Forget a delivered event. The ``acked`` mark is persisted by :meth:`sync_acked` (or at
        once when nothing is left pending: the file is then emptied, and the mark must not lag
        behind an empty file, or sequence numbers would be reused after a crash)."""
        with self._lock:
            item = self._pending.pop(seq, None)
            if item is not None:
                self._bytes -= item[2]
            first = next(iter(self._pending), self._next)
            through = first - 1
            if through > self._acked_through:
                self._acked_through = through
            if not self._pending and self._fd >= 0:
                self._sync_acked_locked()
                try:
                    os.ftruncate(self._fd, 0)
                    self._file_bytes = 0
                except OSError as exc:
                    self._degrade("cannot truncate the XID spool", exc)

    def sync_acked(self) -> None:
        """Persist the acknowledged mark if it moved since the last call (one write, two fsyncs)."""
        with self._lock:
            self._sync_acked_locked()

    def _sync_acked_locked(self) -> None:
        through = self._acked_through
        if through <= self._acked_saved or self._fd < 0:
            return
        try:
            self._write_acked(through)
            self._acked_saved = through
        except OSError as exc:
            self._degrade("cannot persist the XID spool's acknowledged mark", exc)

    def pending(self) -> list[tuple[int, bytes, bytes]]:
        """Unacknowledged events, oldest first."""
        with self._lock:
            return [(seq, k, v) for seq, (k, v, _) in self._pending.items()]

    def get(self, seq: int) -> tuple[bytes, bytes] | None:
        """The key and value of a pending event; None once it is acknowledged or dropped."""
        with self._lock:
            item = self._pending.get(seq)
            return None if item is None else (item[0], item[1])

    def pending_from(self, seq: int, limit: int) -> tuple[list[tuple[int, bytes, bytes]], int]:
        """Up to ``limit`` pending events with a sequence number of ``seq`` or more, in sequence
        order, and the number to continue from. Lets a sender replay a large spool in bounded
        chunks instead of copying all of it at once."""
        with self._lock:
            out: list[tuple[int, bytes, bytes]] = []
            s = max(seq, self._acked_through + 1)
            end = self._next
            pending = self._pending
            while s < end and len(out) < limit:
                item = pending.get(s)
                if item is not None:
                    out.append((s, item[0], item[1]))
                s += 1
            return out, s

    def close(self) -> None:
        with self._lock:
            self._sync_acked_locked()
            self._close_fd()

    # -- load -------------------------------------------------------------------------------------
    def _read_acked(self) -> int:
        try:
            return int(self._acked_file.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _load(self) -> bool:
        """Load pending events; True when the file must be rewritten (damage, torn tail, bound, legacy).

        Streamed: records are read through a bounded window and the bound is applied while
        loading, so memory stays near the bound whatever the file's size.
        """
        rewrite = False
        dropped_before = self.dropped
        legacy = self.dir / LEGACY_FILE
        if legacy.exists():
            bad = [0]
            with legacy.open("rb") as fh:
                for rec in iter_legacy(fh, bad):
                    self._load_one(*rec)
            self.damaged += bad[0]
            rewrite = True
        if self._data.exists():
            fd = os.open(self._data, os.O_RDONLY | os.O_CLOEXEC)
            try:
                scan = Scanner.of_fd(fd, max_record=min(MAX_RECORD, self.max_bytes))
                for rec in scan:
                    self._load_one(*rec)
            finally:
                os.close(fd)
            self.damaged += scan.damaged
            self.torn += scan.torn
            self._file_bytes = scan.size
            rewrite = rewrite or scan.damaged > 0 or scan.torn > 0
        if self.dropped > dropped_before or self._bytes > self.max_bytes:
            self._drop_oldest(int(self.max_bytes * _LOW_WATER), quiet=True)
            rewrite = True
            log.error(
                "xid spool over its bound at load: dropped the oldest events",
                extra={"fields": {"dropped": self.dropped - dropped_before, "max_bytes": self.max_bytes}},
            )
        if self._file_bytes > self.max_bytes:
            rewrite = True
        if self.damaged or self.torn:
            log.error(
                "xid spool had damaged or incomplete records; skipped them",
                extra={"fields": {"damaged": self.damaged, "torn": self.torn, "dir": str(self.dir)}},
            )
        if self._pending:
            log.info(
                "xid spool has undelivered events from a previous run",
                extra={"fields": {"events": len(self._pending)}},
            )
        if rewrite and legacy.exists():
            self._legacy_to_remove = legacy
        return rewrite

    def _load_one(self, seq: int, key: bytes, value: bytes) -> None:
        self._next = max(self._next, seq + 1)
        if seq > self._acked_through and seq not in self._pending:
            size = record_size(key, value)
            self._pending[seq] = (key, value, size)
            self._bytes += size
            if self._bytes > self.max_bytes:
                self._drop_oldest(int(self.max_bytes * _LOW_WATER), quiet=True)

    # -- disk -------------------------------------------------------------------------------------
    def _open_append(self) -> None:
        created = not self._data.exists()
        self._fd = os.open(self._data, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._file_bytes = os.fstat(self._fd).st_size
        if created:
            self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_acked(self, through: int) -> None:
        tmp = self._acked_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, str(through).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self._acked_file)
        self._fsync_dir()

    def _compact_locked(self) -> None:
        """Rewrite the file with exactly the pending events (tmp + fsync + rename + dir fsync)."""
        self._close_fd()
        tmp = self._data.with_name(SPOOL_FILE + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                parts: list[bytes] = []
                size = 0
                for s, (k, v, n) in self._pending.items():
                    parts.append(encode_record(s, k, v))
                    size += n
                    if size >= _WRITE_CHUNK:
                        _write_all(fd, b"".join(parts))
                        parts, size = [], 0
                if parts:
                    _write_all(fd, b"".join(parts))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._data)
            self._fsync_dir()
            legacy = self._legacy_to_remove
            if legacy is not None:
                legacy.unlink(missing_ok=True)
                self._legacy_to_remove = None
            self._open_append()
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._degrade("XID spool rewrite failed; keeping events in memory", exc)
            return
        if self.write_errors:
            log.warning(
                "xid spool is on disk again",
                extra={"fields": {"dir": str(self.dir), "events": len(self._pending)}},
            )

    def _undo_partial_write(self) -> None:
        # If this fails too, the checksum makes the partial record a counted, skipped one at load.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._file_bytes)

    def _degrade(self, what: str, exc: OSError) -> None:
        first = self.write_errors == 0 or self._fd >= 0
        self.write_errors += 1
        self._close_fd()
        self._retry_at = self._clock() + self.retry_s
        if first:
            log.error(
                "%s (%s); XIDs are kept in memory (bounded) and the disk is retried every %.0fs",
                what,
                exc,
                self.retry_s,
                extra={"fields": {"dir": str(self.dir), "errno": exc.errno}},
            )

    def _close_fd(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def _drop_oldest(self, target: int, *, quiet: bool = False) -> None:
        """Drop the oldest events down to ``target`` bytes; a line each unless ``quiet`` (a load
        says how many in one line)."""
        while self._bytes > max(target, 0) and self._pending:
            old, (_, _, size) = self._pending.popitem(last=False)
            self._bytes -= size
            self.dropped += 1
            if not quiet:
                log.error("xid spool full: dropped the oldest event", extra={"fields": {"seq": old}})


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view) :]
