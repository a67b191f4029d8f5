"""Consumer lag: the partition's end offset minus the consumer's position.

End offsets come from the consumer's cache (``cached=True``: what the last fetch response carried), so
no broker round trip. Callers compute it in the thread that polls the consumer and hand snapshots to
the scrape thread: a call on a consumer from another thread waits for the consumer's lock, which
back-to-back ``consume()`` calls starve (seen as /metrics answers taking 3-56 s on a loaded machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import TopicPartition

__all__ = ["lags"]


def lags(consumer: Any, positions: Mapping[tuple[str, int], int | None]) -> dict[tuple[str, int], int]:
    """Lag per ``(topic, partition)``; a partition whose position or end offset is not known yet is
    left out rather than guessed."""
    out: dict[tuple[str, int], int] = {}
    for (topic, part), pos in positions.items():
        if pos is None:
            continue
        try:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=0.5, cached=True)
        except Exception:  # a partition just revoked, a consumer closing: no figure this round
            continue
        if high >= 0:
            out[(topic, part)] = max(0, high - pos)
    return out
