"""Lag from cached end offsets: unknown figures are left out, never guessed."""

from __future__ import annotations

from confluent_kafka import KafkaException, TopicPartition

from gpupipe.kafka.lag import lags


class _Ends:
    """A consumer's end-offset cache: -1 before the first fetch, an error once revoked."""

    def __init__(self, ends: dict[tuple[str, int], int | Exception]) -> None:
        self.ends = ends
        self.cached: list[bool] = []

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        self.cached.append(cached)
        end = self.ends[(tp.topic, tp.partition)]
        if isinstance(end, Exception):
            raise end
        return (0, end)


def test_lag_is_the_end_minus_the_position_and_unknowns_are_left_out() -> None:
    consumer = _Ends(
        {("t", 0): 10, ("t", 1): -1, ("t", 2): KafkaException("revoked"), ("t", 3): 5, ("u", 0): 7}
    )
    positions = {("t", 0): 4, ("t", 1): 3, ("t", 2): 1, ("t", 3): 9, ("u", 0): None}
    assert lags(consumer, positions) == {("t", 0): 6, ("t", 3): 0}
    assert consumer.cached and all(consumer.cached), "never a broker round trip"
