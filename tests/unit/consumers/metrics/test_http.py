"""gpupipe_consumers.metrics.http: /metrics (plain, gzip), /healthz, basic auth, TLS, web config.

Real sockets on 127.0.0.1 with ephemeral ports; certificates are generated per test session.
"""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import http.client
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.metrics.http import (
    CONTENT_TYPE,
    MetricsServer,
    accepts_gzip,
    load_web_config,
    make_metrics_server,
    parse_web_config,
)
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas import catalog

T_MS = 1_764_460_800_000


def sample(i: int) -> dict:
    rec = {f["name"]: f.get("default") for f in catalog.current("GpuSample").raw["fields"]}
    rec.update(
        timestamp_ms=T_MS,
        hostname=f"node-{i // 8}",
        gpu_index=i % 8,
        uuid=f"GPU-{i:08d}",
        pci_bus_id=f"00000000:{i % 256:02X}:00.0",
        model_name="NVIDIA H200",
        driver_version="570.124.06",
        allocations=[
            {"namespace": "ns", "pod": f"p{i}", "container": "c", "resource_name": None, "replica": None}
        ],
        processes=[],
        gpu_lost=False,
        interval_ms=1000,
        gpu_temp_c=40.0 + i % 30,
        power_w=100.0 + i,
        gpu_util_ratio=(i % 100) / 100,
    )
    return rec


@pytest.fixture
def store() -> SeriesStore:
    s = SeriesStore()
    for i in range(200):
        s.apply_sample(sample(i), 0, time.time() + 3600)  # "seen" in an hour: no expiry during a test
    return s


def serve(store: SeriesStore, **kw) -> MetricsServer:
    return make_metrics_server(store, "127.0.0.1", 0, **kw).start()


@pytest.fixture
def server(store: SeriesStore) -> Iterator[MetricsServer]:
    srv = serve(store)
    try:
        yield srv
    finally:
        srv.close()


def get(
    srv: MetricsServer,
    path: str,
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    if context is not None:
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", srv.port, timeout=10, context=context
        )
    else:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def without_ages(text: bytes) -> list[bytes]:
    clocked = (b"gpupipe_sample_age_seconds{", b"gpupipe_metrics_node_last_sample_age_seconds{")
    return [
        ln
        for ln in text.splitlines()
        if not ln.startswith(clocked) and not ln.startswith(b"gpupipe_metrics_pipeline_delay_seconds ")
    ]


# -- /metrics --------------------------------------------------------------------------------------
def test_metrics_plain(server, store):
    status, headers, body = get(server, "/metrics")
    assert status == 200
    assert headers["content-type"] == CONTENT_TYPE
    assert int(headers["content-length"]) == len(body)
    assert "content-encoding" not in headers
    assert without_ages(body) == without_ages(store.render())
    assert body.count(b"\nDCGM_FI_DEV_GPU_TEMP{") == 200


def test_metrics_gzip(server, store):
    status, headers, body = get(server, "/metrics", {"Accept-Encoding": "gzip, deflate"})
    assert status == 200
    assert headers["content-encoding"] == "gzip"
    assert headers["vary"] == "Accept-Encoding"
    plain = gzip.decompress(body)
    assert without_ages(plain) == without_ages(store.render())
    assert len(body) < len(plain) / 5
    # the GPU part's gzip member is reused while the store is unchanged
    hits = server.gzip.hits
    get(server, "/metrics", {"Accept-Encoding": "gzip"})
    assert server.gzip.hits == hits + 1
    # a sample whose text differs (one of the same text keeps every chunk, and so the gzip)
    store.apply_sample({**sample(1), "gpu_temp_c": 99.0}, 0, time.time() + 3600)
    _, _, body2 = get(server, "/metrics", {"Accept-Encoding": "gzip"})
    assert server.gzip.hits == hits + 1
    assert without_ages(gzip.decompress(body2)) == without_ages(store.render())


def test_gzip_is_one_member(server, store):
    """One gzip member (curl and wget read only the first of several), valid CRC and size."""
    for _ in range(2):  # the second answer reuses the cached deflate blocks of the GPU part
        _, _, body = get(server, "/metrics", {"Accept-Encoding": "gzip"})
        d = zlib.decompressobj(31)
        out = d.decompress(body) + d.flush()
        assert d.eof and d.unused_data == b""
        assert without_ages(out) == without_ages(store.render())


