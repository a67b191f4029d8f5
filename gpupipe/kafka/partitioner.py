"""Kafka's default partitioner for keyed records: :func:`murmur2` as the Java client and librdkafka's
``murmur2_random`` compute it, and :func:`key_partition`, the partition a key goes to."""

from __future__ import annotations

import struct

_M32 = 0xFFFFFFFF
_MURMUR_M = 0x5BD1E995


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of a record key (unsigned 32 bits), as the Java client's default
    partitioner and librdkafka's ``murmur2_random`` compute it."""
    length = len(data)
    h = (0x9747B28C ^ length) & _M32
    whole = length & ~3
    m = _MURMUR_M
    for (k,) in struct.iter_unpack("<I", data[:whole]):
        k = (k * m) & _M32
        k ^= k >> 24
        h = ((h * m) & _M32) ^ ((k * m) & _M32)
    rest = length & 3
    if rest == 3:
        h ^= data[whole + 2] << 16
    if rest >= 2:
        h ^= data[whole + 1] << 8
    if rest:
        h ^= data[whole]
        h = (h * m) & _M32
    h ^= h >> 13
    h = (h * m) & _M32
    h ^= h >> 15
    return h


def key_partition(key: bytes, partitions: int) -> int:
    """The partition a keyed record goes to with the murmur2 partitioner."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
