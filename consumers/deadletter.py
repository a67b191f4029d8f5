"""Dead letters: bytes a service could not decode go to gpu.deadletter.v1, untouched, with the reason.

Headers follow Kafka Connect's DLQ convention under our own prefix
(`gpupipe.dlq.*`): why, which service, from which topic/partition/offset, when.
The original key, value and headers are kept so the record can be replayed
once the cause is fixed.
"""

from __future__ import annotations

import time
from typing import Any

HEADER_PREFIX = "gpupipe.dlq."


def deadletter_headers(
    msg: Any, reason: str, detail: str, service: str, now_ms: int | None = None
) -> list[tuple[str, bytes]]:
    """Original headers first, then ours (pure: `msg` only needs Kafka Message accessors)."""
    out = list(msg.headers() or [])
    ours = {
        "reason": reason,
        "detail": detail[:1000],
        "service": service,
        "topic": msg.topic() or "",
        "partition": str(msg.partition()),
        "offset": str(msg.offset()),
        "time_ms": str(now_ms if now_ms is not None else int(time.time() * 1000)),
    }
    out += [(HEADER_PREFIX + k, v.encode()) for k, v in ours.items()]
    return out
