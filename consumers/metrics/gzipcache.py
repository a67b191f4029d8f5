"""gzip of the exposition, recompressing only the family chunks that changed (pure).

The store hands out the body as one chunk per metric family and keeps a chunk's ``bytes`` object
while none of its lines changed (counters that stay at 0, clocks, framebuffer sizes, ECC and
row-remap counts... a third of the families of a real fleet from one scrape to the next). Each
chunk is deflated on its own (a fresh compressor, ended by a sync flush: byte-aligned deflate
blocks that refer to nothing before them, so they can follow any other blocks), and those blocks
are kept with the chunk's CRC-32 and length while the chunk is the same object. An answer is then
the gzip header, the chunks' blocks, the tail's (final) blocks and the trailer, whose CRC-32 of the
whole body is combined from the chunks' CRCs (:func:`crc32_combine`): no byte of an unchanged
chunk is read again. Before, any change re-deflated the whole body (80 MB at 10k GPUs: about half
a second of a core per scrape).
"""

from __future__ import annotations

import struct
import threading
import zlib

GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime, OS unknown
_POLY = 0xEDB88320  # CRC-32 (gzip's), bit-reflected


def _mulmod(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, both bit-reflected (bit 31 is x^0)."""
    p = 0
    m = 1 << 31
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..63 (x^1 is bit 30 when reflected)."""
    out = [1 << 30]
    for _ in range(63):
        out.append(_mulmod(out[-1], out[-1]))
    return out


_X2K = _powers()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``: ``crc1`` times
    x^(8 len2) (appending len2 zero bytes to A), then plus ``crc2``."""
    if len2 <= 0:
        return crc1
    shift = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 len2) = product of x^(2^k) over the set bits of len2, from k = 3
    while n:
        if n & 1:
            shift = _mulmod(_X2K[k], shift)
        n >>= 1
        k += 1
    return _mulmod(shift, crc1) ^ crc2


def deflate(data: bytes, level: int, final: bool) -> bytes:
    """Raw deflate blocks of ``data``; not final: ended by a sync flush (byte-aligned, more may follow)."""
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


class GzipCache:
    """gzip of ``[*body, tail]`` (the store's parts: family chunks, then the tail) as one member,
    reusing each chunk's deflate blocks while it is the same object."""

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self.hits = 0  # answers that reused every chunk's blocks
        self.chunk_hits = 0  # chunks whose blocks were reused
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[bytes, bytes, int]] = {}  # id(chunk) -> (chunk, blocks, crc)

    def compress(self, parts: list[bytes]) -> list[bytes]:
        body, tail = parts[:-1], parts[-1]
        with self._lock:
            cache = self._cache
        fresh: dict[int, tuple[bytes, bytes, int]] = {}
        out = [GZIP_HEADER]
        crc = length = reused = 0
        for chunk in body:
            got = cache.get(id(chunk))
            if got is None or got[0] is not chunk:
                got = (chunk, deflate(chunk, self.level, final=False), zlib.crc32(chunk))
            else:
                reused += 1
            fresh[id(chunk)] = got
            out.append(got[1])
            crc = crc32_combine(crc, got[2], len(chunk))
            length += len(chunk)
        with self._lock:
            self._cache = fresh  # only what this answer used: the rest is gone from the store
            self.chunk_hits += reused
            if body and reused == len(body):
                self.hits += 1
        out.append(deflate(tail, self.level, final=True))
        out.append(struct.pack("<II", zlib.crc32(tail, crc), (length + len(tail)) & 0xFFFFFFFF))
        return out
