"""A node's signature: made with the kubelet's own certificate, accepted only for that node."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpupipe.common.errors import ConfigError
from gpupipe.domain.node_choices import NODE_CERT_RULES
from gpupipe.domain.node_identity import CERT_HEADER, NAME_RULES, SIG_HEADER, NodeSigner, NodeVerifier
from tests.pki import Pki

VALUE = b"\x00\x01an XidEvent's Avro body"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def _verifier(pki: Pki, **kw: object) -> NodeVerifier:
    return NodeVerifier.from_file(str(pki.ca), **kw)  # type: ignore[arg-type]


def _headers(path: Path, node: str) -> list[tuple[str, bytes]]:
    return NodeSigner(str(path), None, node).headers(VALUE)


def _forged(path: Path) -> list[tuple[str, bytes]]:
    """Headers signed with the file's key, whatever its certificate names (as a forger would)."""
    pem = path.read_bytes()
    cert = x509.load_pem_x509_certificates(pem)[0]
    key = serialization.load_pem_private_key(pem[pem.index(b"-----BEGIN EC") :], password=None)
    sig = key.sign(VALUE, ec.ECDSA(hashes.SHA256()))  # type: ignore[union-attr,call-arg]
    return [(SIG_HEADER, sig), (CERT_HEADER, cert.public_bytes(serialization.Encoding.DER))]


def test_a_kubelet_certificate_signs_for_its_own_node_only(pki: Pki) -> None:
    headers = _headers(pki.node("a", "system:node:node-a"), "node-a")
    assert [k for k, _ in headers] == [SIG_HEADER, CERT_HEADER]
    v = _verifier(pki)
    assert v.check("node-a", VALUE, headers) is None
    assert v.check("node-b", VALUE, headers) == "wrong-node"
    # another spelling of the name is another host to every consumer: only the exact name
    assert v.check("Node-A", VALUE, headers) == "wrong-node"
    assert v.check("node-a", VALUE + b"x", headers) == "bad-signature"


@pytest.mark.parametrize(
    "key",
    [rsa.generate_private_key(public_exponent=65537, key_size=2048), ed25519.Ed25519PrivateKey.generate()],
    ids=["rsa", "ed25519"],
)
def test_rsa_and_ed25519_keys_work_too(pki: Pki, key: object) -> None:
    headers = _headers(pki.node("n", "system:node:node-7", key=key), "node-7")
    assert _verifier(pki).check("node-7", VALUE, headers) is None


def test_only_kubelet_client_certificates_name_a_node_unless_the_ca_is_dedicated(pki: Pki) -> None:
    """The cluster CA signs users' and kubelets' serving certificates too: none of them is node-b."""
    kubelet, dedicated = _verifier(pki), _verifier(pki, rule="dedicated-ca")
    look_alikes = {
        "bare CN": pki.node("bare", "node-b", org=None),
        "not in system:nodes": pki.node("user", "system:node:node-b", org="developers"),
        "server auth only": pki.node("srv", "system:node:node-b", usage=ExtendedKeyUsageOID.SERVER_AUTH),
        "serving SAN": pki.node("serving", "system:node:node-a", dns=("node-b",)),
        "a CA": pki.node("ca", "system:node:node-b", is_ca=True),
    }
    for what, path in look_alikes.items():
        assert kubelet.check("node-b", VALUE, _forged(path)) == "wrong-node", what
    # a CA that issues node identities only may name them in the CN or a DNS SAN
    assert dedicated.check("node-b", VALUE, _forged(look_alikes["bare CN"])) is None
    assert dedicated.check("node-b", VALUE, _forged(look_alikes["serving SAN"])) is None
    assert dedicated.check("node-b", VALUE, _forged(look_alikes["a CA"])) == "wrong-node"
    assert NODE_CERT_RULES == NAME_RULES  # the alerts flag's choices, stated without the import


