"""The node agent under exactly the privileges the shipped DaemonSet gives it.

The real CLI (``tests/fake_nvml_cli.py produce --source nvml``, fake NVML only) runs in a process
whose UID, groups and capabilities are derived from ``deploy/kubernetes/producer-daemonset.yaml``
(the image's ``USER`` where the manifest sets no ``runAsUser``), via ``setpriv``. Around it, a tree
shaped like a node's, all created by root here:

* ``var/lib/kubelet/pod-resources/kubelet.sock``: a real gRPC PodResources server (the fake
  kubelet), socket ``srwxr-xr-x root:root`` as the kubelet leaves it;
* ``var/lib/gpupipe/spool``: the hostPath spool, ``root:root 0700``;
* ``run/gpupipe/kmsg/kmsg.sock``: the socket of the manifest's ``kmsg-relay`` command, run here as
  root like the privileged sidecar (``srw------- root:root``), serving a root-owned file of raw
  ``/dev/kmsg`` records;
* the real ``/dev/kmsg`` with this host's ``kernel.dmesg_restrict`` for the refused case.

What must hold: samples and a kernel-log XID reach the real broker with pod attribution, the spool
is on disk, the process really runs with the manifest's (lack of) capabilities, and an input it
may not open is one log line and a metric while the agent stays healthy.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpupipe.kafka import topics
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import wait_for
from tests.conftest import REPO, free_port
from tests.fake_nvml import FakeNvml
from tests.integration.kafka_util import read_all
from tests.kmsg_relay_proc import RelayProcess
from tests.kubelet_fake import FakeKubelet

pytestmark = pytest.mark.integration

CODEC = AvroCodec()
MANIFEST = REPO / "deploy" / "kubernetes" / "producer-daemonset.yaml"


#: containerd/CRI-O default capability set (what a container has unless it drops them).
RUNTIME_DEFAULT_CAPS = [
    "chown",
    "dac_override",
    "fsetid",
    "fowner",
    "mknod",
    "net_raw",
    "setgid",
    "setuid",
    "setfcap",
    "setpcap",
    "net_bind_service",
    "sys_chroot",
    "kill",
    "audit_write",
]


def manifest_privileges() -> tuple[int, int, list[str], bool]:
    """(uid, gid, capabilities, no_new_privs) of the producer container, as Kubernetes applies them."""
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "producer"]
    sc = c.get("securityContext", {})
    image_user = [
        ln.split()[1] for ln in (REPO / "Dockerfile").read_text().splitlines() if ln.startswith("USER ")
    ]
    uid = int(sc.get("runAsUser", image_user[-1] if image_user else 0))
    gid = int(sc.get("runAsGroup", uid))
    caps = sc.get("capabilities", {})
    kept = [] if "ALL" in caps.get("drop", []) else list(RUNTIME_DEFAULT_CAPS)
    kept += [a.lower() for a in caps.get("add", [])]
    return uid, gid, kept, sc.get("allowPrivilegeEscalation") is False


def setpriv_prefix() -> list[str]:
    """setpriv arguments giving a process what the container runtime gives the producer.

    For a non-root UID, capabilities.add only reaches the bounding set: Kubernetes sets no ambient
    capabilities, so none is effective after exec. For UID 0 the added ones are effective.
    """
    uid, gid, kept, nnp = manifest_privileges()
    tool = shutil.which("setpriv")
    assert tool, "setpriv (util-linux) is needed to run the agent under the manifest's privileges"
    caps = ",".join(["-all", *(f"+{a}" for a in kept)])
    cmd = [tool, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", f"--bounding-set={caps}"]
    cmd.append(f"--inh-caps={caps if uid == 0 else '-all'}")
    if nnp:
        cmd.append("--no-new-privs")
    return cmd


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short root-owned directory (a unix socket path must stay under 108 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="gpn-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _status(pid: int) -> dict[str, str]:
    out = {}
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = ln.partition(":")
        out[k] = v.strip()
    return out


class NodeTree:
    """Root-owned paths shaped like a GPU node's, as kubelet, the manifest and the relay leave them."""

    def __init__(self, root: Path, fake: FakeNvml) -> None:
        self.root = root
        podres = root / "var/lib/kubelet/pod-resources"
        podres.mkdir(parents=True, mode=0o755)
        self.spool = root / "var/lib/gpupipe/spool"
        self.spool.mkdir(parents=True)
        os.chmod(self.spool, 0o700)
        relay_dir = root / "run/gpupipe/kmsg"
        relay_dir.mkdir(parents=True, mode=0o755)
        self.ring = root / "kmsg-ring"
        self.ring.write_text("")
        os.chmod(self.ring, 0o600)
        self.relay = RelayProcess(self.ring, relay_dir / "kmsg.sock").start()
        self.pod_logs = root / "var/log/pods"
        self.pod_logs.mkdir(parents=True, mode=0o755)
        self.gpu = fake.gpus[2]
        pods = {
            "pod_resources": [
                {
                    "name": "train-0",
                    "namespace": "ml",
                    "containers": [
                        {
                            "name": "trainer",
                            "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": [self.gpu.uuid]}],
                        }
                    ],
                }
            ]
        }
        self.kubelet = FakeKubelet(pods, socket_path=str(podres / "kubelet.sock"))
        os.chmod(self.kubelet.socket_path, 0o755)  # srwxr-xr-x root:root

    def close(self) -> None:
        self.kubelet.close()
        self.relay.stop()


