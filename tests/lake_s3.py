"""A local S3-compatible store for the lake's tests: moto in server mode, one per test.

The credentials are made up (moto accepts any); the tests hand them to the lake, the REST catalog
server and Spark the way production does, through a file or the environment, never argv."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3

from tests import hygiene
from tests.conftest import free_port

BUCKET = "gpu-lake"
REGION = "us-east-1"
KEY_ID, SECRET = "lake-writer", "s3cr3t-not-in-argv"


@contextlib.contextmanager
def moto_server(tmp: Path, bucket: str = BUCKET) -> Iterator[str]:
    """A moto S3 server on a free port with ``bucket`` created; its endpoint URL."""
    port = free_port()
    log = open(tmp / "moto.log", "w")  # noqa: SIM115 (owned by the process' lifetime)
    moto = Path(sys.executable).parent / "moto_server"
    proc = hygiene.popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp / "moto.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "moto_server did not answer in 60 s"
                time.sleep(0.1)
        s3_client(url).create_bucket(Bucket=bucket)
        yield url
    finally:
        hygiene.stop_group(proc)
        log.close()


def s3_client(url: str) -> Any:
    """A boto3 S3 client for the moto server at ``url`` (to look at what landed in the bucket)."""
    return boto3.client(
        "s3", endpoint_url=url, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET, region_name=REGION
    )


def object_keys(url: str, bucket: str = BUCKET, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` in ``bucket`` (all pages)."""
    pages = s3_client(url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]
