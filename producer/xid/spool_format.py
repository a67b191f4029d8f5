"""The XID spool's record format (pure: bytes in, records out).

Length-prefixed records with a CRC32 (:func:`encode_record`, :class:`Scanner`): a torn record loses
only itself, a damaged one is skipped and counted. ``read_legacy`` reads the old text spool once.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

SPOOL_FILE = "xid-v2.spool"
LEGACY_FILE = "xid.spool"
MAGIC = b"XSP1"
_HEADER = struct.Struct(">4sII")
_PAYLOAD_HEAD = struct.Struct(">QI")
#: A record larger than this is not a record (XidEvents are a few hundred bytes).
MAX_RECORD = 16 * 1024 * 1024


def encode_record(seq: int, key: bytes, value: bytes) -> bytes:
    payload = _PAYLOAD_HEAD.pack(seq, len(key)) + key + value
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


@dataclass
class Scan:
    records: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    #: Damaged regions skipped (bad checksum, bad header, garbage between records).
    damaged: int = 0
    #: 1 when the file ends in an incomplete record (a torn write).
    torn: int = 0
    size: int = 0


def _decode_payload(payload: bytes) -> tuple[int, bytes, bytes] | None:
    if len(payload) < _PAYLOAD_HEAD.size:
        return None
    seq, klen = _PAYLOAD_HEAD.unpack_from(payload)
    if _PAYLOAD_HEAD.size + klen > len(payload):
        return None
    k0 = _PAYLOAD_HEAD.size
    return seq, payload[k0 : k0 + klen], payload[k0 + klen :]


def record_size(key: bytes, value: bytes) -> int:
    """Bytes :func:`encode_record` takes for this event (without building it)."""
    return _HEADER.size + _PAYLOAD_HEAD.size + len(key) + len(value)


#: Bytes read from the file at a time while scanning it.
READ_CHUNK = 1024 * 1024

ReadAt = Callable[[int, int], bytes]


class _Window:
    """A file's bytes seen through one bounded buffer (``read_at(offset, n)``), so scanning a file
    of any size holds at most ``chunk`` bytes (or one record, when that is longer) at a time."""

    def __init__(self, read_at: ReadAt, size: int, chunk: int = READ_CHUNK) -> None:
        self._read_at = read_at
        self.size = size
        self._chunk = chunk
        self._base = 0
        self._buf = b""

    def get(self, pos: int, n: int) -> bytes:
        """``data[pos:pos + n]``: shorter only at the end of the file."""
        end = self._base + len(self._buf)
        if not (self._base <= pos and (pos + n <= end or end >= self.size)):
            self._buf = self._read_at(pos, max(n, self._chunk))
            self._base = pos
        off = pos - self._base
        return self._buf[off : off + n]

    def find(self, needle: bytes, start: int) -> int:
        """Offset of the next ``needle`` at or after ``start``, or -1."""
        pos = start
        while pos < self.size:
            block = self.get(pos, self._chunk)
            i = block.find(needle)
            if i >= 0:
                return pos + i
            if pos + len(block) >= self.size:
                return -1
            pos += max(1, len(block) - (len(needle) - 1))
        return -1


class Scanner:
    """Every intact record of a file in file order, read through a bounded window; damage and a
    torn tail are counted in :attr:`damaged` and :attr:`torn` once the iteration has ended.

    Why a stream: a spool at its bound must not need its whole file (and a list of every record)
    in memory at once to be loaded; the agent's memory limit is a small multiple of the bound.
    ``max_record``: a length above it is damage, not a record (no reader buffers more).
    """

    def __init__(self, read_at: ReadAt, size: int, *, chunk: int = READ_CHUNK, max_record: int = MAX_RECORD):
        self._win = _Window(read_at, size, chunk)
        self.size = size
        self.max_record = max_record
        self.damaged = 0
        self.torn = 0

    @classmethod
    def of_fd(cls, fd: int, **kw: Any) -> Scanner:
        return cls(lambda pos, n: os.pread(fd, n, pos), os.fstat(fd).st_size, **kw)

    def __iter__(self) -> Iterator[tuple[int, bytes, bytes]]:
        win, n = self._win, self.size
        pos = 0
        in_damage = False
        while pos < n:
            if n - pos < _HEADER.size:
                if win.get(pos, n - pos).startswith(MAGIC[: n - pos]) and not in_damage:
                    self.torn += 1
                else:
                    self.damaged += 0 if in_damage else 1
                break
            magic, length, crc = _HEADER.unpack(win.get(pos, _HEADER.size))
            if magic == MAGIC and length <= self.max_record:
                end = pos + _HEADER.size + length
                if end > n:
                    # Runs past the end: a torn last write, unless a good record follows (then damage).
                    if win.find(MAGIC, pos + 1) < 0:
                        self.torn += 0 if in_damage else 1
                        break
                else:
                    payload = win.get(pos + _HEADER.size, length)
                    rec = _decode_payload(payload) if zlib.crc32(payload) == crc else None
                    if rec is not None:
                        yield rec
                        pos = end
                        in_damage = False
                        continue
            if not in_damage:
                self.damaged += 1
                in_damage = True
            nxt = win.find(MAGIC, pos + 1)
            if nxt < 0:
                break
            pos = nxt


def scan_records(data: bytes) -> Scan:
    """Every intact record of ``data`` in file order, with damage and a torn tail counted."""
    view = memoryview(data)
    scanner = Scanner(lambda pos, k: bytes(view[pos : pos + k]), len(data))
    out = Scan(size=len(data))
    out.records = list(scanner)
    out.damaged, out.torn = scanner.damaged, scanner.torn
    return out


def iter_legacy(lines: Iterable[bytes], bad: list[int]) -> Iterator[tuple[int, bytes, bytes]]:
    """Records of the old text format, one line at a time; damaged lines are counted in ``bad[0]``.

    A last line without its newline is a torn write: never handed to Kafka.
    """
    for line in lines:
        if not line.endswith(b"\n"):
            break
        rec = _legacy_line(line[:-1])
        if rec is None:
            bad[0] += 1
        else:
            yield rec


def _legacy_line(raw: bytes) -> tuple[int, bytes, bytes] | None:
    parts = raw.split(b"\t")
    try:
        if len(parts) != 3:
            raise ValueError("fields")
        return (
            int(parts[0]),
            base64.b64decode(parts[1], validate=True),
            base64.b64decode(parts[2], validate=True),
        )
    except (ValueError, binascii.Error):
        return None


def read_legacy(data: bytes) -> tuple[list[tuple[int, bytes, bytes]], int]:
    """Records of the old text format and how many lines were damaged (strict base64)."""
    bad = [0]
    records = list(iter_legacy((line + b"\n" for line in data.split(b"\n")[:-1]), bad))
    return records, bad[0]
