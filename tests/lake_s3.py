"""A local S3-compatible store for the lake's tests: moto in server mode, one per test.

The store checks every request's signature against an access key it issued (moto's IAM, with a
policy allowing S3), so a reader or writer that did not get the credentials fails instead of
passing on unsigned requests. The tests hand the key to the lake, the REST catalog server and Spark
the way production does, through a file or the environment, never argv."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from tests import hygiene
from tests.conftest import free_port

BUCKET = "gpu-lake"
REGION = "us-east-1"
_ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


@dataclass(frozen=True)
class S3Store:
    url: str  # the endpoint
    key_id: str
    secret: str


@contextlib.contextmanager
def moto_server(tmp: Path, bucket: str = BUCKET) -> Iterator[S3Store]:
    """A moto S3 server on a free port with ``bucket`` created, signatures checked from then on."""
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
        # Set up while moto still takes any request, then have it check every one.
        iam = boto3.client(
            "iam",
            endpoint_url=url,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
            region_name=REGION,
        )
        iam.create_user(UserName="lake")
        key = iam.create_access_key(UserName="lake")["AccessKey"]
        iam.put_user_policy(UserName="lake", PolicyName="s3", PolicyDocument=json.dumps(_ALLOW_S3))
        store = S3Store(url, key["AccessKeyId"], key["SecretAccessKey"])
        s3_client(store).create_bucket(Bucket=bucket)
        req = urllib.request.Request(
            url + "/moto-api/reset-auth",
            data=b"0",
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).close()
        yield store
    finally:
        hygiene.stop_group(proc)
        log.close()


def s3_client(store: S3Store, key_id: str | None = None, secret: str | None = None) -> Any:
    """A boto3 S3 client for ``store``, with its key unless another is given."""
    return boto3.client(
        "s3",
        endpoint_url=store.url,
        aws_access_key_id=key_id or store.key_id,
        aws_secret_access_key=secret or store.secret,
        region_name=REGION,
    )


def object_keys(store: S3Store, bucket: str = BUCKET, prefix: str = "") -> list[str]:
    """Every key under ``prefix`` in ``bucket`` (all pages)."""
    pages = s3_client(store).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]
