"""The shared Kubernetes client: configuration, authenticated calls, watch streams and the one error type.

Against the two API server doubles over real sockets: tests/k8s_api_fake.py (nodes: GET, PATCH) and
tests/k8s_pods_fake.py (pods: list and watch, 410 as an event or as an HTTP status).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import pytest

from gpupipe.clients import kube
from gpupipe.clients.kube import GONE, KubeApiError, KubeClient, KubeConfig, kube_config
from gpupipe.common.errors import ConfigError, GpupipeError
from tests.k8s_api_fake import FakeKubeApi
from tests.k8s_pods_fake import FakePodApi


def client(url: str, token: Path | None = None, timeout_s: float = 2.0) -> KubeClient:
    return KubeClient(KubeConfig(url, str(token) if token else None, None), timeout_s=timeout_s)


def test_kube_config_explicit_and_in_cluster(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("t")
    cfg = kube_config("https://api:6443/", str(tok), needed_by="--cordon")
    assert cfg.api_url == "https://api:6443" and cfg.token_file == str(tok)
    with pytest.raises(ConfigError, match="--kube-api-url must start with http"):
        kube_config("api:6443", str(tok), needed_by="--cordon")
    with pytest.raises(ConfigError, match=r"--kube-token-file .* does not exist"):
        kube_config("https://api", str(tmp_path / "missing"), needed_by="--cordon")
    with pytest.raises(ConfigError, match=r"--kube-ca-file .* does not exist"):
        kube_config("https://api", str(tok), str(tmp_path / "missing"), needed_by="--cordon")
    with pytest.raises(ConfigError):
        kube_config(environ={}, sa_dir=tmp_path, needed_by="--cordon")
    (tmp_path / "ca.crt").write_text("x")
    in_cluster = kube_config(
        environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        sa_dir=tmp_path,
        needed_by="--cordon",
    )
    assert in_cluster == KubeConfig("https://10.0.0.1:443", str(tok), str(tmp_path / "ca.crt"))
    v6 = kube_config(environ={"KUBERNETES_SERVICE_HOST": "fd00::1"}, sa_dir=tmp_path, needed_by="--cordon")
    assert v6.api_url == "https://[fd00::1]:443"
    explicit_ca = kube_config(
        None, None, str(tok), environ={"KUBERNETES_SERVICE_HOST": "h"}, sa_dir=tmp_path, needed_by="x"
    )
    assert explicit_ca.ca_file == str(tok)  # --kube-ca-file wins over the service account's


def test_the_missing_config_error_names_the_callers_flags(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as cordon:
        kube_config(environ={}, sa_dir=tmp_path, needed_by="--cordon", otherwise="or use --dry-run")
    assert str(cordon.value) == (
        "--cordon needs the Kubernetes API: run in a pod with a service account, or give "
        "--kube-api-url and --kube-token-file (or use --dry-run)"
    )
    with pytest.raises(ConfigError) as podmeta:
        kube_config(environ={"KUBERNETES_SERVICE_HOST": "h"}, sa_dir=tmp_path, needed_by="--pod-metadata api")
    assert str(podmeta.value).startswith("--pod-metadata api needs the Kubernetes API")
    assert "--cordon" not in str(podmeta.value) and "--dry-run" not in str(podmeta.value)


def test_flags_and_config_from_args(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    kube.add_arguments(p.add_argument_group("k8s"))
    tok = tmp_path / "token"
    tok.write_text("t")
    args = p.parse_args(["--kube-api-url", "http://127.0.0.1:1/", "--kube-token-file", str(tok)])
    cfg = kube.config_from_args(args, needed_by="--cordon")
    assert cfg == KubeConfig("http://127.0.0.1:1", str(tok), None)


def test_constructing_a_client_does_no_network_io() -> None:
    c = client("http://127.0.0.1:9")  # nothing listens there: only a call finds out
    with pytest.raises(KubeApiError) as exc:
        c.get("/api/v1/nodes")
    assert exc.value.status is None and "ConnectionRefusedError" in str(exc.value)
    with pytest.raises(ValueError, match="http"):
        client("ftp://api")
    with pytest.raises(ValueError):
        client("http://")


def test_one_error_type_with_the_status() -> None:
    exc = KubeApiError(403, "forbidden")
    assert isinstance(exc, GpupipeError)
    assert (exc.status, exc.message, str(exc)) == (403, "forbidden", "403: forbidden")
    assert str(KubeApiError(None, "refused")) == "no answer: refused"


def test_get_and_patch_with_the_token_read_for_every_request(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("one\n")
    with FakeKubeApi(["n1"], token="one") as api:
        c = client(api.url, tok)
        assert c.get("/api/v1/nodes/n1")["metadata"]["name"] == "n1"
        assert api.requests[-1].headers["authorization"] == "Bearer one"
        assert api.requests[-1].headers["accept"] == "application/json"
        tok.write_text("two\n")  # a projected token rotated under the running process
        with pytest.raises(KubeApiError) as exc:
            c.get("/api/v1/nodes/n1")
        assert exc.value.status == 401 and api.requests[-1].headers["authorization"] == "Bearer two"
        api.token = "two"
        node = c.patch("/api/v1/nodes/n1", {"spec": {"unschedulable": True}})
        assert node["spec"]["unschedulable"] is True
        assert api.requests[-1].headers["content-type"] == kube.STRATEGIC_MERGE_PATCH
        assert api.patches("n1") == [{"spec": {"unschedulable": True}}]
        assert len(c.get("/api/v1/nodes")["items"]) == 1


def test_failures_carry_the_status_and_the_servers_message(tmp_path: Path) -> None:
    with FakeKubeApi(["n1"]) as api:
        c = client(api.url, timeout_s=0.5)
        with pytest.raises(KubeApiError) as missing:
            c.get("/api/v1/nodes/ghost")
        assert (missing.value.status, missing.value.message) == (404, 'nodes "ghost" not found')
        api.fail_next(500)
        with pytest.raises(KubeApiError, match="500: injected failure 500"):
            c.get("/api/v1/nodes/n1")
        with pytest.raises(KubeApiError) as wrong_type:
            c.request("PATCH", "/api/v1/nodes/n1", {}, "text/plain")
        assert wrong_type.value.status == 415
        api.set_delay(2.0)
        with pytest.raises(KubeApiError) as slow:
            c.get("/api/v1/nodes/n1")
        assert slow.value.status is None and "timed out" in str(slow.value)


def test_unreadable_token_fails_before_anything_is_sent(tmp_path: Path) -> None:
    with FakeKubeApi(["n1"]) as api:
        c = client(api.url, tmp_path / "gone")
        with pytest.raises(KubeApiError, match="cannot read token file") as exc:
            c.get("/api/v1/nodes/n1")
        assert exc.value.status is None and api.requests == []
        (tmp_path / "gone").write_bytes(b"\xff\xfe half-written")  # a rotation gone wrong: not text
        with pytest.raises(KubeApiError, match=r"token file .* is not UTF-8 text"):
            c.get("/api/v1/nodes/n1")
        assert api.requests == []


def test_a_path_in_the_api_url_prefixes_every_call() -> None:
    with FakeKubeApi(["n1"]) as api:
        c = client(api.url + "/k8s/clusters/c1/")
        with pytest.raises(KubeApiError):
            c.get("/api/v1/nodes/n1")
        assert api.requests[-1].path == "/k8s/clusters/c1/api/v1/nodes/n1"


def _pod_watch_path(rv: str, timeout_s: int = 1) -> str:
    return (
        "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&watch=true&allowWatchBookmarks=true"
        f"&resourceVersion={rv}&timeoutSeconds={timeout_s}"
    )


def test_watch_streams_events_until_the_server_ends_it() -> None:
    with FakePodApi(token="tok") as api:
        api.add_pod("ns", "before", "n1")
        api.add_pod("ns", "elsewhere", "n2")
        with client(api.url).watch(_pod_watch_path("1000"), idle_timeout_s=5) as w:
            with pytest.raises(KubeApiError) as exc:
                w.open()
            assert exc.value.status == 401
    with FakePodApi() as api:
        api.add_pod("ns", "before", "n1")
        with client(api.url).watch(_pod_watch_path("1000"), idle_timeout_s=5) as w:
            w.open()
            events = list(w)  # timeoutSeconds=1: the server ends the stream with a bookmark
        names = [(t, o["metadata"].get("name")) for t, o in events]
        assert names == [("ADDED", "before"), ("BOOKMARK", None)]


@pytest.mark.parametrize("as_http", [False, True])
def test_a_compacted_version_is_gone_as_an_event_or_as_http(as_http: bool) -> None:
    with FakePodApi(gone_as_http=as_http) as api:
        api.add_pod("ns", "p", "n1")
        api.compact()
        w = client(api.url).watch(_pod_watch_path("1000"), idle_timeout_s=5)
        with w, pytest.raises(KubeApiError) as exc:
            w.open()
            w.next_event()
        assert exc.value.status == GONE
        assert "too old resource version" in exc.value.message


def test_abort_unblocks_a_quiet_watch_from_another_thread() -> None:
    with FakePodApi() as api:
        w = client(api.url).watch(_pod_watch_path("1000", timeout_s=60), idle_timeout_s=60)
        w.open()
        result: list[object] = []

        def read() -> None:
            try:
                result.append(w.next_event())
            except KubeApiError as exc:
                result.append(exc)

        t = threading.Thread(target=read)
        t.start()
        time.sleep(0.2)
        started = time.monotonic()
        w.abort()
        t.join(5)
        w.close()
        assert not t.is_alive() and time.monotonic() - started < 5
        assert result and (result[0] is None or isinstance(result[0], KubeApiError))
