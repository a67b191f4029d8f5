"""A throw-away PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and client certificates
with the SANs a test asks for (made with the ``cryptography`` package, which confluent-kafka's
schema-registry extra brings)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(d: Path, stem: str, cert: x509.Certificate, key: Any) -> tuple[Path, Path]:
    crt, pem = d / f"{stem}.crt", d / f"{stem}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, pem


class Pki:
    def __init__(self, d: Path) -> None:
        self.dir = d
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self._now = now
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name("gpupipe test CA"))
            .issuer_name(_name("gpupipe test CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca = d / "ca.crt"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, sans: list[x509.GeneralName], usage: Any) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(stem))
            .issuer_name(_name("gpupipe test CA"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now - dt.timedelta(minutes=5))
            .not_valid_after(self._now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return _write(self.dir, stem, cert, key)

    def server(self, stem: str = "server") -> tuple[Path, Path]:
        sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        return self.issue(stem, sans, ExtendedKeyUsageOID.SERVER_AUTH)

    def client(self, dns: str) -> tuple[Path, Path]:
        return self.issue(dns, [x509.DNSName(dns)], ExtendedKeyUsageOID.CLIENT_AUTH)

    def node(
        self,
        stem: str,
        cn: str,
        *,
        dns: tuple[str, ...] = (),
        key: Any = None,
        org: str | None = "system:nodes",
        usage: Any = ExtendedKeyUsageOID.CLIENT_AUTH,
        is_ca: bool = False,
        valid_from: dt.datetime | None = None,
        valid_for: dt.timedelta = dt.timedelta(days=1),
    ) -> Path:
        """A kubelet client certificate as the cluster CA issues it (``O=system:nodes``, CN
        ``system:node:<node>``, client auth) or, with the keywords, something that only looks like
        one; certificate and key in one PEM file, as ``kubelet-client-current.pem`` holds them."""
        key = key or ec.generate_private_key(ec.SECP256R1())
        start = valid_from or self._now - dt.timedelta(minutes=5)
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org is not None:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(_name("gpupipe test CA"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + valid_for)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if is_ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        if dns:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns]), critical=False)
        cert = b.sign(self._key, hashes.SHA256())
        path = self.dir / f"{stem}.pem"
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                # the kubelet writes "EC PRIVATE KEY"; Ed25519 has only PKCS#8
                serialization.PrivateFormat.PKCS8
                if isinstance(key, ed25519.Ed25519PrivateKey)
                else serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
        return path
