"""exporter-toolkit web config (the version dcgm-exporter pins, v0.16.0), read into a :class:`WebConfig`.

Every key of the toolkit's schema is accepted, so a file written for dcgm-exporter starts the
service; where Python's ``ssl`` differs from Go's ``crypto/tls`` the start-up log says so once. Any
other key, or a wrong value, is a startup error that names it, so a typo never leaves the endpoint
open. Relative paths are read relative to the file.
More (the keys, the differences): docs/architecture.md, "Module notes", ``web/config.py``.
"""

from __future__ import annotations

import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupipe.common.durations import parse_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.common.logs import fields
from gpupipe.common.yaml_file import load_yaml

log = logging.getLogger("gpupipe.web")

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_NONE,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "RequireClientCert": ssl.CERT_REQUIRED,  # the toolkit's old name of RequireAnyClientCert
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_KEYS = frozenset(
    {
        "cert_file",
        "key_file",
        "cert",
        "key",
        "client_ca_file",
        "client_ca",
        "client_auth_type",
        "cipher_suites",
        "curve_preferences",
        "min_version",
        "max_version",
        "prefer_server_cipher_suites",
        "client_allowed_sans",
    }
)
TOP_KEYS = frozenset({"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"})
#: Go cipher-suite names -> OpenSSL names (TLS 1.2 and older; Go does not configure TLS 1.3 suites).
CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
#: TLS 1.3 suites: Go accepts their names but cannot configure them (neither can Python's ssl).
TLS13_CIPHERS = frozenset(
    {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
)
#: client_auth_type values under which the toolkit checks client_allowed_sans (a certificate is read).
SAN_AUTH = frozenset(
    {"RequireAnyClientCert", "RequireClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"}
)
#: Headers the toolkit lets a web config set, with the values it allows (None: any value).
HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}


class RateLimiter:
    """Token bucket: ``burst`` requests at once, refilled one per ``interval_s`` (toolkit semantics)."""

    def __init__(self, interval_s: float, burst: int) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self._tokens = float(burst)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if self.interval_s > 0:
                self._tokens = min(self.burst, self._tokens + (now - self._t) / self.interval_s)
            self._t = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


@dataclass
class WebConfig:
    """What a web-config file asks for: a server TLS context, basic-auth users, extra headers..."""

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)
    source: str = "<none>"
    allowed_sans: frozenset[str] = frozenset()  # client certificate SANs allowed (empty: any)
    rate_limit: RateLimiter | None = None
    files: tuple[Path, ...] = ()  # the certificate, key and CA files it names (watched for rotation)


def load_web_config(path: str | Path) -> WebConfig:
    """Read an exporter-toolkit web-config YAML file; :class:`ConfigError` says what is wrong."""
    p = Path(path)
    doc = load_yaml(p, "web config") or {}
    return parse_web_config(doc, base_dir=p.parent, source=str(p))


def parse_web_config(
    doc: Mapping[str, Any], *, base_dir: Path = Path("."), source: str = "<dict>"
) -> WebConfig:
    if not isinstance(doc, Mapping):
        raise ConfigError(f"web config {source}: expected a mapping at the top level")
    unknown = set(doc) - TOP_KEYS
    if unknown:
        raise ConfigError(f"web config {source}: unsupported key(s) {', '.join(sorted(unknown))}")
    cfg = WebConfig(source=source)
    tls = doc.get("tls_server_config")
    if tls:
        cfg.ssl_context, cfg.allowed_sans = _tls_context(tls, base_dir, source)
        cfg.files = tuple(
            (base_dir / str(tls[k])).resolve()
            for k in ("cert_file", "key_file", "client_ca_file")
            if isinstance(tls, Mapping) and tls.get(k)
        )
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, Mapping):
        raise ConfigError(f"web config {source}: basic_auth_users must map user names to bcrypt hashes")
    for user, hashed in users.items():
        h = str(hashed).encode()
        if not h.startswith((b"$2a$", b"$2b$", b"$2y$")):
            raise ConfigError(f"web config {source}: the password of {user!r} is not a bcrypt hash")
        cfg.users[str(user)] = h
    if cfg.users:
        try:
            import bcrypt  # noqa: F401
        except ImportError as exc:
            raise ConfigError(f"web config {source}: basic_auth_users needs the 'bcrypt' package") from exc
    http_cfg = doc.get("http_server_config") or {}
    if not isinstance(http_cfg, Mapping) or set(http_cfg) - {"headers", "http2"}:
        raise ConfigError(f"web config {source}: http_server_config supports only 'headers' (and 'http2')")
    cfg.headers = {str(k): str(v) for k, v in (http_cfg.get("headers") or {}).items()}
    for k, v in cfg.headers.items():
        if k not in HEADERS:
            raise ConfigError(f"web config {source}: HTTP header {k!r} can not be configured")
        allowed = HEADERS[k]
        if allowed is not None and v not in allowed:
            raise ConfigError(
                f"web config {source}: invalid value for {k}: expected one of {allowed}, got {v!r}"
            )
    rl = doc.get("rate_limit")
    if rl:
        cfg.rate_limit = _rate_limit(rl, source)
    return cfg


