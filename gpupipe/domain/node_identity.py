"""A node's records carry proof of which node wrote them.

Every GPU node's producer shares one Kafka principal, so the broker cannot tell node-b's records
from node-a's, and a record's ``hostname`` is what decides which node an alert pages for, cordons, or
lets go, whose readings are served, whose GPUs are billed. So the producer signs each record's value
with a key only its node holds, and sends the signature and its certificate in two headers; a
consuming service (:mod:`gpupipe.domain.node_check`) accepts the record's hostname only when the
certificate was issued by a CA it trusts, both are valid now, the certificate names exactly that
node, and the signature verifies over the exact bytes it decoded.

Which certificates name a node (``NAME_RULES``):

* ``kubelet`` (the default): a kubelet client certificate as the cluster CA issues it: the one CN
  ``system:node:<node>``, organisation ``system:nodes``, client authentication, not a CA. So is the
  kubelet's own rotating certificate, and nothing has to be issued; a user's certificate whose CN
  happens to be a node name, or a kubelet serving certificate with the node's DNS name, is not one.
* ``dedicated-ca``: any leaf certificate the given CA issued, naming the node in its CN or a DNS SAN;
  only for a CA that issues node identities and nothing else.

Node names are compared exactly: Kubernetes node names are lower-case DNS names, and a record whose
hostname differs only in case would be another host to every consumer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import read_bytes
from gpupipe.domain.node_choices import NODE_CERT_RULES

__all__ = [
    "CERT_HEADER",
    "NAME_RULES",
    "REASONS",
    "SIG_HEADER",
    "NodeSigner",
    "NodeVerifier",
    "node_names",
]

log = logging.getLogger("gpupipe.node_identity")

SIG_HEADER = "gpupipe-node-sig"
CERT_HEADER = "gpupipe-node-cert"
#: Why a record's node was not accepted, as counted and dead-lettered.
REASONS = ("unsigned", "bad-certificate", "untrusted", "expired", "wrong-node", "bad-signature")
#: Which certificates name a node (see the module doc); the first is the default. Stated in the
#: light module that the services' flags take their choices from.
NAME_RULES = NODE_CERT_RULES
_NODE_PREFIX = "system:node:"
_NODES_GROUP = "system:nodes"
#: A certificate header larger than this is not a node certificate (and is not parsed).
MAX_CERT_BYTES = 16 * 1024
_KEY_PEM = re.compile(rb"-----BEGIN ((?:EC |RSA )?PRIVATE KEY)-----.+?-----END \1-----", re.S)


def _attr_values(name: x509.Name, oid: x509.ObjectIdentifier) -> list[str]:
    out = []
    for attr in name.get_attributes_for_oid(oid):
        v = attr.value
        out.append(v if isinstance(v, str) else bytes(v).decode("utf-8", "replace"))
    return out


def _ext(cert: x509.Certificate, cls: type) -> Any:
    try:
        return cert.extensions.get_extension_for_class(cls).value
    except x509.ExtensionNotFound:
        return None


def _is_ca(cert: x509.Certificate) -> bool:
    bc = _ext(cert, x509.BasicConstraints)
    return bool(bc is not None and bc.ca)


def node_names(cert: x509.Certificate, rule: str = NAME_RULES[0]) -> frozenset[str]:
    """The node names ``cert`` speaks for under ``rule`` (empty: none)."""
    if _is_ca(cert):
        return frozenset()
    cns = _attr_values(cert.subject, NameOID.COMMON_NAME)
    if rule == "kubelet":
        eku = _ext(cert, x509.ExtendedKeyUsage)
        if (
            len(cns) != 1
            or not cns[0].startswith(_NODE_PREFIX)
            or _NODES_GROUP not in _attr_values(cert.subject, NameOID.ORGANIZATION_NAME)
            or eku is None
            or ExtendedKeyUsageOID.CLIENT_AUTH not in eku
        ):
            return frozenset()
        return frozenset({cns[0].removeprefix(_NODE_PREFIX)}) - {""}
    names = {cn.removeprefix(_NODE_PREFIX) for cn in cns}
    san = _ext(cert, x509.SubjectAlternativeName)
    if san is not None:
        names.update(san.get_values_for_type(x509.DNSName))
    return frozenset(names) - {""}


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
    except Exception:  # whatever a hostile signature makes the library raise: not proven
        return False
    return True


def _read(path: str, what: str) -> bytes:
    return read_bytes(path, what)


class NodeSigner:
    """Signs record values as ``hostname``; re-reads the files when they change (rotation).

    Raises :class:`ConfigError` at construction for an unreadable or mismatched certificate or key,
    and for a certificate that does not name ``hostname``: a producer that would be refused says so
    at start. A rotation that breaks the files later keeps the last good pair, logs it once and
    counts it in ``reload_errors``; the files are read again when they change again. Thread-safe
    (samples are handed over from the polling thread and the main loop, XIDs from the main loop).
    """

    def __init__(self, cert_path: str, key_path: str | None, hostname: str) -> None:
        self.cert_path, self.key_path = cert_path, key_path or cert_path
        self.hostname = hostname
        self._lock = threading.Lock()
        self._stamp: tuple[Any, ...] = ()
        self._cert_der = b""
        self._key: Any = None
        self.not_after = 0.0
        self.reload_errors = 0
        self._load(self._files_stamp())

    def _files_stamp(self) -> tuple[Any, ...]:
        out: list[Any] = []
        for p in dict.fromkeys((self.cert_path, self.key_path)):  # the kubelet keeps both in one file
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self, stamp: tuple[Any, ...]) -> None:
        cert_pem = _read(self.cert_path, "--node-cert")
        key_pem = cert_pem if self.key_path == self.cert_path else _read(self.key_path, "--node-key")
        try:
            cert = x509.load_pem_x509_certificates(cert_pem)[0]
            public = cert.public_key()
        except Exception as exc:  # ValueError, UnsupportedAlgorithm, ...
            raise ConfigError(f"--node-cert {self.cert_path}: no readable PEM certificate in it") from exc
        block = _KEY_PEM.search(key_pem)
        if block is None:
            raise ConfigError(f"--node-key {self.key_path}: no PEM private key in it")
        try:
            key = serialization.load_pem_private_key(block.group(0), password=None)
        except Exception as exc:
            raise ConfigError(f"--node-key {self.key_path}: not a readable private key") from exc
        probe = b"gpupipe node identity"
        if not _verify(public, _sign(key, probe), probe):
            raise ConfigError(f"--node-key {self.key_path} is not the key of --node-cert {self.cert_path}")
        names = node_names(cert, "dedicated-ca")
        if self.hostname not in names:
            raise ConfigError(
                f"--node-cert {self.cert_path} names {', '.join(sorted(names)) or 'no node'}, "
                f"not this node {self.hostname!r}: the consuming services would refuse its records"
            )
        self._cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._key = key
        self.not_after = cert.not_valid_after_utc.timestamp()
        self._stamp = stamp

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The two headers that prove ``value`` was written by this node."""
        with self._lock:
            stamp = self._files_stamp()
            if stamp != self._stamp:
                try:
                    self._load(stamp)  # the stamp taken before the read: a later write is seen
                except ConfigError as exc:
                    self._stamp = stamp
                    self.reload_errors += 1
                    log.warning(
                        "node certificate not reloaded: signing with the last good one",
                        extra={"fields": {"error": str(exc), "not_after": self.not_after}},
                    )
            key, der = self._key, self._cert_der
        return [(SIG_HEADER, _sign(key, value)), (CERT_HEADER, der)]


