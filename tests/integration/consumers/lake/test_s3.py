"""The production path against a real local S3 server (moto in server mode): `gpupipe lake write`
keeps its data files in an S3 bucket with the credentials from a properties file, `gpupipe lake
query` reads them back with the credentials from the environment, and a secret on argv is refused."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from gpupipe.kafka.admin import ensure_topics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests import hygiene
from tests.integration.kafka_util import GPUPIPE, REPO, gpupipe
from tests.lake_records import end_pyiceberg_threads
from tests.lake_s3 import BUCKET, S3Store, moto_server, object_keys

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Store]:
    with moto_server(tmp_path) as store:
        yield store


def test_secret_catalog_property_on_argv_is_refused() -> None:
    out = gpupipe("lake", "query", "SELECT 1", "--catalog-property", "s3.secret-access-key=s3cr3t")
    assert out.returncode == 2
    assert "visible to every user" in out.stderr and "--catalog-properties-file" in out.stderr
    out = gpupipe("lake", "query", "SELECT 1", "--catalog-uri", "postgresql://lake:pw@db/lake")
    assert out.returncode == 2 and "with a password" in out.stderr


def test_write_to_s3_and_query_with_credentials_from_file_and_environment(
    kafka: str, topic_prefix: str, tmp_path: Path, s3: S3Store
) -> None:
    ensure_topics(kafka, ["gpu.samples.v1", "gpu.deadletter.v1"], prefix=topic_prefix)
    codec, fleet = AvroCodec(), SimulatedFleet(FleetConfig(nodes=2, gpus_per_node=4))
    enc = codec.encoder("GpuSample")
    p = Producer({"bootstrap.servers": kafka, "enable.idempotence": True})
    t0 = int(time.time() * 1000) // 1000 * 1000 - 600_000
    for i in range(30):
        for s in fleet.tick(t0 + i * 1000)[0]:
            p.produce(topic_prefix + "gpu.samples.v1", enc.encode(s), s["uuid"].encode())
    assert p.flush(30) == 0
    want = 30 * 8

    common = {"s3.endpoint": s3.url, "s3.region": "us-east-1"}
    props = tmp_path / "lake-catalog.yaml"
    props.write_text(
        "".join(
            f"{k}: {v}\n"
            for k, v in {
                "type": "sql",
                "uri": f"sqlite:///{tmp_path}/catalog.db",
                "warehouse": f"s3://{BUCKET}/wh",
                **common,
                "s3.access-key-id": s3.key_id,
                "s3.secret-access-key": s3.secret,
            }.items()
        )
    )
    log = open(tmp_path / "lake.log", "w")  # noqa: SIM115 (owned by the process' lifetime)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = hygiene.popen(
        [
            *GPUPIPE,
            "lake",
            "write",
            "--bootstrap-servers",
            kafka,
            "--topic-prefix",
            topic_prefix,
            "--tables",
            "samples",
            "--no-create-topics",
            "--catalog-properties-file",
            str(props),
            "--flush-interval",
            "300ms",
            "--log-format",
            "text",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=env,
    )
    try:
        assert s3.secret not in " ".join(proc.args)
        # The reader: credentials from pyiceberg's environment convention only.
        read_env = {
            **env,
            "PYICEBERG_CATALOG__GPUPIPE__TYPE": "sql",
            "PYICEBERG_CATALOG__GPUPIPE__URI": f"sqlite:///{tmp_path}/catalog.db",
            "PYICEBERG_CATALOG__GPUPIPE__WAREHOUSE": f"s3://{BUCKET}/wh",
            "PYICEBERG_CATALOG__GPUPIPE__S3__ENDPOINT": s3.url,
            "PYICEBERG_CATALOG__GPUPIPE__S3__REGION": "us-east-1",
            "PYICEBERG_CATALOG__GPUPIPE__S3__ACCESS_KEY_ID": s3.key_id,
            "PYICEBERG_CATALOG__GPUPIPE__S3__SECRET_ACCESS_KEY": s3.secret,
        }
        deadline, got = time.monotonic() + 120, -1
        while got < want:
            assert proc.poll() is None, (tmp_path / "lake.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"{got} rows of {want}\n" + (tmp_path / "lake.log").read_text()[-3000:]
            )
            out = subprocess.run(
                [*GPUPIPE, "lake", "query", "SELECT count(*) AS n FROM samples"],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=REPO,
                env=read_env,
            )
            if out.returncode == 0 and out.stdout.strip():
                got = int(next(csv.DictReader(io.StringIO(out.stdout)))["n"])
            else:
                time.sleep(0.5)
        assert got == want
        assert hygiene.stop_group(proc, timeout=30) == 0
    finally:
        if proc.poll() is None:
            hygiene.stop_group(proc)
        log.close()
    keys = object_keys(s3, prefix="wh/")
    assert any(k.endswith(".parquet") for k in keys) and any(k.endswith(".metadata.json") for k in keys)
    assert not (tmp_path / "lake").exists(), "nothing written to the local default warehouse"
