"""The persisted kernel-log cursor: which ``/dev/kmsg`` record the agent handled last, in which boot.

Why: an XID logged while the agent was down (a restart, a crash loop, the wait for Kafka at start)
must still be reported, and one already reported must not be reported again. ``/dev/kmsg`` numbers
its records (``seq``) from 0 at every boot, so the cursor is the pair (boot id, seq): same boot ->
read the backlog after ``seq``; another boot (or no cursor) -> read this boot's whole backlog, as
node-problem-detector's kernel monitor and GPUd do.

Stored as one line ``<boot id> <seq>`` next to the XID spool, replaced atomically (temp file,
fsync, rename, directory fsync). Unreadable or garbage content means "no cursor" (read the whole
backlog: at least once rather than lose).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("gpupipe.kmsg")

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
CURSOR_FILE = "kmsg.cursor"


def read_boot_id(path: str = BOOT_ID_PATH) -> str | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return text or None


@dataclass(frozen=True)
class Cursor:
    boot_id: str
    seq: int


def parse_cursor(text: str) -> Cursor | None:
    parts = text.split()
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    return Cursor(parts[0], int(parts[1]))


class KmsgCursorStore:
    """Load and save the cursor in ``directory`` (never raises: a failure is logged once, counted)."""

    def __init__(self, directory: str | Path, boot_id: str | None) -> None:
        self.path = Path(directory) / CURSOR_FILE
        self.boot_id = boot_id
        self.saved: int | None = None
        self.errors = 0

    def start_after(self) -> int | None:
        """The seq to skip through at start: the cursor's when it is of this boot, else None (all)."""
        try:
            cur = parse_cursor(self.path.read_text())
        except OSError:
            cur = None
        if cur is None or self.boot_id is None or cur.boot_id != self.boot_id:
            return None
        self.saved = cur.seq
        return cur.seq

    def save(self, seq: int) -> None:
        if self.boot_id is None or (self.saved is not None and seq <= self.saved):
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, f"{self.boot_id} {seq}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            self.errors += 1
            if self.errors == 1:
                log.error(
                    "cannot save the kernel-log cursor (%s): a restart may report recent XIDs again", exc
                )
            return
        self.saved = seq
