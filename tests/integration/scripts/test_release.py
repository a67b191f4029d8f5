"""`make release` (scripts/release): one version into a wheel, a chart repository and an OCI registry.

The chart is installed as a user would: `helm template` from dist/ served as a chart repository over
HTTP, and from a real OCI registry (Debian's docker-registry, the CNCF distribution registry) that the
release pushed to. The image needs a Docker engine, which this machine lacks: the release says so in
one line and, with RELEASE_IMAGE=yes, fails; with buildah (tests/integration/deploy/test_image.py) the
release builds both images and writes them as OCI archives.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import threading
import tomllib
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.deploy.test_helm_chart import helm  # noqa: F401 (the session fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def _release(tmp: Path, helm_bin: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "scripts" / "release")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={
            **os.environ,
            "DIST": str(tmp),
            "HELM": helm_bin,
            "PY": str(REPO / ".venv" / "bin" / "python"),
            **env,
        },
    )


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A real OCI registry on loopback, storage in tmp_path."""
    port = free_port()
    cfg = tmp_path / "registry.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}},
                "http": {"addr": f"127.0.0.1:{port}"},
                "log": {"level": "warn"},
            }
        )
    )
    log = (tmp_path / "registry.log").open("wb")
    proc = popen(
        [shutil.which("docker-registry") or "docker-registry", "serve", str(cfg)], stdout=log, stderr=log
    )
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "registry.log").read_text()
                threading.Event().wait(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(proc)
        log.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """tmp_path/dist served over HTTP, as a static chart repository is."""
    dist = tmp_path / "dist"
    dist.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(dist))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, name="chart-repo", daemon=True)
    t.start()
    try:
        yield dist, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def _image_of(docs: list[dict]) -> set[str]:
    return {
        c["image"]
        for d in docs
        if d and d.get("kind") in ("DaemonSet", "Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }


def test_make_release_gives_a_wheel_a_chart_repository_and_an_oci_chart_of_one_version(
    helm: str,  # noqa: F811
    registry: str,
    served: tuple[Path, str],
) -> None:
    dist, url = served
    res = _release(
        dist,
        helm,
        RELEASE_IMAGE="no",
        CHART_REPO_URL=url,
        CHART_OCI=f"oci://{registry}/charts",
        CHART_OCI_FLAGS="--plain-http",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"release: version {VERSION} into {dist}/" in res.stderr
    assert "release: image  not built (RELEASE_IMAGE=no)" in res.stderr

    # the wheel: the version, the CLI and its data files
    with zipfile.ZipFile(dist / f"gpupipe-{VERSION}-py3-none-any.whl") as whl:
        names = set(whl.namelist())
        meta = whl.read(f"gpupipe-{VERSION}.dist-info/METADATA").decode()
        entry = whl.read(f"gpupipe-{VERSION}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {VERSION}\n" in meta
    assert "gpupipe = gpupipe.commands.cli:main" in entry and "[gpupipe.commands]" in entry
    assert {
        "gpupipe_schemas/GpuSample.avsc",
        "gpupipe_schemas/XidEvent.avsc",
        "gpupipe_consumers/alerts/rules/nvlink5_decode.json",
        "gpupipe_producer/kubelet/api.proto",
    } <= names
    # every installed top-level name is ours: no generic `schemas` or `producer` to clash with
    tops = {n.split("/", 1)[0] for n in names if not n.startswith(f"gpupipe-{VERSION}.")}
    assert tops == {"gpupipe", "gpupipe_producer", "gpupipe_consumers", "gpupipe_schemas"}, tops

    # the chart repository: index.yaml names the chart at its URL, and helm installs from it
    index = yaml.safe_load((dist / "index.yaml").read_text())
    (entry_,) = index["entries"]["gpupipe"]
    assert (entry_["version"], entry_["appVersion"]) == (VERSION, VERSION)
    assert entry_["urls"] == [f"{url}/gpupipe-{VERSION}.tgz"]
    out = subprocess.run(
        [helm, "template", "rel", "gpupipe", "--repo", url, "--version", VERSION, "--namespace", "gpu"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=dist.parent,  # not the repository: its gpupipe/ package would be taken for a local chart
    )
    assert out.returncode == 0, out.stderr
    assert _image_of(list(yaml.safe_load_all(out.stdout))) == {f"gpupipe:{VERSION}"}

    # the OCI registry the release pushed to
    out = subprocess.run(
        [helm, "template", "rel", f"oci://{registry}/charts/gpupipe", "--version", VERSION, "--plain-http"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=dist.parent,
    )
    assert out.returncode == 0, out.stderr
    assert _image_of(list(yaml.safe_load_all(out.stdout))) == {f"gpupipe:{VERSION}"}


def test_the_chart_says_the_version_pyproject_says() -> None:
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "gpupipe" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)


def test_an_image_release_without_a_docker_engine_is_one_line(helm: str, tmp_path: Path) -> None:  # noqa: F811
    # A docker CLI whose engine does not answer, as on this machine kind, wherever the test runs.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    # RELEASE_BUILDER=docker: as where buildah is not installed either.
    res = _release(tmp_path / "dist", helm, RELEASE_IMAGE="yes", RELEASE_BUILDER="docker", PATH=path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        "release: image: no Docker engine answers (docker info failed) and no buildah; "
        "start one, install buildah, or run with RELEASE_IMAGE=no"
    )
    # auto: the rest is released, the line says how
    res = _release(tmp_path / "dist", helm, RELEASE_BUILDER="docker", PATH=path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (
        "release: image  skipped: no Docker engine answers (docker info) and no buildah; build it where "
        f"one runs: docker build -t gpupipe:{VERSION} ."
    ) in res.stderr
    assert (tmp_path / "dist" / f"gpupipe-{VERSION}.tgz").is_file()
