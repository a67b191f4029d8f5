"""``--framing``: how the producer frames each topic's values (docs/schemas.md, "Framings").

``parse_framings`` turns the flag's values into base topic -> framing, or raises ConfigError.
"""

from __future__ import annotations

from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe_schemas.codec import CONFLUENT, FRAMINGS

__all__ = ["FRAMINGS", "parse_framings"]


def parse_framings(items: list[str], registry: bool) -> dict[str, str]:
    """``--framing`` values (``raw``, ``samples=raw``) into base topic -> framing; ConfigError."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, framing = item.rpartition("=")
        base = topics.resolve_alias(name.strip()) if sep else None
        bases = [base] if base is not None else [] if sep else [topics.SAMPLES, topics.XID]
        if not bases or bases[0] not in (topics.SAMPLES, topics.XID) or framing not in FRAMINGS:
            raise ConfigError(
                f"--framing expects [samples=|xid=]FRAMING with FRAMING one of {', '.join(FRAMINGS)}, "
                f"got {item!r}"
            )
        if framing == CONFLUENT and not registry:
            raise ConfigError("--framing confluent needs --schema-registry-url")
        out.update(dict.fromkeys(bases, framing))
    return out
