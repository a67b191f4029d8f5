"""Field groups: fields of one record that share a ``gpupipe.*`` attribute value in the schema.

Avro keeps a field's unknown attributes and ignores them (the fingerprint, taken over the
canonical form, does not change). gpupipe uses a few to say what the code does with a field, so
the lists that code needs are read from the schema instead of restated by hand. A value is a
string or a list of strings; an attribute not listed in :data:`ATTRIBUTES` is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

PREFIX = "gpupipe."

#: Each attribute and what its values mean (docs/schemas.md shows this table).
ATTRIBUTES: dict[str, str] = {
    "gpupipe.collector": "the node agent's NVML field group that reads the field (`fast`: every tick).",
    "gpupipe.bound": (
        "what a consumer accepts beyond the Avro type, else the record is dead-lettered: `ratio` within "
        "[0, 1]; `power` within [0, 10 kW] and at most 3x the power limit; `temperature` within "
        "[-60, 250] C; `finite` finite and within 1e15; `non_negative` at least 0."
    ),
    "gpupipe.mig": (
        "`own`: a MIG slice's own reading (utilisation, framebuffer, profiling); the metrics consumer "
        "never fills it from the parent GPU's record, unlike the device-wide readings."
    ),
}


def records(node: Any) -> Iterator[dict[str, Any]]:
    """Every record schema defined in ``node``, nested ones first (a type before its users)."""
    if isinstance(node, list):
        for x in node:
            yield from records(x)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind == "record":
            for f in node["fields"]:
                yield from records(f["type"])
            yield node
        elif kind == "array":
            yield from records(node["items"])
        elif kind == "map":
            yield from records(node["values"])


def constant_name(*words: str) -> str:
    """``("GpuSample", "bound", "ratio")`` -> ``GPU_SAMPLE_BOUND_RATIO``."""
    snake = [re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", w) for w in words]
    return re.sub(r"[^A-Za-z0-9]+", "_", "_".join(snake)).upper()


def field_groups(record: dict[str, Any]) -> dict[tuple[str, str], tuple[str, ...]]:
    """``(attribute, value)`` -> the record's fields carrying it, in schema order."""
    out: dict[tuple[str, str], list[str]] = {}
    for f in record["fields"]:
        for key, value in f.items():
            if not key.startswith(PREFIX):
                continue
            if key not in ATTRIBUTES:
                raise ValueError(f"{record['name']}.{f['name']}: unknown attribute {key!r}")
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"{record['name']}.{f['name']}: {key} must be a string or a list of strings")
            for v in values:
                out.setdefault((key, v), []).append(f["name"])
    return {k: tuple(v) for k, v in sorted(out.items())}


def group_name(record: str, key: str, value: str) -> str:
    """The generated constant of one group: ``GPU_SAMPLE_BOUND_RATIO``."""
    return constant_name(record, key.removeprefix(PREFIX), value)
