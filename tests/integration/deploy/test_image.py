"""The images, built by a real OCI builder as ``make release`` builds them, and run.

``scripts/release`` with no Docker engine builds the Dockerfile's two targets with buildah
(``scripts/image-build``, ``--isolation chroot``) on a base made from Debian's packages (mmdebstrap;
Docker Hub cannot be reached) and writes both as OCI archives. Then each image runs: ``gpupipe
--version``, the consumers' user, the agent image's imports, and the node agent itself in the agent
image's root file system under the DaemonSet's UID, capabilities and no-new-privileges, on the
suite's NVML double, publishing to a real broker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from tests.conftest import REPO, free_port
from tests.hygiene import popen, stop_group
from tests.integration.kafka_util import read_all
from tests.integration.producer.test_privileges import setpriv_prefix

pytestmark = pytest.mark.integration

VERSION = "0.1.0"
#: The suite's NVML double, copied into the agent's root file system (the image carries no tests):
#: every module of it, so a new part of the double needs no edit here.
DOUBLE = ("__init__.py", *sorted(p.name for p in (REPO / "tests").glob("fake_nvml*.py")))


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, int]]]:
    """target -> (image, size in bytes), from one ``make release`` run with buildah; the images are
    removed with the module (the cached base stays), so runs leave no image behind."""
    dist = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "DIST": str(dist), "RELEASE_IMAGE": "yes", "RELEASE_BUILDER": "buildah"}
    env |= {"IMAGE": "localhost/gpupipe-test", "PY": str(REPO / ".venv" / "bin" / "python")}
    res = subprocess.run(
        [str(REPO / "scripts" / "release")], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500
    )
    assert res.returncode == 0, res.stderr[-4000:]
    built = {}
    for line in res.stderr.splitlines():  # release: image  NAME (SIZE bytes), ARCHIVE
        if line.startswith("release: image  localhost/"):
            name, size, archive = line.split()[2], int(line.split("(")[1].split()[0]), line.rsplit(" ", 1)[1]
            assert Path(archive).stat().st_size > size // 4, archive  # the OCI archive is there
            built["agent" if name.startswith("localhost/gpupipe-test-agent:") else "gpupipe"] = (name, size)
    assert set(built) == {"gpupipe", "agent"}, res.stderr[-3000:]
    print(f"image sizes: {built}")
    try:
        yield built
    finally:
        subprocess.run(["buildah", "rmi", "--force", *(n for n, _ in built.values())], capture_output=True)


class Container:
    """A buildah working container of an image, removed with the test."""

    def __init__(self, image: str) -> None:
        self.id = subprocess.check_output(["buildah", "from", "--quiet", image], text=True).strip()

    def run(self, *argv: str, user: str | None = None) -> str:
        cmd = ["buildah", "run", "--isolation", "chroot"]
        if user:
            cmd += ["--user", user]
        res = subprocess.run([*cmd, self.id, "--", *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    def mount(self) -> Path:
        return Path(subprocess.check_output(["buildah", "mount", self.id], text=True).strip())

    def remove(self) -> None:
        subprocess.run(["buildah", "umount", self.id], capture_output=True)
        subprocess.run(["buildah", "rm", self.id], capture_output=True)


@pytest.fixture
def container() -> Iterator[Callable[[str], Container]]:
    made: list[Container] = []

    def make(image: str) -> Container:
        c = Container(image)
        made.append(c)
        return c

    yield make
    for c in made:
        c.remove()


def test_both_images_say_their_version_and_the_agent_image_is_smaller(images, container) -> None:
    (full, full_size), (agent, agent_size) = images["gpupipe"], images["agent"]
    for image in (full, agent):
        assert container(image).run("gpupipe", "--version").strip() == f"gpupipe {VERSION}"
    assert container(full).run("id", "-u").strip() == "10001"  # the consumers' user (Dockerfile USER)
    # The agent image carries none of the consumers' dependencies: about half the size.
    assert agent_size < full_size * 0.7, (agent_size, full_size)


def test_the_agent_image_imports_every_producer_module_and_no_consumer_dependency(images, container) -> None:
    probe = (
        "import importlib, importlib.util, pkgutil, gpupipe_producer\n"
        "mods = [m.name for m in pkgutil.walk_packages(gpupipe_producer.__path__, 'gpupipe_producer.')]\n"
        "for m in mods: importlib.import_module(m)\n"
        "omitted = ('pyiceberg', 'duckdb', 'pyarrow', 'opentelemetry')\n"
        "gone = [d for d in omitted if importlib.util.find_spec(d)]\n"
        "print(len(mods), gone)\n"
    )
    count, gone = container(images["agent"][0]).run("python3", "-c", probe).split(" ", 1)
    assert int(count) > 30 and gone.strip() == "[]"


def test_the_node_agent_runs_in_its_image_under_the_daemonsets_privileges(
    images, container, kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    ensure_topics(kafka, [topics.SAMPLES, topics.XID, topics.TOPOLOGY], prefix=topic_prefix)
    root = container(images["agent"][0]).mount()
    work = root / "opt" / "gpupipe-test"
    (work / "tests").mkdir(parents=True)
    for name in DOUBLE:
        shutil.copy(REPO / "tests" / name, work / "tests" / name)
    (work / "kmsg").write_text("")
    (work / "spool").mkdir(mode=0o700)
    port = free_port()
    setpriv = ["/usr/bin/setpriv", *setpriv_prefix()[1:]]  # the image's own util-linux
    argv = [
        "/opt/gpupipe/bin/python",
        "/opt/gpupipe-test/tests/fake_nvml_cli.py",
        "produce",
        "--source",
        "nvml",
    ]
    argv += ["--interval", "200ms", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
    argv += ["--kubelet-socket", "", "--kmsg-path", "/opt/gpupipe-test/kmsg", "--no-create-topics"]
    argv += [
        "--spool-dir",
        "/opt/gpupipe-test/spool",
        "--listen",
        f"127.0.0.1:{port}",
        "--log-format",
        "text",
    ]
    env = {"PATH": "/opt/gpupipe/bin:/usr/bin:/bin", "GPUPIPE_FAKE_NVML": "H100:2", "NODE_NAME": "image-node"}
    out = (tmp_path / "agent.log").open("wb")
    chroot = shutil.which("chroot")
    assert chroot, "chroot (coreutils) runs the agent in the image's root file system"
    proc = popen([chroot, str(root), *setpriv, "--", *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        samples = read_all(kafka, topics.with_prefix(topic_prefix, topics.SAMPLES), expect=4, timeout_s=60)
        assert len(samples) >= 4, Path(out.name).read_text()[-3000:]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
        agent = _agent_pid(proc.pid)
        status = dict(ln.split(":", 1) for ln in Path(f"/proc/{agent}/status").read_text().splitlines())
        assert status["Uid"].split()[0] == "0" and int(status["CapEff"].strip(), 16) == 0
        assert status["NoNewPrivs"].strip() == "1"
    finally:
        stop_group(proc)
        out.close()


def _agent_pid(pid: int) -> int:
    """The python process under chroot and setpriv (each execs the next, so usually ``pid`` itself)."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"fake_nvml_cli.py" in cmdline, cmdline
    return pid
