"""The engine table definitions under docs/reference/engines/ are the contract's, regenerated."""

from __future__ import annotations

import json

import pytest
from pyspark.sql.types import StructType

from gpupipe_schemas.codegen import flink, spark
from tests.paths import REPO

SCHEMAS = [json.loads(p.read_text()) for p in sorted((REPO / "schemas").glob("*.avsc"))]


@pytest.mark.parametrize("emitter", [flink, spark], ids=["flink", "spark"])
def test_committed_engine_definitions_are_current(emitter: object) -> None:
    want = emitter.outputs(SCHEMAS)  # type: ignore[attr-defined]
    assert len(want) == len(SCHEMAS)
    for path, text in want.items():
        assert (REPO / path).read_text() == text, f"{path} is stale: regenerate it"
    out_dir = REPO / emitter.OUT_DIR  # type: ignore[attr-defined]
    assert {str(p.relative_to(REPO)) for p in out_dir.iterdir()} == set(want), "a file no schema makes"


def test_flink_columns_mirror_the_writer_schema() -> None:
    sample = next(s for s in SCHEMAS if s["name"] == "GpuSample")
    text = flink.outputs(SCHEMAS)["docs/reference/engines/flink/GpuSample.sql"]
    body = text.split("CREATE TABLE `gpu_sample` (\n")[1].split("\n) WITH")[0].splitlines()
    assert [c.split("`")[1] for c in body] == [f["name"] for f in sample["fields"]] + ["kafka_headers"]
    assert "`timestamp_ms` TIMESTAMP(3) NOT NULL" in text and "'format' = 'avro'" in text
    assert "'topic' = 'gpu.samples.v1'" in text


def test_spark_schema_is_what_spark_reads() -> None:
    for s in SCHEMAS:
        doc = json.loads(spark.outputs([s])[f"docs/reference/engines/spark/{s['name']}.json"])
        st = StructType.fromJson(doc)  # Spark's own parser, no JVM
        assert st.fieldNames() == [f["name"] for f in s["fields"]]
