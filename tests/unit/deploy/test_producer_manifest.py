"""The shipped producer DaemonSet, Dockerfile and agent agree on privileges and paths.

The runtime proof (the agent under these exact privileges against root-owned node paths) is
tests/integration/producer/test_privileges.py; this file pins the manifest's shape so the two
cannot drift apart.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from gpupipe.commands.cli import apply_env_defaults, build_parser
from tests.paths import REPO

REPO = REPO
MANIFEST = REPO / "deploy" / "kubernetes" / "producer-daemonset.yaml"


def producer_pod() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    return doc["spec"]["template"]["spec"]


def container(name: str) -> dict[str, Any]:
    pod = producer_pod()
    for c in pod["containers"] + pod.get("initContainers", []):
        if c["name"] == name:
            return c
    raise LookupError(name)


def test_the_agent_runs_as_root_with_no_capability_and_nothing_more() -> None:
    sc = container("producer")["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert not sc.get("privileged")
    pod = producer_pod()
    assert pod["automountServiceAccountToken"] is False
    # Only the agent gets an API token (its pod-metadata watch), never the privileged kmsg relay.
    token_mounts = {
        c["name"]
        for c in (*pod["containers"], *pod.get("initContainers", ()))
        for m in c.get("volumeMounts", ())
        if m["name"] == "kube-api-access"
    }
    assert token_mounts == {"producer"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_only_the_kmsg_relay_is_privileged_and_it_serves_the_agents_kmsg_path() -> None:
    relay = container("kmsg-relay")
    assert relay["securityContext"]["privileged"] is True
    assert relay["restartPolicy"] == "Always"  # a native sidecar: started before the agent
    program, *flags = relay["command"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert (
        scripts[program] == "gpupipe_producer.xid.kmsg_relay:main"
    )  # installed in the image with the package
    given = dict(f.removeprefix("--").split("=", 1) for f in flags)
    assert given["device"] == "/dev/kmsg"
    args = container("producer")["args"]
    sock = args[args.index("--kmsg-path") + 1]
    assert given["socket"] == sock and relay["startupProbe"]["exec"]["command"] == ["test", "-S", sock]
    mounts = {m["name"]: m["mountPath"] for m in container("producer")["volumeMounts"]}
    relay_mounts = {m["name"]: m["mountPath"] for m in relay["volumeMounts"]}
    assert sock.startswith(mounts["kmsg-socket"] + "/")
    assert relay_mounts["kmsg-socket"] == mounts["kmsg-socket"]
    assert "kmsg" not in {v["name"] for v in producer_pod()["volumes"]}, "no /dev/kmsg hostPath any more"


def test_probes_and_paths_match_the_agent_defaults() -> None:
    c = container("producer")
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Review §2 command.py:216-221 + manifest: readiness only and no priority class before.
    assert producer_pod()["priorityClassName"] == "system-node-critical"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 also while NVML is released
    parser = build_parser()
    apply_env_defaults(parser, {e["name"]: e["value"] for e in c["env"] if "value" in e})
    ns = parser.parse_args(c["args"])
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert ns.spool_dir in mounts
    # The release file (nvidia-smi -r, driver upgrades) is on the spool's hostPath: a node script sees it.
    assert ns.nvml_release_file is None  # default: <spool-dir>/nvml-release (agent_config)
    assert str(Path(ns.kubelet_socket).parent) in mounts
    assert ns.nvml_timeout == 2000
    listen_port = int(ns.listen.rsplit(":", 1)[1])
    assert {p["containerPort"] for p in c["ports"]} == {listen_port}


def test_the_dockerfile_user_is_the_consumers_and_the_producer_overrides_it() -> None:
    docker = (REPO / "Dockerfile").read_text()
    users = [ln.split()[1] for ln in docker.splitlines() if ln.startswith("USER ")]
    assert users == ["10001"]
    assert container("producer")["securityContext"]["runAsUser"] != int(users[0])
