"""A table the catalog lacks: a new lake, or one whose catalog was lost? A lost one is never rewritten
silently.

Contract: :func:`judge` takes, for each table the catalog does not have, what shows it was written
before (its writer's consumer group committed offsets on its topic; its warehouse folder still holds
its metadata files) and what Kafka still holds (each partition's oldest offset). With no such trace
the table is new and is created. With one, it raises a one-line :class:`ConfigError` (exit 2)
unless ``rebuild`` is set: rebuilding rewrites the table from Kafka, and whatever Kafka's retention
already deleted is then gone from the lake, so the line (and the rebuild's log) says how much.
:func:`kafka_history` and :func:`leftover_metadata` gather the facts (I/O); :func:`judge` is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from gpupipe.common.errors import BrokerUnavailableError, ConfigError

#: Each broker request of :func:`kafka_history` (the broker answered the start-up checks just before).
LOOKUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PartitionHistory:
    """One partition of a table's topic: where the writer's group got to, and what Kafka still holds."""

    partition: int
    committed: int | None  # the group's committed offset; None when it never committed one
    low: int  # the oldest offset Kafka still holds (records before it were deleted by retention)


@dataclass(frozen=True)
class MissingTable:
    """A table the catalog does not have, with the traces of an earlier one."""

    name: str  # namespace.table
    topic: str
    group: str
    partitions: Sequence[PartitionHistory]
    leftover: str | None = None  # newest metadata file of an earlier table in the warehouse


def gone(t: MissingTable) -> str:
    """What Kafka no longer holds of the table's topic: what a rebuild cannot put back."""
    parts = [p for p in t.partitions if p.low > 0]
    if not parts:
        return f"nothing (Kafka still holds {t.topic} from offset 0)"
    return ", ".join(
        f"{t.topic}[{p.partition}] offsets 0 to {p.low - 1}"
        + ("" if p.committed is None else f" (group at {p.committed})")
        for p in parts
    )


def _traces(t: MissingTable) -> list[str]:
    out = []
    reached = [p for p in t.partitions if p.committed is not None]
    if reached:
        out.append(f"consumer group {t.group} committed offsets on {t.topic}")
    if t.leftover:
        out.append(f"the warehouse still holds its metadata, newest {t.leftover}")
    return out


def judge(missing: Sequence[MissingTable], catalog: str, *, rebuild: bool) -> list[tuple[str, str]]:
    """``(table, what Kafka no longer holds)`` for each table to rebuild; raises when one was lost
    and ``rebuild`` is not set. A table without traces is new: not listed, created as usual."""
    lost = [(t, traces) for t in missing if (traces := _traces(t))]
    if lost and not rebuild:
        t, traces = lost[0]
        more = f" (and {len(lost) - 1} more table(s))" if len(lost) > 1 else ""
        raise ConfigError(
            f"lake table {t.name} is not in catalog {catalog!r} but was written before "
            f"({'; '.join(traces)}){more}: the catalog was lost or replaced. Restore it, or pass "
            f"--rebuild-catalog to rewrite the table from what Kafka holds (lost to its retention: "
            f"{gone(t)}), or use a --group-id of its own for a new lake"
        )
    return [(t.name, gone(t)) for t, _ in lost]


# -- gathering the facts (I/O) ---------------------------------------------------------------------
def leftover_metadata(warehouse: str | None, namespace: str, table: str) -> str | None:
    """The newest ``*.metadata.json`` of an earlier ``namespace.table`` in a local warehouse, if any.

    pyiceberg puts a table at ``<warehouse>/<namespace>/<table>`` (``<namespace>.db`` before 0.9).
    An object-store warehouse is not listed: there the consumer group's offsets are the trace."""
    if not warehouse:
        return None
    url = urlparse(warehouse)
    if url.scheme not in ("", "file"):
        return None
    root = Path(unquote(url.path) if url.scheme == "file" else warehouse)
    for folder in (root / namespace / table / "metadata", root / f"{namespace}.db" / table / "metadata"):
        # 00003-<uuid>.metadata.json: by version, then by time (a table created twice has two 00000)
        files = sorted(
            folder.glob("*.metadata.json"), key=lambda f: (f.name.split("-")[0], f.stat().st_mtime)
        )
        if files:
            return str(files[-1])
    return None


def kafka_history(consumer: Any, topic: str, timeout_s: float) -> list[PartitionHistory]:
    """Each partition of ``topic``: the committed offset of ``consumer``'s group and the oldest offset.

    ``consumer``: a confluent-kafka Consumer of the writer's group that has not subscribed (it reads
    the group's offsets without joining it)."""
    from confluent_kafka import KafkaException, TopicPartition

    try:
        meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if meta is None or meta.error is not None:
            return []
        tps = [TopicPartition(topic, p) for p in sorted(meta.partitions)]
        committed = consumer.committed(tps, timeout=timeout_s)
        out = []
        for tp in committed:
            low, _ = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=timeout_s)
            out.append(PartitionHistory(tp.partition, tp.offset if tp.offset >= 0 else None, max(low, 0)))
        return out
    except KafkaException as exc:
        raise BrokerUnavailableError(
            f"cannot read the lake's consumer group offsets on {topic} (to tell a new table from a "
            f"lost catalog): {exc.args[0] if exc.args else exc}"
        ) from exc
