"""The XID spool's record format (pure: bytes in, records out).

One record::

    magic  b"XSP1"          4 bytes
    length                  u32 big-endian, bytes of the payload
    crc32                   u32 big-endian, zlib.crc32 of the payload
    payload                 seq u64 | key length u32 | key | value

Why: a crash can tear the last write, and a disk can flip bytes. With a length and a checksum a
reader knows exactly where a record ends and whether it is intact, so a torn record never swallows
the next one and a damaged record is skipped (and counted) instead of being replayed as other
bytes. After damage the scanner resynchronises on the next magic whose record checks out.

``read_legacy`` reads the previous text format (``seq\\tkey_b64\\tvalue_b64\\n`` in ``xid.spool``)
once, strictly (``validate=True``), so an upgrade keeps what was spooled.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from dataclasses import dataclass, field

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


def scan_records(data: bytes) -> Scan:
    """Every intact record of ``data`` in file order, with damage and a torn tail counted."""
    out = Scan(size=len(data))
    pos, n = 0, len(data)
    in_damage = False
    while pos < n:
        if n - pos < _HEADER.size:
            if data[pos:].startswith(MAGIC[: n - pos]) and not in_damage:
                out.torn += 1
            else:
                out.damaged += 0 if in_damage else 1
            break
        magic, length, crc = _HEADER.unpack_from(data, pos)
        if magic == MAGIC and length <= MAX_RECORD:
            end = pos + _HEADER.size + length
            if end > n:
                # Runs past the end: a torn last write, unless a good record follows (then damage).
                nxt = data.find(MAGIC, pos + 1)
                if nxt < 0:
                    out.torn += 0 if in_damage else 1
                    break
            else:
                payload = data[pos + _HEADER.size : end]
                rec = _decode_payload(payload) if zlib.crc32(payload) == crc else None
                if rec is not None:
                    out.records.append(rec)
                    pos = end
                    in_damage = False
                    continue
        if not in_damage:
            out.damaged += 1
            in_damage = True
        nxt = data.find(MAGIC, pos + 1)
        if nxt < 0:
            break
        pos = nxt
    return out


def read_legacy(data: bytes) -> tuple[list[tuple[int, bytes, bytes]], int]:
    """Records of the old text format and how many lines were damaged (strict base64)."""
    records: list[tuple[int, bytes, bytes]] = []
    bad = 0
    lines = data.split(b"\n")
    complete = lines[:-1]  # the part after the last newline is a torn write: never handed to Kafka
    for raw in complete:
        parts = raw.split(b"\t")
        try:
            if len(parts) != 3:
                raise ValueError("fields")
            seq = int(parts[0])
            key = base64.b64decode(parts[1], validate=True)
            value = base64.b64decode(parts[2], validate=True)
        except (ValueError, binascii.Error):
            bad += 1
            continue
        records.append((seq, key, value))
    return records, bad