def _rate_limit(rl: Any, source: str) -> RateLimiter | None:
    if not isinstance(rl, Mapping) or set(rl) - {"interval", "burst"}:
        raise ConfigError(f"web config {source}: rate_limit takes 'interval' and 'burst'")
    try:
        burst = int(rl.get("burst") or 0)
        interval = rl.get("interval") or "0s"
        # Go's YAML reads a bare number into a time.Duration as nanoseconds
        interval_s = (
            interval / 1e9 if isinstance(interval, int | float) else parse_duration_ms(str(interval)) / 1000
        )
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"web config {source}: rate_limit: {exc}") from exc
    if interval_s <= 0:
        return None  # the toolkit: "set to 0 to disable rate limiter", whatever the burst
    if burst < 0:
        raise ConfigError(f"web config {source}: rate_limit.burst must not be negative")
    if burst == 0:  # the toolkit's limiter then allows nothing: every request gets 429
        log.warning(
            "web config %s: rate_limit burst 0 with an interval: every request is answered 429", source
        )
    return RateLimiter(interval_s, burst)


def _strings(v: Any, key: str, source: str) -> list[str]:
    if v is None:
        return []
    if not isinstance(v, Sequence) or isinstance(v, str):
        raise ConfigError(f"web config {source}: {key} must be a list")
    return [str(x) for x in v]


def _tls_context(tls: Any, base_dir: Path, source: str) -> tuple[ssl.SSLContext, frozenset[str]]:
    """The server's TLS context and the client SANs allowed, from ``tls_server_config``."""
    auth = _tls_client_auth(tls, source)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _set_versions(ctx, tls, source)
    _set_ciphers(ctx, tls, source)
    _set_curves(ctx, tls, source)
    if tls.get("prefer_server_cipher_suites"):
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    sans = _client_checks(tls, auth, source)
    _load_tls_files(ctx, tls, base_dir, auth, source)
    if auth in ("RequireAnyClientCert", "RequireClientCert"):
        log.warning(
            "web config %s: RequireAnyClientCert also verifies the client certificate against the CA "
            "(Python's ssl cannot require a certificate without verifying it)",
            source,
        )
    return ctx, sans


def _tls_client_auth(tls: Any, source: str) -> str:
    """The keys of ``tls_server_config`` checked; its ``client_auth_type``."""
    if not isinstance(tls, Mapping):
        raise ConfigError(f"web config {source}: tls_server_config must be a mapping")
    unknown = set(tls) - TLS_KEYS
    if unknown:
        raise ConfigError(
            f"web config {source}: unsupported tls_server_config key(s) {', '.join(sorted(unknown))}"
        )
    has_cert = bool(tls.get("cert_file") or tls.get("cert"))
    has_key = bool(tls.get("key_file") or tls.get("key"))
    if not (has_cert and has_key):
        raise ConfigError(f"web config {source}: tls_server_config needs cert_file/cert and key_file/key")
    if (tls.get("cert_file") and tls.get("cert")) or (tls.get("key_file") and tls.get("key")):
        log.info("web config %s: cert_file/key_file given with inline cert/key: the files are used", source)
    auth = tls.get("client_auth_type") or "NoClientCert"
    if auth not in CLIENT_AUTH:
        raise ConfigError(
            f"web config {source}: client_auth_type {auth!r} not supported (use {', '.join(CLIENT_AUTH)})"
        )
    return auth