def test_what_is_refused_and_why(pki: Pki, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = Pki(tmp_path / "other")
    good = _headers(pki.node("a", "system:node:node-a"), "node-a")
    stranger = _headers(other.node("a", "system:node:node-a"), "node-a")
    v = _verifier(pki)
    assert v.check("node-a", VALUE, None) == "unsigned"
    assert v.check("node-a", VALUE, [(SIG_HEADER, good[0][1])]) == "unsigned"
    assert v.check("node-a", VALUE, [(SIG_HEADER, None), good[1]]) == "unsigned"
    assert v.check("node-a", VALUE, [good[0], (CERT_HEADER, b"not DER")]) == "bad-certificate"
    assert v.check("node-a", VALUE, [good[0], (CERT_HEADER, b"\x30" * 20_000)]) == "bad-certificate"
    assert v.check("node-a", VALUE, stranger) == "untrusted"  # same name, another CA
    # node-b's own valid certificate with node-a's name on the record: the forged hostname
    forged = _headers(pki.node("b", "system:node:node-b"), "node-b")
    assert v.check("node-a", VALUE, forged) == "wrong-node"
    # a signature copied onto another record's certificate does not carry over
    assert v.check("node-a", VALUE, [forged[0], good[1]]) == "bad-signature"
    assert v.check("node-a", VALUE, [(SIG_HEADER, b"\x00"), good[1]]) == "bad-signature"


def test_a_certificate_the_library_cannot_read_is_a_refusal_not_a_crash(pki: Pki) -> None:
    der = bytearray(dict(_headers(pki.node("a", "system:node:node-a"), "node-a"))[CERT_HEADER])
    p256 = bytes.fromhex("06082a8648ce3d030107")  # the curve's OID: make it one nobody knows
    at = der.index(p256)
    der[at : at + len(p256)] = bytes.fromhex("06082a8648ce3d03017f")
    with pytest.raises(Exception):  # noqa: B017 (the library's own exception, whichever it is)
        x509.load_der_x509_certificate(bytes(der)).public_key()
    assert _verifier(pki).check("node-a", VALUE, [(SIG_HEADER, b"sig"), (CERT_HEADER, bytes(der))]) == (
        "bad-certificate"
    )


def test_the_bundle_issues_only_through_its_cas(pki: Pki, tmp_path: Path) -> None:
    # a leaf beside the CA changes nothing; a bundle of leaves alone has no CA and is refused
    leaf = pki.node("leaf", "system:node:leafy")
    leaf_cert = x509.load_pem_x509_certificates(leaf.read_bytes())[0]
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(pki.ca.read_bytes() + leaf_cert.public_bytes(serialization.Encoding.PEM))
    v = NodeVerifier.from_file(str(bundle))
    assert v.check("leafy", VALUE, _headers(leaf, "leafy")) is None
    only_leaf = tmp_path / "leaf.pem"
    only_leaf.write_bytes(leaf_cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ConfigError, match="none of its certificates is a CA"):
        NodeVerifier.from_file(str(only_leaf))


def test_a_certificate_is_accepted_only_while_it_and_its_ca_are_valid(pki: Pki) -> None:
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    path = pki.node("a", "system:node:node-a", valid_from=start, valid_for=dt.timedelta(hours=1))
    headers = _headers(path, "node-a")
    now = [start.timestamp() + 60]
    v = _verifier(pki, clock=lambda: now[0])
    assert v.check("node-a", VALUE, headers) is None
    now[0] = start.timestamp() + 3601  # the cached certificate's validity is checked every time
    assert v.check("node-a", VALUE, headers) == "expired"
    now[0] = start.timestamp() - 1
    assert v.check("node-a", VALUE, headers) == "expired"
    # the test CA is valid for a day: a node certificate outliving it is expired with it
    long = _headers(pki.node("long", "system:node:node-a", valid_for=dt.timedelta(days=30)), "node-a")
    now[0] = start.timestamp() + 2 * 86_400
    assert v.check("node-a", VALUE, long) == "expired"


def test_junk_certificates_never_push_out_the_good_ones(pki: Pki) -> None:
    v = _verifier(pki, cache_max=2, bad_cache_max=2)
    good = [_headers(pki.node(f"n{i}", f"system:node:n{i}"), f"n{i}") for i in range(2)]
    for i, h in enumerate(good):
        assert v.check(f"n{i}", VALUE, h) is None
    for i in range(50):
        assert v.check("n0", VALUE, [good[0][0], (CERT_HEADER, b"junk%d" % i)]) == "bad-certificate"
    assert len(v._good) == 2 and len(v._bad) == 2
    h3 = _headers(pki.node("n3", "system:node:n3"), "n3")
    assert v.check("n0", VALUE, good[0]) is None  # n0 used last: n1 is the one to go
    assert v.check("n3", VALUE, h3) is None
    assert next(iter(v._good.values())).names == frozenset({"n0"})


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
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    current = tmp_path / "kubelet-client-current.pem"
    os.symlink(pki.node("k1", "system:node:node-a"), current)
    signer = NodeSigner(str(current), None, "node-a")
    der1 = signer.headers(VALUE)[1][1]
    # the kubelet writes a new pair and moves the symlink
    tmp = tmp_path / "next"
    os.symlink(pki.node("k2", "system:node:node-a"), tmp)
    os.replace(tmp, current)
    der2 = signer.headers(VALUE)[1][1]
    assert der2 != der1 and _verifier(pki).check("node-a", VALUE, signer.headers(VALUE)) is None
    # a half-written file: the last good pair signs on, once said, and counted
    os.remove(current)
    current.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    headers = signer.headers(VALUE)
    assert headers[1][1] == der2 and signer.reload_errors == 1
    assert "node certificate not reloaded" in caplog.text
    assert _verifier(pki).check("node-a", VALUE, headers) is None
    assert signer.headers(VALUE)[1][1] == der2 and signer.reload_errors == 1  # unchanged: not re-read
    # the writer finishes: the next record is signed with what it wrote
    current.write_bytes(pki.node("k3", "system:node:node-a").read_bytes())
    os.utime(current, ns=(1, 1))  # a different stamp even within the clock's resolution
    der3 = signer.headers(VALUE)[1][1]
    assert der3 not in (der1, der2)


def test_a_producer_with_another_nodes_certificate_stops_at_start_with_one_line(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpupipe.commands.cli import main

    cert = pki.node("b", "system:node:node-b")
    argv = ["produce", "--source", "nvml", "--hostname", "node-a", "--node-cert", str(cert), "--no-kmsg"]
    assert main([*argv, "--bootstrap-servers", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gpupipe produce: error: --node-cert {cert} names node-b, not this node 'node-a': "
        "the consuming services would refuse its records"
    )
    sim = ["produce", "--source", "simulated", "--node-cert", str(cert), "--bootstrap-servers", "127.0.0.1:1"]
    assert main(sim) == 2
    assert capsys.readouterr().err.strip() == (
        "gpupipe produce: error: --node-cert signs one node's records: use it with --source nvml"
    )
