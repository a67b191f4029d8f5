"""gpupipe_producer.samples.pid_pods: cgroup text -> pod UID / container id (pure), the cached resolver."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupipe_producer.samples.enrich import ProcPod
from gpupipe_producer.samples.pid_pods import (
    PidPodResolver,
    parse_cgroup,
    parse_pod_log_dir,
    pod_names_by_uid,
)

UID = "5f1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
CID = "3f0a5e8b9c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f"

CASES = [
    # cgroup v2, systemd driver, containerd
    (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        ProcPod(True, UID, CID),
    ),
    # cgroup v2, cgroupfs driver
    (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", ProcPod(True, UID, CID)),
    # guaranteed QoS (no QoS level), systemd + cri-o
    (
        f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
        ProcPod(True, UID, CID),
    ),
    # cgroup v1: one line per controller; docker
    (
        f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n"
        "1:name=systemd:/system.slice/docker.service\n",
        ProcPod(True, UID, CID),
    ),
    (
        f"4:pids:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}"
        f".slice/docker-{CID}.scope\n",
        ProcPod(True, UID, CID),
    ),
    # kind / k3s: nested under another slice
    (
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        ProcPod(True, UID, CID),
    ),
    # cri-o's conmon is not a container process
    (f"0::/kubepods/burstable/pod{UID}/crio-conmon-{CID}.scope\n", ProcPod(True, UID, None)),
    # the pod cgroup itself (pause process on some runtimes)
    (f"0::/kubepods/burstable/pod{UID}\n", ProcPod(True, UID, None)),
    (f"0::/kubepods/burstable/pod{UID.upper()}/{CID}\n", ProcPod(True, UID, CID)),
    # host processes
    ("0::/system.slice/nvidia-persistenced.service\n", ProcPod(False)),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", ProcPod(False)),
    ("0::/\n", ProcPod(False)),
    # kubepods without a recognisable pod UID
    ("0::/kubepods/burstable\n", ProcPod(True)),
    ("", None),
    ("\n\n", None),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_parse_cgroup(text: str, expected: ProcPod | None) -> None:
    assert parse_cgroup(text) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (f"ml-train_llama-ft-0_{UID}", ("ml-train", "llama-ft-0", UID)),
        (
            f"kube-system_coredns-5d78c9869d-x2x7q_{UID.upper()}",
            ("kube-system", "coredns-5d78c9869d-x2x7q", UID),
        ),
        ("ml-train_llama-ft-0", None),
        (f"a_b_c_{UID}", None),
        ("ns_pod_not-a-uid", None),
        (f"_pod_{UID}", None),
    ],
)
def test_parse_pod_log_dir(name: str, expected: tuple[str, str, str] | None) -> None:
    assert parse_pod_log_dir(name) == expected


def test_pod_names_by_uid() -> None:
    assert pod_names_by_uid([f"a_b_{UID}", "junk", "x_y_z"]) == {UID: ("a", "b")}


def _proc_tree(root: Path, pid: int, cgroup: str) -> None:
    d = root / "proc" / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)


def test_resolver_names_pods_and_caches(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 100, f"0::/kubepods/burstable/pod{UID}/{CID}\n")
    _proc_tree(tmp_path, 200, "0::/system.slice/sshd.service\n")
    logs = tmp_path / "pods"
    (logs / f"team-a_dev-pod-1_{UID}" / "main").mkdir(parents=True)
    now = [0.0]
    r = PidPodResolver(str(tmp_path / "proc"), str(logs), ttl_s=60, clock=lambda: now[0])
    assert r(100) == ProcPod(True, UID, CID, "team-a", "dev-pod-1")
    assert r(200) == ProcPod(False)
    assert r(300) is None and r.read_errors == 1
    # Cached: the files may go away, the answer stays until the TTL.
    (tmp_path / "proc" / "100" / "cgroup").unlink()
    assert r(100) == ProcPod(True, UID, CID, "team-a", "dev-pod-1")
    now[0] = 61.0
    assert r(100) is None


def test_resolver_without_pod_logs_keeps_the_uid(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 100, f"0::/kubepods/pod{UID}/{CID}\n")
    r = PidPodResolver(str(tmp_path / "proc"), str(tmp_path / "no-such-dir"))
    assert r(100) == ProcPod(True, UID, CID)


def test_resolver_relists_pod_logs_for_a_new_uid(tmp_path: Path) -> None:
    logs = tmp_path / "pods"
    logs.mkdir()
    now = [0.0]
    r = PidPodResolver(str(tmp_path / "proc"), str(logs), ttl_s=600, clock=lambda: now[0])
    _proc_tree(tmp_path, 1, f"0::/kubepods/pod{UID}/{CID}\n")
    assert r(1) == ProcPod(True, UID, CID)
    (logs / f"ns_new-pod_{UID}").mkdir()
    now[0] = 2.0
    _proc_tree(tmp_path, 2, f"0::/kubepods/pod{UID}/{CID}\n")
    assert r(2) == ProcPod(True, UID, CID, "ns", "new-pod")


def test_static_pod_uids_are_recognised() -> None:
    # Review §2: static/mirror pods use a 32-hex config hash as UID (no dashes).
    from gpupipe_producer.samples.pid_pods import parse_cgroup, parse_pod_log_dir

    uid = "6d2b4f7a9c1e3b5d7f9a1c3e5b7d9f1a"
    cid = "a" * 64
    v2 = (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{uid}.slice/cri-containerd-{cid}.scope\n"
    )
    got = parse_cgroup(v2)
    assert got is not None and (got.pod_uid, got.container_id) == (uid, cid)
    v1 = f"11:devices:/kubepods/besteffort/pod{uid}/{cid}\n"
    assert parse_cgroup(v1).pod_uid == uid  # type: ignore[union-attr]
    assert parse_pod_log_dir(f"kube-system_nvidia-dcgm-node-1_{uid}") == (
        "kube-system",
        "nvidia-dcgm-node-1",
        uid,
    )