def _set_versions(ctx: ssl.SSLContext, tls: Mapping[str, Any], source: str) -> None:
    try:
        ctx.minimum_version = TLS_VERSIONS[tls.get("min_version") or "TLS12"]
        if tls.get("max_version"):
            ctx.maximum_version = TLS_VERSIONS[tls["max_version"]]
    except KeyError as exc:
        raise ConfigError(
            f"web config {source}: unknown TLS version {exc} (use {', '.join(TLS_VERSIONS)})"
        ) from exc


def _set_ciphers(ctx: ssl.SSLContext, tls: Mapping[str, Any], source: str) -> None:
    ciphers = _strings(tls.get("cipher_suites"), "cipher_suites", source)
    if not ciphers:
        return
    bad = [c for c in ciphers if c not in CIPHERS and c not in TLS13_CIPHERS]
    if bad:
        raise ConfigError(f"web config {source}: unknown cipher_suites {', '.join(bad)}")
    legacy = [CIPHERS[c] for c in ciphers if c in CIPHERS]
    try:
        if legacy:
            ctx.set_ciphers(":".join(legacy))
        else:  # only TLS 1.3 names: as in Go, no TLS 1.2 suite is left, so only TLS 1.3 connects
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"web config {source}: cipher_suites: {exc}") from exc


def _set_curves(ctx: ssl.SSLContext, tls: Mapping[str, Any], source: str) -> None:
    curves = _strings(tls.get("curve_preferences"), "curve_preferences", source)
    if not curves:
        return
    bad = [c for c in curves if c not in CURVES]
    if bad:
        raise ConfigError(f"web config {source}: unknown curve_preferences {', '.join(bad)}")
    ctx.set_ecdh_curve(CURVES[curves[0]])
    if len(curves) > 1:
        log.info(
            "web config %s: curve_preferences: Python's ssl uses the first curve only (%s)",
            source,
            curves[0],
        )


def _client_checks(tls: Mapping[str, Any], auth: str, source: str) -> frozenset[str]:
    """The client SANs allowed, once the client settings are known to fit together."""
    sans = frozenset(_strings(tls.get("client_allowed_sans"), "client_allowed_sans", source))
    if sans and auth not in SAN_AUTH:  # the toolkit would ignore them and let every client in
        raise ConfigError(
            f"web config {source}: client_allowed_sans needs a client_auth_type that reads a client "
            f"certificate ({', '.join(sorted(SAN_AUTH))}), not {auth}"
        )
    if auth == "RequestClientCert":
        log.info(
            "web config %s: RequestClientCert: no client certificate is requested (none is used)", source
        )
    has_ca = bool(tls.get("client_ca_file") or tls.get("client_ca"))
    if has_ca and auth == "NoClientCert":
        raise ConfigError(
            f"web config {source}: client CA's have been configured without a Client Auth Policy "
            "(set client_auth_type)"
        )
    if not has_ca and auth in ("RequireAnyClientCert", "RequireClientCert"):
        raise ConfigError(
            f"web config {source}: client_auth_type {auth} needs client_ca_file or client_ca here (Python's "
            "ssl cannot require a client certificate without verifying it)"
        )
    return sans


def _load_tls_files(
    ctx: ssl.SSLContext, tls: Mapping[str, Any], base_dir: Path, auth: str, source: str
) -> None:
    """The server's certificate and key, and the CAs that client certificates are verified against."""
    verify = CLIENT_AUTH[auth] != ssl.CERT_NONE
    try:
        with _pem_files(tls, base_dir) as (cert, key):
            ctx.load_cert_chain(cert, key)
        ctx.verify_mode = CLIENT_AUTH[auth]
        if verify:
            if tls.get("client_ca_file"):
                ctx.load_verify_locations(cafile=str((base_dir / str(tls["client_ca_file"])).resolve()))
            elif tls.get("client_ca"):
                ctx.load_verify_locations(cadata=str(tls["client_ca"]))
            else:  # as Go with no ClientCAs: the system's roots
                ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
                log.warning(
                    "web config %s: %s without client_ca_file/client_ca: client certificates are verified "
                    "against the system's CA certificates",
                    source,
                    auth,
                )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"web config {source}: cannot load TLS files: {exc}") from exc


