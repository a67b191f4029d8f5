"""Read one record type of a gpupipe topic up to its end as of now, without a consumer group.

The floor's :func:`gpupipe.kafka.replay.iter_messages` does the Kafka side (from the oldest retained
offset or from ``since_ms``, read_committed, never committing); this adds the contract: decoding, and
keeping only the record type asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gpupipe.kafka.replay import iter_messages
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError

#: The private, never committing group of the readers that name none (the ACL table grants it).
READ_GROUP_PREFIX = "gpupipe-read-"


def iter_topic(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    record_name: str,
    *,
    since_ms: int | None = None,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    missing_ok: bool = False,
    missing_hint: str = "check --topic-prefix and that its writer ran",
    on_bad: Callable[[str], None] | None = None,
    group_prefix: str = READ_GROUP_PREFIX,
) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, Kafka timestamp) of every committed ``record_name`` record of ``topic``, per
    partition in offset order; an undecodable record is passed to ``on_bad`` and skipped."""
    decode = codec.decode
    for msg in iter_messages(
        bootstrap,
        topic,
        since_ms=since_ms,
        extra=extra,
        timeout_s=timeout_s,
        missing_ok=missing_ok,
        missing_hint=missing_hint,
        group_prefix=group_prefix,
    ):
        try:
            d = decode(msg.value(), msg.headers())
        except DecodeError as exc:
            if on_bad:
                on_bad(
                    f"{topic}[{msg.partition()}]@{msg.offset()}: not a {record_name} record ({exc.reason})"
                )
            continue
        if d.name == record_name:
            yield d.record, msg.timestamp()[1]


def read_topic(
    bootstrap: str,
    topic: str,
    codec: AvroCodec,
    record_name: str,
    *,
    since_ms: int | None = None,
    extra: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    missing_ok: bool = False,
    on_bad: Callable[[str], None] | None = None,
    group_prefix: str = READ_GROUP_PREFIX,
) -> list[dict[str, Any]]:
    """Decoded ``record_name`` records of ``topic`` (per partition in offset order), as a list."""
    return [
        rec
        for rec, _ in iter_topic(
            bootstrap,
            topic,
            codec,
            record_name,
            since_ms=since_ms,
            extra=extra,
            timeout_s=timeout_s,
            missing_ok=missing_ok,
            on_bad=on_bad,
            group_prefix=group_prefix,
        )
    ]
