"""A node's XID signature: made with the kubelet's own certificate, accepted only for that node."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from gpupipe.errors import ConfigError
from gpupipe.node_identity import CERT_HEADER, SIG_HEADER, NodeSigner, NodeVerifier
from tests.pki import Pki

VALUE = b"\x00\x01an XidEvent's Avro body"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def _verifier(pki: Pki, **kw: object) -> NodeVerifier:
    return NodeVerifier.from_file(str(pki.ca), **kw)  # type: ignore[arg-type]


def test_a_kubelet_certificate_signs_for_its_own_node_only(pki: Pki) -> None:
    signer = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a")
    headers = signer.headers(VALUE)
    assert [k for k, _ in headers] == [SIG_HEADER, CERT_HEADER]
    v = _verifier(pki)
    assert v.check("node-a", VALUE, headers) is None
    assert v.check("Node-A", VALUE, headers) is None  # node names are DNS names: case does not count
    assert v.check("node-b", VALUE, headers) == "wrong-node"
    assert v.check("node-a", VALUE + b"x", headers) == "bad-signature"


@pytest.mark.parametrize(
    "key",
    [rsa.generate_private_key(public_exponent=65537, key_size=2048), ed25519.Ed25519PrivateKey.generate()],
    ids=["rsa", "ed25519"],
)
def test_rsa_and_ed25519_keys_and_san_names_work_too(pki: Pki, key: object) -> None:
    path = pki.node("n", "gpu-node-7 identity", dns=("node-7.example",), key=key)
    headers = NodeSigner(str(path), str(path), "node-7.example").headers(VALUE)
    assert _verifier(pki).check("node-7.example", VALUE, headers) is None


def test_what_is_refused_and_why(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = Pki(tmp_path / "other")
    good = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a").headers(VALUE)
    stranger = NodeSigner(str(other.node("a", "system:node:node-a")), None, "node-a").headers(VALUE)
    v = _verifier(pki)
    assert v.check("node-a", VALUE, None) == "unsigned"
    assert v.check("node-a", VALUE, [(SIG_HEADER, good[0][1])]) == "unsigned"
    assert v.check("node-a", VALUE, [good[0], (CERT_HEADER, b"not DER")]) == "bad-certificate"
    assert v.check("node-a", VALUE, stranger) == "untrusted"  # same name, another CA
    # node-b's own valid certificate with node-a's name on the record: the forged hostname
    forged = NodeSigner(str(pki.node("b", "system:node:node-b")), None, "node-b").headers(VALUE)
    assert v.check("node-a", VALUE, forged) == "wrong-node"
    # a signature copied onto another record's certificate does not carry over
    assert v.check("node-a", VALUE, [forged[0], good[1]]) == "bad-signature"


def test_a_certificate_is_accepted_only_while_valid(pki: Pki) -> None:
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    path = pki.node("a", "system:node:node-a", valid_from=start, valid_for=dt.timedelta(hours=1))
    headers = NodeSigner(str(path), None, "node-a").headers(VALUE)
    now = [start.timestamp() + 60]
    v = _verifier(pki, clock=lambda: now[0])
    assert v.check("node-a", VALUE, headers) is None
    now[0] = start.timestamp() + 3601  # the cached certificate's validity is checked every time
    assert v.check("node-a", VALUE, headers) == "expired"
    now[0] = start.timestamp() - 1
    assert v.check("node-a", VALUE, headers) == "expired"


def test_the_certificate_cache_is_bounded(pki: Pki) -> None:
    v = _verifier(pki, cache_max=2)
    for i in range(4):
        h = NodeSigner(str(pki.node(f"n{i}", f"system:node:n{i}")), None, f"n{i}").headers(VALUE)
        assert v.check(f"n{i}", VALUE, h) is None
    assert len(v._cache) == 2


def test_a_signer_that_would_be_refused_says_so_at_start(pki: Pki, tmp_path: Path) -> None:
    path = pki.node("b", "system:node:node-b")
    with pytest.raises(ConfigError, match=r"names node-b, not this node 'node-a'"):
        NodeSigner(str(path), None, "node-a")
    with pytest.raises(ConfigError, match=r"--node-cert .*missing.pem: No such file"):
        NodeSigner(str(tmp_path / "missing.pem"), None, "node-a")
    other = pki.node("c", "system:node:node-a")
    with pytest.raises(ConfigError, match="is not the key of --node-cert"):
        NodeSigner(str(path), str(other), "node-b")
    (tmp_path / "nokey.pem").write_bytes(path.read_bytes().split(b"-----BEGIN EC")[0])
    with pytest.raises(ConfigError, match="no PEM private key"):
        NodeSigner(str(tmp_path / "nokey.pem"), None, "node-b")
    (tmp_path / "ca.txt").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"--node-ca-file .*ca.txt: no PEM certificate in it"):
        NodeVerifier.from_file(str(tmp_path / "ca.txt"))


def test_a_rotated_certificate_is_picked_up_and_a_broken_rotation_keeps_the_last(
    pki: Pki, tmp_path: Path
) -> None:
    current = tmp_path / "kubelet-client-current.pem"
    first = pki.node("k1", "system:node:node-a")
    os.symlink(first, current)
    signer = NodeSigner(str(current), None, "node-a")
    der1 = signer.headers(VALUE)[1][1]
    # the kubelet writes a new pair and moves the symlink
    second = pki.node("k2", "system:node:node-a")
    tmp = tmp_path / "next"
    os.symlink(second, tmp)
    os.replace(tmp, current)
    der2 = signer.headers(VALUE)[1][1]
    assert der2 != der1 and _verifier(pki).check("node-a", VALUE, signer.headers(VALUE)) is None
    # a half-written file: the last good pair signs on, and the failure is counted
    os.remove(current)
    current.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    time.sleep(0.01)
    headers = signer.headers(VALUE)
    assert headers[1][1] == der2 and signer.reload_errors == 1
    assert _verifier(pki).check("node-a", VALUE, headers) is None


def test_a_producer_with_another_nodes_certificate_stops_at_start_with_one_line(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpupipe.cli import main

    cert = pki.node("b", "system:node:node-b")
    argv = ["produce", "--source", "nvml", "--hostname", "node-a", "--node-cert", str(cert), "--no-kmsg"]
    assert main([*argv, "--bootstrap-servers", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"gpupipe produce: error: --node-cert {cert} names node-b, not this node 'node-a': "
        "the alerts service would refuse its XIDs"
    )
