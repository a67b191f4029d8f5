"""Code generated from the Avro contract (`schemas/*.avsc`), kept in the repository and checked.

`python -m gpupipe_schemas.codegen` writes every emitter's files; `--check` writes nothing and
names each stale one (exit 1). An emitter is a module with
``outputs(schemas: list[dict]) -> dict[str, str]``: the parsed .avsc files in file-name order in,
repository-relative path -> whole file text out. List it in :data:`EMITTERS`.
"""

from __future__ import annotations

from types import ModuleType

from gpupipe_schemas.codegen import flink, spark, typed

EMITTERS: list[ModuleType] = [typed, flink, spark]