def _agent(tree: NodeTree, kafka: str, prefix: str, port: int, kmsg_path: str) -> subprocess.Popen[str]:
    cmd = [
        *setpriv_prefix(),
        sys.executable,
        str(REPO / "tests" / "fake_nvml_cli.py"),
        "produce",
        "--source",
        "nvml",
        "--interval",
        "200ms",
        "--bootstrap-servers",
        kafka,
        "--topic-prefix",
        prefix,
        "--kubelet-socket",
        tree.kubelet.socket_path,
        "--kmsg-path",
        kmsg_path,
        "--spool-dir",
        str(tree.spool),
        "--pod-logs-dir",
        str(tree.pod_logs),
        "--listen",
        f"127.0.0.1:{port}",
        "--log-format",
        "text",
    ]
    env = {
        **os.environ,
        "GPUPIPE_FAKE_NVML": "H100:8",
        "NODE_NAME": "gpu-node-1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metric(port: int, line_prefix: str) -> float | None:
    _, body = _get(f"http://127.0.0.1:{port}/metrics")
    for ln in body.decode().splitlines():
        if ln.startswith(line_prefix + " "):
            return float(ln.rsplit(" ", 1)[1])
    return None


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_the_agent_works_under_the_manifests_privileges(
    kafka: str, topic_prefix: str, node_root: Path
) -> None:
    fake = FakeNvml.node("H100", 8)  # the same GPUs fake_nvml_cli builds for GPUPIPE_FAKE_NVML=H100:8
    tree = NodeTree(node_root, fake)
    port = free_port()
    proc = _agent(tree, kafka, topic_prefix, port, str(tree.relay.sock))
    try:
        wait_for(
            lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200 or proc.poll() is not None, 30, "up"
        )
        assert proc.poll() is None, "the agent exited under the manifest's privileges"
        # The kernel logs, the relay serves: raw /dev/kmsg records, an Xid 79 on GPU 2 among them.
        bus = tree.gpu.pci_bus_id.lower().replace("00000000:", "0000:").rsplit(".", 1)[0]
        xid = f"NVRM: Xid (PCI:{bus}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
        with tree.ring.open("a") as ring:
            ring.write(f"6,41,2000000,-;usb 1-1: new device\n3,42,2100000,-;{xid}\n")
        wait_for(
            lambda: (_metric(port, 'gpupipe_producer_xid_events_total{kind="xid"}') or 0) >= 1, 20, "XID"
        )
        assert _metric(port, 'gpupipe_producer_source_up{input="kubelet"}') == 1
        assert _metric(port, 'gpupipe_producer_source_up{input="kmsg"}') == 1
        assert _metric(port, "gpupipe_producer_xid_spool_on_disk") == 1
        assert _metric(port, "gpupipe_producer_xid_spool_write_errors_total") == 0
        st = _status(proc.pid)
        uid, gid, _, _ = manifest_privileges()
        assert st["Uid"].split()[0] == str(uid) and st["Gid"].split()[0] == str(gid)
        assert int(st["CapEff"], 16) == 0, "no effective capability at all"
        assert st["NoNewPrivs"] == "1"
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 200, body
        assert oct(tree.relay.sock.stat().st_mode & 0o777) == "0o600" and tree.relay.sock.stat().st_uid == 0
        rc, err = _stop(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
        tree.close()
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    spool_files = {p.name: p.stat() for p in tree.spool.iterdir()}
    assert spool_files["kmsg.cursor"].st_uid == uid and (spool_files["kmsg.cursor"].st_mode & 0o077) == 0
    assert (tree.spool / "kmsg.cursor").read_text().split()[1] == "42"
    xids = [CODEC.decode(m.value()).record for m in read_all(kafka, topic_prefix + topics.XID, expect=1)]
    assert [(x["xid"], x["gpu_index"], [a["pod"] for a in x["allocations"]]) for x in xids] == [
        (79, 2, ["train-0"])
    ]
    samples = [
        CODEC.decode(m.value()).record for m in read_all(kafka, topic_prefix + topics.SAMPLES, expect=8)
    ]
    held = {s["gpu_index"]: [a["pod"] for a in s["allocations"]] for s in samples}
    assert held[2] == ["train-0"] and held[0] == []


def test_a_kernel_log_it_may_not_open_is_one_line_and_a_metric(
    kafka: str, topic_prefix: str, node_root: Path
) -> None:
    # /dev/kmsg itself, opened without CAP_SYSLOG: EPERM where kernel.dmesg_restrict=1 (this host's
    # setting decides which outcome is right; both are asserted, neither skipped).
    restrict = Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"
    fake = FakeNvml.node("H100", 8)
    tree = NodeTree(node_root, fake)
    port = free_port()
    proc = _agent(tree, kafka, topic_prefix, port, "/dev/kmsg")
    try:
        wait_for(
            lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200 or proc.poll() is not None, 30, "up"
        )
        if restrict:
            errs = 'gpupipe_producer_input_errors_total{input="kmsg",reason="EPERM"}'
            wait_for(lambda: (_metric(port, errs) or 0) >= 1, 20, "EPERM counted")
            assert _metric(port, 'gpupipe_producer_source_up{input="kmsg"}') == 0
        else:
            wait_for(lambda: _metric(port, 'gpupipe_producer_source_up{input="kmsg"}') == 1, 20, "kmsg read")
        built = _metric(port, "gpupipe_producer_samples_built_total") or 0
        wait_for(
            lambda: (_metric(port, "gpupipe_producer_samples_built_total") or 0) >= built + 16, 20, "ticks"
        )
        assert proc.poll() is None and _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        rc, err = _stop(proc)
    finally:
        if proc.poll() is None:
            _stop(proc)
        tree.close()
    assert rc == 0, err[-3000:]
    if restrict:
        assert err.count("unreadable") == 1, err[-3000:]
        assert "Operation not permitted" in err
