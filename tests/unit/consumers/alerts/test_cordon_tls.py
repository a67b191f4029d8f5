"""The cordon path verifies the Kubernetes API server's certificate against its CA.

The fake API server (tests/k8s_api_fake.py) is served over real TLS with a throw-away CA: with
`--kube-ca-file` (or the service account's ca.crt) the call goes through; with a CA that did not sign
the server's certificate the call fails and the bearer token never leaves the process.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from gpupipe.clients.kube import KubeApiError, KubeClient, kube_config
from gpupipe_consumers.alerts.cordon import KubeNodeApi
from tests.integration.consumers.metrics.test_tls_auth import make_certs
from tests.k8s_api_fake import FakeKubeApi


def nodes(url: str, token: Path, ca: Path | None = None) -> KubeNodeApi:
    cfg = kube_config(url, str(token), str(ca) if ca else None, needed_by="--cordon")
    return KubeNodeApi(KubeClient(cfg))


@pytest.fixture
def tls_api(tmp_path: Path) -> tuple[FakeKubeApi, str, Path, Path]:
    ca, crt, key = make_certs(tmp_path)
    api = FakeKubeApi(nodes=["gpu-node-1"], token="t0ken")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(crt), str(key))
    api._server.socket = ctx.wrap_socket(api._server.socket, server_side=True)
    (tmp_path / "token").write_text("t0ken\n")
    with api:
        yield api, f"https://127.0.0.1:{api._server.server_address[1]}", ca, tmp_path / "token"


def test_the_api_server_certificate_is_checked_against_the_given_ca(tls_api: tuple) -> None:
    api, url, ca, token = tls_api
    node = nodes(url, token, ca).get_node("gpu-node-1")
    assert node["metadata"]["name"] == "gpu-node-1"
    assert api.requests[-1].headers["authorization"] == "Bearer t0ken"


def test_an_api_server_signed_by_another_ca_is_refused_before_the_token_is_sent(
    tls_api: tuple, tmp_path: Path
) -> None:
    api, url, _, token = tls_api
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_ca, _, _ = make_certs(other_dir)
    with pytest.raises(KubeApiError, match="CERTIFICATE_VERIFY_FAILED"):
        nodes(url, token, other_ca).get_node("gpu-node-1")
    with pytest.raises(KubeApiError, match="CERTIFICATE_VERIFY_FAILED"):  # system CAs do not know it either
        nodes(url, token).get_node("gpu-node-1")
    assert api.requests == []
