"""A node's XID records carry proof of which node wrote them.

Every GPU node's producer shares one Kafka principal, so the broker cannot tell node-b's records
from node-a's, and an XID's ``hostname`` is what decides which node a drain alert cordons. So the
producer signs each XID-topic record's value with a key only its node holds, and sends the
signature and its certificate in two headers; the alerts service accepts the record's hostname only
when the certificate was issued by a CA it trusts, is valid now, names that node, and the signature
verifies over the exact bytes it decoded.

The default identity is the kubelet's own client certificate (``CN=system:node:<node>``, issued by
the cluster CA, rotated by the kubelet), so there is nothing to issue; any CA whose certificates
name the node in the CN or a DNS SAN works the same way. Samples are not signed: a sample alone
neither cordons a node nor ends an alert, and signing every reading would cost bytes and CPU.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import NameOID

from gpupipe.errors import ConfigError

__all__ = [
    "CERT_HEADER",
    "REASONS",
    "SIG_HEADER",
    "NodeSigner",
    "NodeVerifier",
    "node_names",
]

SIG_HEADER = "gpupipe-node-sig"
CERT_HEADER = "gpupipe-node-cert"
#: Why a record's node was not accepted, as counted and dead-lettered.
REASONS = ("unsigned", "bad-certificate", "untrusted", "expired", "wrong-node", "bad-signature")
_NODE_PREFIX = "system:node:"
_KEY_PEM = re.compile(rb"-----BEGIN ((?:EC |RSA )?PRIVATE KEY)-----.+?-----END \1-----", re.S)


def node_names(cert: x509.Certificate) -> frozenset[str]:
    """The node names a certificate speaks for: its CN (``system:node:`` stripped) and DNS SANs."""
    names = set()
    for attr in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME):
        value = attr.value if isinstance(attr.value, str) else attr.value.decode()
        names.add(value.removeprefix(_NODE_PREFIX).lower())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names.update(n.lower() for n in san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        pass
    names.discard("")
    return frozenset(names)


def _sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise ConfigError(f"node key type {type(key).__name__} is not supported (use EC, RSA or Ed25519)")


def _verify(public: Any, sig: bytes, data: bytes) -> bool:
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(sig, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(sig, data, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(sig, data)
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from exc


class NodeSigner:
    """Signs XID-topic values as ``hostname``; re-reads the files when they change (rotation).

    Raises :class:`ConfigError` at construction for an unreadable or mismatched certificate or key,
    and for a certificate that does not name ``hostname``: a producer that would be refused says so
    at start. A rotation that breaks the files later keeps the last good pair (and says so once).
    """

    def __init__(self, cert_path: str, key_path: str | None, hostname: str) -> None:
        self.cert_path, self.key_path = cert_path, key_path or cert_path
        self.hostname = hostname
        self._stamp: tuple[Any, ...] = ()
        self._cert_der = b""
        self._key: Any = None
        self.reload_errors = 0
        self._load()

    def _files_stamp(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for p in (self.cert_path, self.key_path):
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self) -> None:
        stamp = self._files_stamp()
        cert_pem = _read(self.cert_path, "--node-cert")
        key_pem = cert_pem if self.key_path == self.cert_path else _read(self.key_path, "--node-key")
        try:
            cert = x509.load_pem_x509_certificates(cert_pem)[0]
        except ValueError as exc:
            raise ConfigError(f"--node-cert {self.cert_path}: no PEM certificate in it") from exc
        block = _KEY_PEM.search(key_pem)
        if block is None:
            raise ConfigError(f"--node-key {self.key_path}: no PEM private key in it")
        try:
            key = serialization.load_pem_private_key(block.group(0), password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--node-key {self.key_path}: not a readable private key") from exc
        probe = b"gpupipe node identity"
        if not _verify(cert.public_key(), _sign(key, probe), probe):
            raise ConfigError(f"--node-key {self.key_path} is not the key of --node-cert {self.cert_path}")
        names = node_names(cert)
        if self.hostname.lower() not in names:
            raise ConfigError(
                f"--node-cert {self.cert_path} names {', '.join(sorted(names)) or 'no node'}, "
                f"not this node {self.hostname!r}: the alerts service would refuse its XIDs"
            )
        self._cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._key = key
        self._stamp = stamp

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The two headers that prove ``value`` was written by this node."""
        if self._files_stamp() != self._stamp:
            try:
                self._load()
            except ConfigError:
                self.reload_errors += 1  # half-written rotation: keep signing with the last good pair
                self._stamp = self._files_stamp()
        return [(SIG_HEADER, _sign(self._key, value)), (CERT_HEADER, self._cert_der)]


@dataclass(frozen=True)
class _Checked:
    """What a certificate seen before proved (or why it proves nothing)."""

    problem: str | None
    names: frozenset[str] = frozenset()
    not_before: float = 0.0
    not_after: float = 0.0
    public: Any = None


def _header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    for k, v in headers or ():
        if k == name:
            return v
    return None


class NodeVerifier:
    """Checks that a record's hostname is the node that signed it; see the module doc.

    Certificates are checked once and remembered by their digest (up to ``cache_max``); validity is
    compared with ``clock`` on every record, so a certificate that expires is refused from then on.
    """

    def __init__(
        self,
        cas: Iterable[x509.Certificate],
        *,
        clock: Callable[[], float] = time.time,
        cache_max: int = 50_000,
    ) -> None:
        self._cas = list(cas)
        if not self._cas:
            raise ConfigError("node identity needs at least one CA certificate")
        self._clock = clock
        self._cache: dict[bytes, _Checked] = {}
        self._cache_max = cache_max

    @classmethod
    def from_file(cls, path: str, **kw: Any) -> NodeVerifier:
        """The CA bundle at ``path`` (PEM, one or more certificates); ConfigError when it has none."""
        pem = _read(path, "--node-ca-file")
        try:
            cas = x509.load_pem_x509_certificates(pem)
        except ValueError as exc:
            raise ConfigError(f"--node-ca-file {path}: no PEM certificate in it") from exc
        return cls(cas, **kw)

    def _check_cert(self, der: bytes) -> _Checked:
        digest = hashlib.sha256(der).digest()
        hit = self._cache.get(digest)
        if hit is not None:
            return hit
        try:
            cert = x509.load_der_x509_certificate(der)
            public = cert.public_key()
            names = node_names(cert)
        except (ValueError, TypeError):
            checked = _Checked("bad-certificate")
        else:
            checked = _Checked("untrusted")
            for ca in self._cas:
                try:
                    cert.verify_directly_issued_by(ca)
                except (ValueError, TypeError, InvalidSignature):
                    continue
                checked = _Checked(
                    None,
                    names,
                    cert.not_valid_before_utc.timestamp(),
                    cert.not_valid_after_utc.timestamp(),
                    public,
                )
                break
        if len(self._cache) >= self._cache_max:
            del self._cache[next(iter(self._cache))]
        self._cache[digest] = checked
        return checked

    def check(
        self, hostname: str, value: bytes, headers: Sequence[tuple[str, bytes | None]] | None
    ) -> str | None:
        """None when ``value`` was signed by node ``hostname``; else the reason (one of REASONS)."""
        sig, der = _header(headers, SIG_HEADER), _header(headers, CERT_HEADER)
        if not sig or not der:
            return "unsigned"
        c = self._check_cert(der)
        if c.problem is not None:
            return c.problem
        now = self._clock()
        if not c.not_before <= now <= c.not_after:
            return "expired"
        if hostname.lower() not in c.names:
            return "wrong-node"
        if not _verify(c.public, sig, value):
            return "bad-signature"
        return None
