"""A bounded on-disk spool so an XID is never lost while Kafka is unreachable.

Every XID event is appended (and fsynced) here *before* it is handed to the
producer, and acknowledged when Kafka confirms delivery. Unacknowledged events
are replayed in their original order: after a delivery failure (the broker was
down longer than the message timeout) and after a restart of the producer.

Format: one file of records `seq\\tkey_b64\\tvalue_b64\\n` plus an `acked` file
holding the highest sequence number below which everything was delivered.
When everything is acknowledged the data file is truncated. The spool is
bounded by bytes; over the bound the oldest events are dropped and counted,
because an agent that fills the node's disk would do more harm than good.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

from gpupipe.errors import ConfigError

log = logging.getLogger("gpupipe.spool")


class XidSpool:
    def __init__(self, directory: str | Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create XID spool directory {self.dir}: {exc.strerror}") from exc
        self.max_bytes = max_bytes
        self.dropped = 0
        self._lock = threading.Lock()
        self._data = self.dir / "xid.spool"
        self._acked_file = self.dir / "acked"
        self._pending: OrderedDict[int, tuple[bytes, bytes, int]] = OrderedDict()  # seq -> (key, value, size)
        self._bytes = 0
        self._acked_through = self._read_acked()
        self._next = self._acked_through + 1
        self._load()
        self._fh = open(self._data, "ab")  # noqa: SIM115 (lives as long as the spool)

    def _read_acked(self) -> int:
        try:
            return int(self._acked_file.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _load(self) -> None:
        if not self._data.exists():
            return
        with open(self._data, "rb") as fh:
            for raw in fh:
                parts = raw.rstrip(b"\n").split(b"\t")
                if len(parts) != 3:
                    continue  # a torn last line after a crash: the event was never handed to Kafka
                try:
                    seq = int(parts[0])
                    key, value = base64.b64decode(parts[1]), base64.b64decode(parts[2])
                except ValueError:
                    continue
                self._next = max(self._next, seq + 1)
                if seq > self._acked_through:
                    self._pending[seq] = (key, value, len(raw))
                    self._bytes += len(raw)
        if self._pending:
            log.info(
                "xid spool has undelivered events from a previous run",
                extra={"fields": {"events": len(self)}},
            )

    def __len__(self) -> int:
        return len(self._pending)

    def append(self, key: bytes, value: bytes) -> int:
        """Durably record an event; returns its sequence number."""
        with self._lock:
            seq = self._next
            self._next += 1
            line = b"%d\t%s\t%s\n" % (seq, base64.b64encode(key), base64.b64encode(value))
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._pending[seq] = (key, value, len(line))
            self._bytes += len(line)
            while self._bytes > self.max_bytes and len(self._pending) > 1:
                old, (_, _, size) = self._pending.popitem(last=False)
                self._bytes -= size
                self.dropped += 1
                log.error("xid spool full: dropped the oldest event", extra={"fields": {"seq": old}})
            return seq

    def ack(self, seq: int) -> None:
        with self._lock:
            item = self._pending.pop(seq, None)
            if item is not None:
                self._bytes -= item[2]
            first = next(iter(self._pending), self._next)
            through = first - 1
            if through > self._acked_through:
                self._acked_through = through
                tmp = self._acked_file.with_suffix(".tmp")
                tmp.write_text(str(through))
                os.replace(tmp, self._acked_file)
            if not self._pending:
                self._fh.truncate(0)
                self._fh.seek(0)

    def pending(self) -> list[tuple[int, bytes, bytes]]:
        """Unacknowledged events, oldest first."""
        with self._lock:
            return [(seq, k, v) for seq, (k, v, _) in self._pending.items()]

    def close(self) -> None:
        self._fh.close()