@dataclass(frozen=True)
class _Checked:
    """What a certificate seen before proved (or why it proves nothing)."""

    problem: str | None
    names: frozenset[str] = frozenset()
    not_before: float = 0.0  # the later of the certificate's and its issuer's
    not_after: float = 0.0  # the earlier of the two
    public: Any = None


def _header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> bytes | None:
    for k, v in headers or ():
        if k == name:
            return v
    return None


def _usable_ca(cert: x509.Certificate) -> bool:
    bc = _ext(cert, x509.BasicConstraints)
    ku = _ext(cert, x509.KeyUsage)
    return bool(bc is not None and bc.ca and (ku is None or ku.key_cert_sign))


class NodeVerifier:
    """Checks that a record's hostname is the node that signed it; see the module doc.

    Only CA certificates of the bundle issue (BasicConstraints CA, key usage allowing certificate
    signing); a leaf in the bundle issues nothing. Certificates are checked once and remembered by
    their digest, good ones (up to ``cache_max``, least recently used out) apart from bad ones (a
    small bound), so a flood of junk certificates costs CPU, never the good entries; validity (the
    certificate's and its CA's) is compared with ``clock`` on every record. Thread-safe: the caches
    are held under a lock, the signature is verified outside it.
    """

    def __init__(
        self,
        cas: Iterable[x509.Certificate],
        *,
        rule: str = NAME_RULES[0],
        clock: Callable[[], float] = time.time,
        cache_max: int = 50_000,
        bad_cache_max: int = 1_000,
    ) -> None:
        if rule not in NAME_RULES:
            raise ConfigError(f"node certificate rule {rule!r} is not one of {', '.join(NAME_RULES)}")
        self._cas = [c for c in cas if _usable_ca(c)]
        if not self._cas:
            raise ConfigError("node identity needs at least one CA certificate (BasicConstraints CA)")
        self.rule = rule
        self._clock = clock
        self._good: OrderedDict[bytes, _Checked] = OrderedDict()
        self._bad: OrderedDict[bytes, _Checked] = OrderedDict()
        self._cache_max, self._bad_max = cache_max, bad_cache_max
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str, **kw: Any) -> NodeVerifier:
        """The CA bundle at ``path`` (PEM, one or more certificates); ConfigError when it has no CA."""
        pem = _read(path, "--node-ca-file")
        try:
            cas = x509.load_pem_x509_certificates(pem)
        except ValueError as exc:
            raise ConfigError(f"--node-ca-file {path}: no PEM certificate in it") from exc
        if not any(_usable_ca(c) for c in cas):
            raise ConfigError(f"--node-ca-file {path}: none of its certificates is a CA (BasicConstraints)")
        return cls(cas, **kw)

    def _examine(self, der: bytes) -> _Checked:
        try:
            cert = x509.load_der_x509_certificate(der)
            public = cert.public_key()
            names = node_names(cert, self.rule)
        except Exception:  # ValueError, UnsupportedAlgorithm, ...: a record, not a crash
            return _Checked("bad-certificate")
        for ca in self._cas:
            try:
                cert.verify_directly_issued_by(ca)
            except Exception:
                continue
            return _Checked(
                None,
                names,
                max(cert.not_valid_before_utc.timestamp(), ca.not_valid_before_utc.timestamp()),
                min(cert.not_valid_after_utc.timestamp(), ca.not_valid_after_utc.timestamp()),
                public,
            )
        return _Checked("untrusted")

    def _check_cert(self, der: bytes) -> _Checked:
        digest = hashlib.sha256(der).digest()
        with self._lock:
            hit = self._good.get(digest)
            if hit is not None:
                self._good.move_to_end(digest)
                return hit
            hit = self._bad.get(digest)
            if hit is not None:
                return hit
        checked = self._examine(der)
        good = checked.problem is None
        cache, bound = (self._good, self._cache_max) if good else (self._bad, self._bad_max)
        with self._lock:
            cache[digest] = checked
            if len(cache) > bound:
                cache.popitem(last=False)
        return checked

    def check(
        self,
        hostname: str,
        value: bytes,
        headers: Sequence[tuple[str, bytes | None]] | None,
        at: float | None = None,
    ) -> str | None:
        """None when ``value`` was signed by node ``hostname``; else the reason (one of REASONS).
        Validity is judged at ``at`` (epoch seconds: when the broker took the record, where the
        producer cannot choose it), else now."""
        sig, der = _header(headers, SIG_HEADER), _header(headers, CERT_HEADER)
        if not sig or not der:
            return "unsigned"
        if len(der) > MAX_CERT_BYTES:
            return "bad-certificate"
        c = self._check_cert(bytes(der))
        if c.problem is not None:
            return c.problem
        now = self._clock() if at is None else at
        if not c.not_before <= now <= c.not_after:
            return "expired"
        if hostname not in c.names:
            return "wrong-node"
        if not _verify(c.public, bytes(sig), value):
            return "bad-signature"
        return None
