"""gpupipe.kafka.partitioner: Kafka's own murmur2 vectors, and every partition reachable."""

from __future__ import annotations

import pytest

from gpupipe.kafka.partitioner import key_partition, murmur2

N = 12


def signed(h: int) -> int:
    return h - (1 << 32) if h >= 1 << 31 else h


@pytest.mark.parametrize(
    ("data", "expected"),
    [  # the vectors of Kafka's own murmur2 test (org.apache.kafka.common.utils.UtilsTest)
        ("21", -973932308),
        ("foobar", -790332482),
        ("a-little-bit-long-string", -985981536),
        ("a-little-bit-longer-string", -1486304829),
        ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        ("abc", 479470107),
    ],
)
def test_murmur2_matches_kafka(data: str, expected: int) -> None:
    assert signed(murmur2(data.encode())) == expected


def test_key_partition_range() -> None:
    assert {key_partition(f"GPU-{i}".encode(), N) for i in range(500)} == set(range(N))