def test_gzip_of_an_empty_store():
    srv = serve(SeriesStore())
    try:
        _, headers, body = get(srv, "/metrics", {"Accept-Encoding": "gzip"})
        assert headers["content-encoding"] == "gzip"
        assert gzip.decompress(body).startswith(b"# HELP gpupipe_metrics_gpus ")
    finally:
        srv.close()


def test_gzip_refused_with_q0(server):
    _, headers, _ = get(server, "/metrics", {"Accept-Encoding": "gzip;q=0, identity"})
    assert "content-encoding" not in headers


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (None, False),
        ("", False),
        ("gzip", True),
        ("GZIP", True),
        ("deflate, gzip;q=1.0, *;q=0.5", True),
        ("x-gzip", True),
        ("*", True),
        ("gzip;q=0", False),
        ("gzip;q=0.0, br", False),
        ("identity", False),
        ("gzip;q=bad", False),
    ],
)
def test_accepts_gzip(header, ok):
    assert accepts_gzip(header) is ok


def test_unknown_path_and_index(server):
    assert get(server, "/nope")[0] == 404
    status, _, body = get(server, "/")
    assert status == 200 and b"/metrics" in body
    assert get(server, "/metrics?x=1")[0] == 200


def test_keep_alive_connection_serves_several_requests(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read()
    finally:
        conn.close()


def test_port_in_use_is_a_config_error(server, store):
    with pytest.raises(ConfigError, match="cannot listen"):
        make_metrics_server(store, "127.0.0.1", server.port)


# -- /healthz --------------------------------------------------------------------------------------
def test_healthz_default_ok(server):
    status, headers, body = get(server, "/healthz")
    assert status == 200 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"status": "ok"}


def test_healthz_callable(store):
    state = {"result": True}

    def health():
        r = state["result"]
        if isinstance(r, Exception):
            raise r
        return r

    srv = serve(store, health=health)
    try:
        assert get(srv, "/healthz")[0] == 200
        state["result"] = (True, {"partitions": 3, "lag": 12})
        status, _, body = get(srv, "/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok", "partitions": 3, "lag": 12}
        state["result"] = (False, {"reason": "no partitions assigned"})
        status, _, body = get(srv, "/healthz")
        assert status == 503 and json.loads(body) == {
            "status": "unhealthy",
            "reason": "no partitions assigned",
        }
        state["result"] = False
        assert get(srv, "/healthz")[0] == 503
        state["result"] = RuntimeError("broker gone")
        status, _, body = get(srv, "/healthz")
        assert status == 503 and json.loads(body)["error"] == "RuntimeError: broker gone"
    finally:
        srv.close()


# -- basic auth ------------------------------------------------------------------------------------
def bcrypt_hash(password: str) -> str:
    import bcrypt  # basic auth needs the bcrypt package (a dependency of the metrics consumer)

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_basic_auth(tmp_path, store):
    hashed = bcrypt_hash("s3cret")
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    srv = serve(store, web_config=cfg)
    try:
        status, headers, _ = get(srv, "/metrics")
        assert status == 401 and headers["www-authenticate"].startswith("Basic realm=")
        assert get(srv, "/metrics", basic("prometheus", "wrong"))[0] == 401
        assert get(srv, "/metrics", basic("nobody", "s3cret"))[0] == 401
        assert get(srv, "/metrics", {"Authorization": "Basic !!!"})[0] == 401
        assert get(srv, "/metrics", {"Authorization": "Bearer abc"})[0] == 401
        status, _, body = get(srv, "/metrics", basic("prometheus", "s3cret"))
        assert status == 200 and b"DCGM_FI_DEV_GPU_TEMP" in body
        assert get(srv, "/metrics", basic("prometheus", "s3cret"))[0] == 200  # cached check
        assert get(srv, "/healthz")[0] == 200  # probes need no password
        assert get(srv, "/")[0] == 401
    finally:
        srv.close()