class _pem_files:
    """Paths of the certificate and key: the files named, or inline PEM written to private temp files
    (deleted as soon as the context has loaded them)."""

    def __init__(self, tls: Mapping[str, Any], base_dir: Path) -> None:
        self.tls, self.base_dir, self.tmp = tls, base_dir, []

    def _one(self, file_key: str, inline_key: str) -> str:
        if self.tls.get(file_key):
            return str((self.base_dir / str(self.tls[file_key])).resolve())
        fd, name = tempfile.mkstemp(prefix="gpupipe-web-", suffix=".pem")
        with os.fdopen(fd, "w") as f:
            f.write(str(self.tls[inline_key]))
        self.tmp.append(name)
        return name

    def __enter__(self) -> tuple[str, str]:
        return self._one("cert_file", "cert"), self._one("key_file", "key")

    def __exit__(self, *exc: object) -> None:
        for name in self.tmp:
            os.unlink(name)


#: How often a served web config looks at its files for a change (a stat of each, no read).
RELOAD_CHECK_S = 1.0


class WebConfigSource:
    """The web config a server applies now, re-read when its file or a file it names changes.

    Certificates are rotated and users revoked while a service runs (cert-manager renews before
    expiry; a Secret update swaps the mounted files). exporter-toolkit re-reads its config for every
    connection; here the files are stat'ed at most every ``check_every_s`` and parsed only when one
    changed. A changed file that does not parse keeps the previous config (a half-written rotation
    must not take the endpoint down or open it), with a warning and a count in ``reload_errors``.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        config: WebConfig | None = None,
        check_every_s: float = RELOAD_CHECK_S,
        clock: Any = time.monotonic,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self._cfg = load_web_config(self.path) if self.path is not None else config or WebConfig()
        self.check_every_s = check_every_s
        self._clock = clock
        self._checked = clock()
        self._signature = self._stat()
        self._lock = threading.Lock()
        self.reloads = 0
        self.reload_errors = 0

    @classmethod
    def of(cls, web: WebConfigSource | WebConfig | str | Path | None) -> WebConfigSource:
        """A source from what callers hold: a path, a parsed config, nothing, or a source already."""
        if isinstance(web, WebConfigSource):
            return web
        if isinstance(web, WebConfig):
            return cls(config=web)
        return cls(web)

    def current(self) -> WebConfig:
        if self.path is None or self._clock() - self._checked < self.check_every_s:
            return self._cfg
        with self._lock:
            if self._clock() - self._checked >= self.check_every_s:
                self._checked = self._clock()
                signature = self._stat()
                if signature != self._signature:
                    self._signature = signature
                    self._reload()
        return self._cfg

    def _reload(self) -> None:
        assert self.path is not None
        try:
            fresh = load_web_config(self.path)
        except Exception as exc:  # ConfigError, and whatever an odd value makes the parser raise:
            # this runs in the HTTP accept loop, which must outlive any file an operator writes
            self.reload_errors += 1
            log.warning("web config changed but cannot be used, the previous one stays: %s", exc)
            return
        old = self._cfg.rate_limit
        new = fresh.rate_limit
        if old is not None and new is not None and (old.interval_s, old.burst) == (new.interval_s, new.burst):
            fresh.rate_limit = old  # an unchanged limit keeps its bucket: a reload is no free burst
        self._cfg = fresh
        self.reloads += 1
        log.info("web config reloaded", extra=fields(source=str(self.path), reloads=self.reloads))

    def _stat(self) -> tuple[tuple[str, int, int] | None, ...]:
        if self.path is None:
            return ()
        out: list[tuple[str, int, int] | None] = []
        for p in (self.path, *self._cfg.files):
            try:
                st = os.stat(p)
            except OSError:
                out.append(None)
                continue
            out.append((str(p), st.st_mtime_ns, st.st_size))
        return tuple(out)
