"""The node identity flags: one definition, the same checks and wiring in every service that takes them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from gpupipe.commands.cli import build_parser
from gpupipe.commands.cli import main as cli_main
from gpupipe.domain.node_check import NodeCheck, NodeIdentity, from_args
from gpupipe_consumers.chargeback.command import build_service
from gpupipe_consumers.metrics.command import config_from_args
from gpupipe_consumers.recommend.command import options_from_args
from tests.pki import Pki

SERVICES = ("alerts", "metrics", "chargeback", "recommend")


def _args(service: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([service, "--bootstrap-servers", "127.0.0.1:1", *flags])


@pytest.mark.parametrize("service", SERVICES)
def test_a_bad_ca_bundle_is_one_line_before_any_broker(
    service: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    leaf = Pki(tmp_path).node("a", "system:node:node-a")  # a certificate, but no CA
    for path, needle in (
        ("/nonexistent/ca.crt", "--node-ca-file /nonexistent/ca.crt: No such file"),
        (str(leaf), f"--node-ca-file {leaf}: none of its certificates is a CA"),
    ):
        assert cli_main([service, "--bootstrap-servers", "127.0.0.1:1", "--node-ca-file", path]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_declares_the_same_flags(service: str) -> None:
    defaults = _args(service)
    assert (defaults.node_ca_file, defaults.node_identity, defaults.node_cert_names) == (
        None,
        "enforce",
        "kubelet",
    )
    assert from_args(defaults) is None  # off: the hostname is taken as written


def test_the_flags_reach_each_service(tmp_path: Path) -> None:
    ca = str(Pki(tmp_path).ca)
    flags = ("--node-ca-file", ca, "--node-identity", "audit", "--node-cert-names", "dedicated-ca")
    want = NodeIdentity(ca, "audit", "dedicated-ca")
    assert config_from_args(_args("metrics", *flags)).node_identity == want
    assert options_from_args(_args("recommend", *flags), {}).node_identity == want
    check = build_service(_args("chargeback", *flags), {}).node_check
    assert isinstance(check, NodeCheck) and check.mode == "audit"
    assert check.results == {("GpuSample", "verified", "audit"): 0}


class _Msg:
    """A consumed record: its value, headers and Kafka timestamp."""

    def __init__(self, value: bytes, headers: list[tuple[str, bytes]], ts: tuple[int, int]) -> None:
        self._v, self._h, self._ts = value, headers, ts

    def value(self) -> bytes:
        return self._v

    def headers(self) -> list[tuple[str, bytes]]:
        return self._h

    def timestamp(self) -> tuple[int, int]:
        return self._ts


def test_a_certificate_is_judged_when_the_broker_took_the_record(tmp_path: Path) -> None:
    # A chargeback replaying an open window, or catching up after an outage, past the rotation of
    # a short-lived node certificate dead-lettered (or, on replay, silently dropped) samples that
    # were valid when written. Broker time (LogAppendTime) decides; a producer's CreateTime not.
    import datetime as dt
    import time

    from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME

    from gpupipe.domain.node_identity import NodeSigner, NodeVerifier

    pki = Pki(tmp_path)
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=4)  # the test CA is 5 minutes old
    cert = pki.node("a", "system:node:node-a", valid_from=start, valid_for=dt.timedelta(minutes=2))
    signer = NodeSigner(str(cert), None, "node-a")
    body = b"a sample"
    written_ms = int((start + dt.timedelta(minutes=1)).timestamp() * 1000)  # the certificate was valid
    check = NodeCheck(NodeVerifier.from_file(str(pki.ca)), "enforce", service="chargeback")
    now_ms = int(time.time() * 1000)
    on_time = _Msg(body, signer.headers(body), (TIMESTAMP_LOG_APPEND_TIME, written_ms))
    assert check.refuse("GpuSample", "node-a", on_time, now_ms) is None
    chosen = _Msg(body, signer.headers(body), (TIMESTAMP_CREATE_TIME, written_ms))
    assert (check.refuse("GpuSample", "node-a", chosen, now_ms) or "").startswith("expired")
    late = _Msg(body, signer.headers(body), (TIMESTAMP_LOG_APPEND_TIME, now_ms))  # sent again today
    assert (check.refuse("GpuSample", "node-a", late, now_ms) or "").startswith("expired")
