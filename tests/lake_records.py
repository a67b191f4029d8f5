"""Valid records of every lake table's type, built from the Avro schema (tests of `gpupipe lake`)."""

from __future__ import annotations

import time
from typing import Any

from gpupipe_schemas import catalog


def _value(t: Any, names: dict[str, Any]) -> Any:
    if isinstance(t, list):
        return None if "null" in t else _value(t[0], names)
    if isinstance(t, str):
        if t in names:
            return _value(names[t], names)
        return {"boolean": False, "int": 0, "long": 0, "float": 0.0, "double": 0.0, "string": "x"}[t]
    kind = t["type"]
    if kind == "record":
        names[t["name"]] = t
        return {f["name"]: f["default"] if "default" in f else _value(f["type"], names) for f in t["fields"]}
    if kind == "enum":
        names[t["name"]] = t
        return t.get("default", t["symbols"][0])
    if kind == "array":
        return []
    if kind == "map":
        return {}
    if t.get("logicalType") == "timestamp-millis":
        return int(time.time() * 1000)
    return _value(kind, names)


def fill(name: str, **over: Any) -> dict[str, Any]:
    """A record of type ``name``: defaults where the schema has them, plain values elsewhere, ``over``."""
    schema = catalog.current(name).raw
    names: dict[str, Any] = {}
    rec = _value(schema, names)
    # nested named types defined in earlier fields are referenced by name later (GpuAlert)
    rec.update(over)
    return rec


def end_pyiceberg_threads() -> None:
    """Shut pyiceberg's process-wide worker pool (it outlives each test, which the hygiene guard
    would rightly report); the next scan or write starts a new one."""
    from pyiceberg.utils.concurrent import ExecutorFactory

    pool = ExecutorFactory._instance
    if pool is not None:
        pool.shutdown(wait=True)
        ExecutorFactory._instance = None