def test_basic_auth_can_cover_healthz(store):
    hashed = bcrypt_hash("pw")
    cfg = parse_web_config({"basic_auth_users": {"u": hashed}})
    srv = serve(store, web_config=cfg, open_paths=frozenset())
    try:
        assert get(srv, "/healthz")[0] == 401
        assert get(srv, "/healthz", basic("u", "pw"))[0] == 200
    finally:
        srv.close()


# -- TLS -------------------------------------------------------------------------------------------
PKI_FILES = ("ca", "server_crt", "server_key", "client_crt", "client_key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, as PEM files:
    made with the ``cryptography`` package when installed, else with the ``openssl`` command."""
    d = tmp_path_factory.mktemp("pki")
    try:
        import cryptography  # noqa: F401
    except ImportError:  # pragma: no cover - cryptography comes with confluent-kafka[schemaregistry]
        return pki_with_openssl(d)
    return pki_with_cryptography(d)


def pki_with_openssl(d: Path) -> dict[str, Path]:
    openssl = shutil.which("openssl")
    assert openssl, "neither the cryptography package nor the openssl command is available"

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_ext = [
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]
    run(
        "req",
        "-x509",
        *ec,
        *ca_ext,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=test CA",
    )
    exts = {
        "server": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "client": "subjectAltName=DNS:prometheus.scrape\nextendedKeyUsage=clientAuth\n",
    }
    for who, ext in exts.items():
        (d / f"{who}.ext").write_text(ext)
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        sign = [
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            f"{who}.ext",
        ]
        run("x509", "-req", "-in", f"{who}.csr", *sign, "-out", f"{who}.crt")
    names = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    return {k: d / n for k, n in zip(PKI_FILES, names, strict=True)}


def pki_with_cryptography(d: Path) -> dict[str, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("gpupipe test CA"))
        .issuer_name(name("gpupipe test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage, sans: list | None) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    srv_key, srv_cert = leaf(
        "localhost",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    cli_key, cli_cert = leaf(
        "prometheus", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("prometheus.scrape")]
    )
    files = {
        "ca": d / "ca.crt",
        "server_crt": d / "server.crt",
        "server_key": d / "server.key",
        "client_crt": d / "client.crt",
        "client_key": d / "client.key",
    }
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["server_crt"].write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    files["client_crt"].write_bytes(cli_cert.public_bytes(serialization.Encoding.PEM))
    write_key(srv_key, files["server_key"])
    write_key(cli_key, files["client_key"])
    return files


def client_context(pki: dict[str, Path], with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if with_cert:
        ctx.load_cert_chain(str(pki["client_crt"]), str(pki["client_key"]))
    return ctx


def test_tls(tmp_path, pki, store):
    # an absolute path, and a relative one (resolved against the web config's folder)
    (tmp_path / "server.key").write_bytes(pki["server_key"].read_bytes())
    cfg = tmp_path / "web.yml"
    cfg.write_text(f"tls_server_config:\n  cert_file: {pki['server_crt']}\n  key_file: server.key\n")
    srv = serve(store, web_config=cfg)
    try:
        assert srv.scheme == "https"
        status, _, body = get(srv, "/metrics", context=client_context(pki))
        assert status == 200 and b"DCGM_FI_DEV_GPU_TEMP" in body
        status, headers, body = get(srv, "/metrics", {"Accept-Encoding": "gzip"}, context=client_context(pki))
        assert headers["content-encoding"] == "gzip" and b"DCGM_FI_DEV_GPU_TEMP" in gzip.decompress(body)
        with pytest.raises(ssl.SSLCertVerificationError):
            get(srv, "/metrics", context=ssl.create_default_context())  # an unknown CA
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            get(srv, "/metrics")  # plain HTTP to a TLS port
        # a client that never finishes its handshake does not block other clients
        idle = socket.create_connection(("127.0.0.1", srv.port))
        try:
            assert get(srv, "/healthz", context=client_context(pki))[0] == 200
        finally:
            idle.close()
    finally:
        srv.close()


def test_tls_with_openssl_made_certificates(tmp_path, store):
    """The fallback certificate maker (openssl CLI) works too, client certificates included."""
    files = pki_with_openssl(tmp_path)
    doc = {
        "tls_server_config": {
            "cert_file": str(files["server_crt"]),
            "key_file": str(files["server_key"]),
            "client_auth_type": "RequireAndVerifyClientCert",
            "client_ca_file": str(files["ca"]),
        }
    }
    srv = serve(store, web_config=parse_web_config(doc))
    try:
        assert get(srv, "/healthz", context=client_context(files, with_cert=True))[0] == 200
    finally:
        srv.close()


def test_tls_with_client_certificates(tmp_path, pki, store):
    doc = {
        "tls_server_config": {
            "cert_file": str(pki["server_crt"]),
            "key_file": str(pki["server_key"]),
            "client_auth_type": "RequireAndVerifyClientCert",
            "client_ca_file": str(pki["ca"]),
            "min_version": "TLS12",
        },
        "http_server_config": {"headers": {"X-Frame-Options": "deny"}},
    }
    srv = serve(store, web_config=parse_web_config(doc))
    try:
        status, headers, _ = get(srv, "/metrics", context=client_context(pki, with_cert=True))
        assert status == 200 and headers["x-frame-options"] == "deny"
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            get(srv, "/metrics", context=client_context(pki))
    finally:
        srv.close()


def test_tls_and_basic_auth_together(tmp_path, pki, store):
    hashed = bcrypt_hash("pw")
    doc = {
        "tls_server_config": {"cert_file": str(pki["server_crt"]), "key_file": str(pki["server_key"])},
        "basic_auth_users": {"prom": hashed},
    }
    srv = serve(store, web_config=parse_web_config(doc))
    try:
        assert get(srv, "/metrics", context=client_context(pki))[0] == 401
        assert get(srv, "/metrics", basic("prom", "pw"), context=client_context(pki))[0] == 200
    finally:
        srv.close()


# -- web config errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"tls_config": {}}, "unsupported key(s) tls_config"),
        ({"tls_server_config": {"cert_file": "a"}}, "needs cert_file/cert and key_file/key"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": ["TLS_NOPE"]}},
            "unknown cipher_suites TLS_NOPE",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "curve_preferences": ["P-1"]}},
            "unknown curve_preferences P-1",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "client_auth_type": "Sometimes"}},
            "client_auth_type 'Sometimes' not supported",
        ),
        (
            {
                "tls_server_config": {
                    "cert_file": "a",
                    "key_file": "b",
                    "client_auth_type": "RequireAnyClientCert",
                }
            },
            "RequireAnyClientCert needs client_ca_file or client_ca",
        ),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "client_allowed_sans": ["x"]}},
            "client_allowed_sans needs a client_auth_type that reads a client certificate",
        ),
        ({"rate_limit": {"every": "1s"}}, "rate_limit takes 'interval' and 'burst'"),
        ({"rate_limit": {"interval": "1s", "burst": -1}}, "rate_limit.burst must not be negative"),
        (
            {"tls_server_config": {"cert_file": "a", "key_file": "b", "min_version": "SSL3"}},
            "unknown TLS version",
        ),
        (
            {"tls_server_config": {"cert_file": "missing.crt", "key_file": "missing.key"}},
            "cannot load TLS files",
        ),
        ({"basic_auth_users": {"u": "plaintext"}}, "not a bcrypt hash"),
        ({"basic_auth_users": ["u"]}, "must map user names"),
        ({"http_server_config": {"rate_limit": 1}}, "http_server_config supports only"),
        (["x"], "expected a mapping"),
    ],
)
def test_web_config_errors(doc, message, tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse_web_config(doc, base_dir=tmp_path)
    assert message in str(exc.value)


def test_web_config_without_client_ca_verifies_against_the_system_roots(pki):
    """As Go with no ClientCAs (the toolkit's web_config_noAuth.good.yml)."""
    doc = {
        "tls_server_config": {
            "cert_file": str(pki["server_crt"]),
            "key_file": str(pki["server_key"]),
            "client_auth_type": "VerifyClientCertIfGiven",
        }
    }
    assert parse_web_config(doc).ssl_context.verify_mode == ssl.CERT_OPTIONAL


def test_web_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="web config"):
        load_web_config(tmp_path / "missing.yml")
    bad = tmp_path / "bad.yml"
    bad.write_text("basic_auth_users: [\n")
    with pytest.raises(ConfigError):
        load_web_config(bad)
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    cfg = load_web_config(empty)
    assert cfg.ssl_context is None and cfg.users == {}
