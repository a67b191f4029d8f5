"""A real Kubernetes API server for tests: kube-apiserver and etcd (scripts/kube-local builds them).

Nothing else of a cluster runs (no controllers, scheduler or kubelet): what the tests need is the
API itself, with its validation, strategic-merge PATCH, watches, RBAC and TokenRequest. An admin
token (``system:masters``) sets up objects; the identities under test are ServiceAccounts whose
tokens the API server itself issues, so RBAC decides exactly as in a cluster.
"""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group

START_TIMEOUT_S = 120.0


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:300]}")
        self.status = status


@dataclass
class KubeApiServer:
    url: str
    ca_file: Path
    admin_token: str
    dir: Path

    def _ctx(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {token or self.admin_token}")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, timeout=30, context=self._ctx()) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        return json.loads(raw) if raw and raw[:1] in (b"{", b"[") else raw.decode()

    def ready(self) -> bool:
        try:
            return self.request("GET", "/readyz") == "ok"
        except (ApiError, OSError):
            return False

    def create(self, path: str, obj: dict[str, Any]) -> Any:
        return self.request("POST", path, obj)

    def apply_all(self, objs: list[dict[str, Any]]) -> None:
        """Create each object (namespaced ones in their namespace), as `kubectl create` would."""
        for o in objs:
            self.create(collection_path(o), o)

    def service_account_token(self, namespace: str, name: str, path: Path) -> Path:
        """A token for the ServiceAccount, issued by the API server (TokenRequest), written to ``path``."""
        res = self.create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600},
            },
        )
        path.write_text(res["status"]["token"])
        return path


_GROUPS = {
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "ReplicaSet": ("/apis/apps/v1", "replicasets", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "Job": ("/apis/batch/v1", "jobs", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
}


def collection_path(obj: dict[str, Any]) -> str:
    base, plural, namespaced = _GROUPS[obj["kind"]]
    if namespaced:
        return f"{base}/namespaces/{obj['metadata']['namespace']}/{plural}"
    return f"{base}/{plural}"


def object_path(obj: dict[str, Any]) -> str:
    return f"{collection_path(obj)}/{obj['metadata']['name']}"


def binaries() -> tuple[str, str]:
    res = subprocess.run(
        [str(REPO / "scripts" / "kube-local")], capture_output=True, text=True, timeout=3000, cwd=REPO
    )
    assert res.returncode == 0, f"could not find or build kube-apiserver and etcd:\n{res.stderr[-3000:]}"
    apiserver, etcd = res.stdout.strip().splitlines()[-1].split()
    return apiserver, etcd


def start_kube_apiserver(d: Path) -> Iterator[KubeApiServer]:
    apiserver, etcd = binaries()
    d.mkdir(parents=True, exist_ok=True)
    client, peer, port = free_port(), free_port(), free_port()
    etcd_log = (d / "etcd.log").open("wb")
    etcd_proc = popen(
        [etcd, "--data-dir", str(d / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{client}",
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
         f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}",
         "--log-level", "warn"],
        stdout=etcd_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (d / "sa.pub").write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    admin = secrets.token_hex(16)
    (d / "tokens.csv").write_text(f'{admin},admin,admin-uid,"system:masters"\n')
    api_log = (d / "apiserver.log").open("wb")
    api_proc = popen(
        [apiserver, f"--etcd-servers=http://127.0.0.1:{client}", f"--secure-port={port}",
         "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--cert-dir={d / 'certs'}",
         "--service-account-issuer=https://kubernetes.default.svc",
         f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
         f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
         "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true", "--v=0"],
        stdout=api_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        ca = d / "certs" / "apiserver.crt"
        deadline = time.monotonic() + START_TIMEOUT_S
        server = KubeApiServer(f"https://127.0.0.1:{port}", ca, admin, d)
        while True:
            for proc, log in ((etcd_proc, "etcd.log"), (api_proc, "apiserver.log")):
                assert proc.poll() is None, (d / log).read_text()[-3000:]
            if ca.exists() and server.ready():
                break
            assert time.monotonic() < deadline, (d / "apiserver.log").read_text()[-3000:]
            time.sleep(0.3)
        yield server
    finally:
        stop_group(api_proc)
        stop_group(etcd_proc)
        api_log.close()
        etcd_log.close()
