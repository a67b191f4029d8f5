"""How many copies of each topic the services create: replication factor and ``min.insync.replicas``.

``--topic-replication`` (every service that creates topics) sets both; its default, ``auto``, asks
the cluster: 3 and 2 where it has three or more brokers alive, so that with every producer on
``acks=all`` a write survives one broker lost, else 1 and 1 (a development broker). The CLI calls
:func:`configure` once; :func:`gpupipe.kafka.admin.ensure_topics` asks :func:`for_cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupipe.common.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Replication:
    factor: int
    min_insync: int


AUTO = "auto"
#: What a cluster of three or more brokers gets: a write needs two copies, one broker may be lost.
CLUSTER = Replication(factor=3, min_insync=2)
#: What a smaller cluster gets (fewer live brokers than CLUSTER's factor could not take the topic).
SMALL = Replication(factor=1, min_insync=1)

_chosen: Replication | None = None


def parse(text: str) -> Replication | None:
    """``auto`` -> None; ``RF`` or ``RF:MIN_ISR`` (``3`` means ``3:2``; ``MIN_ISR`` defaults to
    ``RF - 1``, at least 1, at most 2)."""
    text = text.strip().lower()
    if text == AUTO:
        return None
    rf_text, sep, isr_text = text.partition(":")
    try:
        factor = int(rf_text)
        min_insync = int(isr_text) if sep else max(1, min(2, factor - 1))
    except ValueError:
        raise ConfigError(f"--topic-replication expects auto, RF or RF:MIN_ISR (3:2), got {text!r}") from None
    if factor < 1 or not 1 <= min_insync <= factor:
        raise ConfigError(f"--topic-replication {text!r}: need RF >= 1 and 1 <= MIN_ISR <= RF")
    return Replication(factor, min_insync)


def configure(text: str) -> None:
    """Set this process' choice from ``--topic-replication`` (raises ConfigError on a bad value)."""
    global _chosen
    _chosen = parse(text)


def for_cluster(brokers: int, chosen: Replication | None = None) -> Replication:
    """The replication of a topic created now on a cluster with ``brokers`` brokers alive."""
    chosen = chosen or _chosen
    if chosen is not None:
        return chosen
    return CLUSTER if brokers >= CLUSTER.factor else SMALL
