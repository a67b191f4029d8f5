"""The Helm chart deploy/helm/gpupipe: `helm lint`, `helm template` over several values files, every
object validated strictly against the Kubernetes API schemas, and every command line parsed by the CLI.

helm is the real binary (scripts/helm-local builds it from its Go module once when the machine lacks
it, and caches it). Schemas: the `kubernetes-validate` package ships them, so validation is offline.
Prometheus Operator objects have no schema there; they are checked against what they must select,
and the PrometheusRule's rules with the real `promtool`.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpupipe.commands.cli import apply_env_defaults, build_parser
from gpupipe_consumers.alerts.engine.alert_record import ALERTNAMES
from tests.paths import REPO

# A machine without helm builds it first (minutes): more than the default per-test timeout.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

REPO = REPO
CHART = REPO / "deploy" / "helm" / "gpupipe"
VALUES = {"defaults": None} | {
    p.name.removesuffix("-values.yaml"): p for p in sorted(CHART.glob("ci/*.yaml"))
}
K8S_VERSIONS = ("1.26.0", kubernetes_validate.latest_version())
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
MONITORING = ("ServiceMonitor", "PodMonitor", "PrometheusRule")


@pytest.fixture(scope="session")
def helm() -> str:
    res = subprocess.run(
        [str(REPO / "scripts" / "helm-local")], capture_output=True, text=True, timeout=1500, cwd=REPO
    )
    assert res.returncode == 0, f"could not find or build helm:\n{res.stderr[-3000:]}"
    return res.stdout.strip().splitlines()[-1]


def render(helm: str, values: Path | None, *sets: str) -> list[dict[str, Any]]:
    cmd = [helm, "template", "rel", str(CHART), "--namespace", "gpu"]
    if values is not None:
        cmd += ["-f", str(values)]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[dict[str, Any]]]:
    return {name: render(helm, path) for name, path in VALUES.items()}


def _kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def _by_name(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


# -- lint and schemas --------------------------------------------------------------------------------
@pytest.mark.parametrize("values", list(VALUES))
def test_helm_lint_strict(helm: str, values: str) -> None:
    cmd = [helm, "lint", "--strict", str(CHART)]
    if VALUES[values] is not None:
        cmd += ["-f", str(VALUES[values])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "0 chart(s) failed" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("values", list(VALUES))
def test_every_object_validates_strictly(rendered: dict, values: str) -> None:
    docs = rendered[values]
    checked = 0
    for doc in docs:
        if doc["kind"] in MONITORING:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{values}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {exc}"
                )
            checked += 1
    assert checked >= 5 * len(K8S_VERSIONS)  # at least the four workloads and a Service


def test_strict_validation_rejects_an_unknown_field(rendered: dict) -> None:
    ds = copy.deepcopy(_kinds(rendered["defaults"])["DaemonSet"][0])
    ds["spec"]["template"]["spec"]["containers"][0]["hostpid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


# -- references between objects --------------------------------------------------------------------------
@pytest.mark.parametrize("values", list(VALUES))
def test_selectors_and_references_resolve(rendered: dict, values: str) -> None:
    docs = rendered[values]
    services = _by_name(docs, "Service")
    config_maps = _by_name(docs, "ConfigMap")
    accounts = _by_name(docs, "ServiceAccount")
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        tmpl = w["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
        spec = tmpl["spec"]
        if "serviceAccountName" in spec:
            assert spec["serviceAccountName"] in accounts or values == "no-alerts"
        for vol in spec.get("volumes", []):
            if "configMap" in vol and vol["configMap"]["name"] not in config_maps:
                # existingConfigMap in no-alerts; the cluster CA Kubernetes publishes in every namespace
                assert vol["configMap"]["name"] in ("gpupipe-prices", "kube-root-ca.crt", "gpupipe-node-ca")
        ports = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
        assert "metrics" in ports
        for c in spec["containers"]:
            if not c.get("ports"):
                continue  # the producer's kmsg relay serves nothing
            for probe in ("livenessProbe", "readinessProbe"):
                target = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                assert target["port"] in ports
        if w["kind"] == "StatefulSet":
            svc = services[w["spec"]["serviceName"]]
            assert svc["spec"]["clusterIP"] == "None"
    for svc in services.values():
        selected = [
            w
            for w in docs
            if w["kind"] in WORKLOADS
            and svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, svc["metadata"]["name"]


def test_prometheus_operator_objects(rendered: dict, tmp_path: Path) -> None:
    docs = rendered["secured-kafka"]
    kinds = _kinds(docs)
    sm = kinds["ServiceMonitor"][0]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    svc = next(
        s
        for s in kinds["Service"]
        if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    )
    assert svc["metadata"]["name"].endswith("-metrics")
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    pm = kinds["PodMonitor"][0]
    comps = set(pm["spec"]["selector"]["matchExpressions"][0]["values"])
    monitored = {
        w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for w in docs
        if w["kind"] in WORKLOADS
        and pm["spec"]["selector"]["matchLabels"].items()
        <= w["spec"]["template"]["metadata"]["labels"].items()
    }
    assert comps == {"producer", "chargeback", "alerts", "recommend"} and comps <= monitored
    # The series' namespace/pod labels name the GPU's workload or the billed namespace: a target
    # label of the same name must not turn them into exported_namespace/exported_pod, which the
    # dashboards do not read (as deploy/prometheus/*.yml: honor_labels).
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert pm["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    # The PrometheusRule carries deploy/prometheus's rules, and promtool accepts them.
    rule = kinds["PrometheusRule"][0]
    source = yaml.safe_load((REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    res = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for d in docs:
        if d["kind"] in MONITORING:
            assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["namespace"] == "gpu"


def _alertnames(docs: list[dict[str, Any]]) -> list[str]:
    return [
        r["alert"]
        for d in docs
        if d["kind"] == "PrometheusRule"
        for g in d["spec"]["groups"]
        for r in g["rules"]
        if "alert" in r
    ]


def test_the_chart_pages_each_fault_from_one_source(helm: str) -> None:
    """With the PrometheusRule on, the chart's rules share no alert name with the alerts service and
    read no XID series: the alerts service pages XIDs alone. The PromQL fault rules come only on request,
    never while the alerts service posts to Alertmanager, and then under names of their own."""
    docs = render(helm, None, "prometheusRule.enabled=true")
    names = _alertnames(docs)
    assert names and len(names) == len(set(names))
    assert not set(names) & ALERTNAMES
    groups = [g for d in docs if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]]
    rules = [r for g in groups for r in g["rules"]]
    exprs = " ".join(r["expr"] for r in rules)
    assert "XID_ERRORS" not in exprs
    both = ("--set", "prometheusRule.enabled=true", "--set", "prometheusRule.faultRules.enabled=true")
    refused = subprocess.run(
        [helm, "template", "rel", str(CHART), *both],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "paged twice" in refused.stderr
    alone = render(helm, None, both[1], both[3], "alerts.enabled=false")
    names = _alertnames(alone)
    assert len(names) == len(set(names)) and "PromGpuXidFallenOffBus" in names
    assert not set(names) & ALERTNAMES
    assert not [d for d in alone if d["kind"] == "Deployment" and "alerts" in d["metadata"]["name"]]


def test_the_chart_ships_deploys_rules_and_dashboards_without_a_copy(helm: str, tmp_path: Path) -> None:
    # One source: the chart's files are links into deploy/, and a packaged chart carries their contents.
    sources = {
        "files/gpupipe-alerts.rules.yml": REPO / "deploy" / "prometheus" / "gpupipe-alerts.rules.yml",
        "files/gpupipe-faults.rules.yml": REPO / "deploy" / "prometheus" / "gpupipe-faults.rules.yml",
        "files/dashboards": REPO / "deploy" / "grafana" / "dashboards",
    }
    for name, source in sources.items():
        link = CHART / name
        assert link.is_symlink() and link.resolve() == source.resolve(), name
    out = subprocess.run(
        [helm, "package", str(CHART), "-d", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    (tgz,) = tmp_path.glob("*.tgz")
    with tarfile.open(tgz) as tar:
        packed = {m.name.removeprefix("gpupipe/"): m for m in tar.getmembers()}
        for name in ("files/gpupipe-alerts.rules.yml", "files/gpupipe-faults.rules.yml"):
            assert packed[name].isfile()
            rules = tar.extractfile(packed[name])
            assert rules is not None and rules.read() == sources[name].read_bytes()
        dashboards = sorted(n for n in packed if n.startswith("files/dashboards/"))
        assert dashboards == sorted(
            f"files/dashboards/{p.name}" for p in sources["files/dashboards"].glob("*.json")
        )


# -- command lines ---------------------------------------------------------------------------------------
def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of env values and args from earlier variables."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _container_env(c: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = f"secret-{e['valueFrom']['secretKeyRef']['key']}"
        else:
            env[e["name"]] = "from-the-downward-api"
    return env


def _command(c: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    env = _container_env(c)
    return [_expand(a, env) for a in c["args"]], env


def command_lines(docs: list[dict[str, Any]]) -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    for w in docs:
        if w["kind"] in WORKLOADS:
            for c in w["spec"]["template"]["spec"]["containers"]:
                if "args" not in c:
                    continue  # not a gpupipe command (the producer's kmsg relay)
                out.append((w["metadata"]["name"], *_command(c)))
    return out


def parse(args: list[str], env: dict[str, str]) -> Any:
    parser = build_parser()
    apply_env_defaults(parser, env)
    return parser.parse_args(args)


@pytest.mark.parametrize("values", list(VALUES))
def test_every_command_line_parses_with_the_cli(rendered: dict, values: str) -> None:
    lines = command_lines(rendered[values])
    commands = {args[0] for _, args, _ in lines}
    expected = {"produce", "metrics", "chargeback", "alerts", "recommend"} - (
        {"alerts"} if values == "no-alerts" else set()
    )
    assert commands == expected
    for _name, args, env in lines:
        ns = parse(args, env)
        assert callable(ns._run)
        assert ns.bootstrap_servers == env["GPUPIPE_BOOTSTRAP_SERVERS"]
        assert ns.listen.startswith("0.0.0.0:")


def test_secured_kafka_reaches_the_processes_without_secrets_on_the_command_line(rendered: dict) -> None:
    for name, args, env in command_lines(rendered["secured-kafka"]):
        ns = parse(args, env)
        assert ns.topic_prefix == "prod." and ns.schema_registry_url.startswith("https://")
        cfg = dict(kv.split("=", 1) for kv in ns.kafka_config)
        assert cfg["security.protocol"] == "SASL_SSL" and cfg["sasl.mechanism"] == "SCRAM-SHA-512"
        assert cfg["sasl.username"] == "secret-username" and cfg["sasl.password"] == "secret-password"
        assert cfg["ssl.ca.location"] == "/etc/gpupipe/kafka-tls/ca.crt"
        assert not any("secret-" in a for a in args), name
    workloads = [d for d in rendered["secured-kafka"] if d["kind"] in WORKLOADS]
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        assert {"name": "registry-credentials"} in spec["imagePullSecrets"]
        assert spec["containers"][0]["image"] == "registry.example.com/platform/gpupipe:0.1.0"
        assert any(v.get("secret", {}).get("secretName") == "kafka-cluster-ca-cert" for v in spec["volumes"])


def test_producer_daemonset_defaults(rendered: dict) -> None:
    ds = _kinds(rendered["defaults"])["DaemonSet"][0]
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    c = spec["containers"][0]
    assert c["name"] == "producer"
    # Review 1.1: the agent keeps no capability (the chart gave it SYSLOG and /dev/kmsg, which an
    # unprivileged container cannot open); a privileged relay serves the kernel log on a socket.
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["securityContext"]["runAsUser"] == 0
    assert not c["securityContext"].get("privileged")
    host = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert "kmsg" not in host and all(h["path"] != "/dev/kmsg" for h in host.values())
    assert host["spool"]["type"] == "DirectoryOrCreate"
    assert host["pod-resources"]["path"] == "/var/lib/kubelet/pod-resources"
    ro = {m["name"]: m.get("readOnly", False) for m in c["volumeMounts"]}
    assert ro == {
        "pod-resources": True,
        "pod-logs": True,
        "spool": False,
        "kmsg-socket": False,
        "kube-api-access": True,  # the pod metadata watch's token, the agent's alone
    }
    relay = spec["containers"][1]
    assert relay["name"] == "kmsg-relay" and relay["securityContext"]["privileged"] is True
    assert relay["command"][0] == "gpupipe-kmsg-relay" and "initContainers" not in spec
    ns = parse(*command_lines([ds])[0][1:])
    assert ns.source == "nvml" and ns.spool_dir == "/var/lib/gpupipe/spool"
    assert ns.kmsg_path == "/run/gpupipe/kmsg/kmsg.sock" and f"--socket={ns.kmsg_path}" in relay["command"]
    assert ns.kubelet_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 while NVML is released
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_chart_gives_the_producer_the_manifests_privileges(helm: str, rendered: dict) -> None:
    # The manifest, the Dockerfile and the chart agree on least privilege.
    manifest = yaml.safe_load((REPO / "deploy" / "kubernetes" / "producer-daemonset.yaml").read_text())
    m_spec = manifest["spec"]["template"]["spec"]
    m_agent = next(c for c in m_spec["containers"] if c["name"] == "producer")
    m_relay = next(c for c in m_spec["initContainers"] if c["name"] == "kmsg-relay")
    native = _kinds(render(helm, None, "producer.kmsg.nativeSidecar=true"))["DaemonSet"][0]
    spec = native["spec"]["template"]["spec"]
    agent, relay = spec["containers"][0], spec["initContainers"][0]
    assert [c["name"] for c in spec["containers"]] == ["producer"] and relay["restartPolicy"] == "Always"
    kubernetes_validate.validate(native, K8S_VERSIONS[-1], strict=True)  # native sidecars: >= 1.29
    for key in ("runAsUser", "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"):
        assert agent["securityContext"][key] == m_agent["securityContext"][key], key
    assert relay["securityContext"] == m_relay["securityContext"]
    assert relay["command"] == m_relay["command"]
    assert spec["securityContext"]["seccompProfile"] == m_spec["securityContext"]["seccompProfile"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"]["path"] == m_agent[probe]["httpGet"]["path"], probe


def test_consumers_defaults(rendered: dict) -> None:
    k = _kinds(rendered["defaults"])
    deployments = {d["metadata"]["name"]: d for d in k["Deployment"]}
    assert deployments["rel-gpupipe-alerts"]["spec"]["replicas"] == 2  # the alerts pair
    anti = deployments["rel-gpupipe-alerts"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "alerts"
    assert deployments["rel-gpupipe-metrics"]["spec"]["replicas"] == 2
    sts = k["StatefulSet"][0]
    env = _container_env(sts["spec"]["template"]["spec"]["containers"][0])
    assert "GPUPIPE_INSTANCE_ID" in env
    prices = yaml.safe_load(
        _by_name(rendered["defaults"], "ConfigMap")["rel-gpupipe-chargeback"]["data"]["prices.yaml"]
    )
    from gpupipe.domain.prices import parse_price_table

    table = parse_price_table(prices)  # the chargeback service accepts the rendered price table
    assert table is not None
    assert {d["kind"] for d in rendered["defaults"]}.isdisjoint(MONITORING)


def test_mig_only_and_no_alerts(rendered: dict) -> None:
    ds = _kinds(rendered["mig-only"])["DaemonSet"][0]
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"]["nvidia.com/mig.capable"] == "true"
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/mig.config"
    ns = parse(*command_lines([ds])[0][1:])
    assert "nvidia.com/mig-1g.10gb" in ns.extra_resource_names
    cfg = dict(kv.split("=", 1) for kv in ns.kafka_config)
    assert cfg["ssl.certificate.location"].endswith("/user.crt") and cfg["ssl.key.location"].endswith(
        "/user.key"
    )

    docs = rendered["no-alerts"]
    kinds = {d["kind"] for d in docs}
    assert "ClusterRole" not in kinds and not any("alerts" in d["metadata"]["name"] for d in docs)
    ds = _kinds(docs)["DaemonSet"][0]
    ns = parse(*command_lines([ds])[0][1:])
    assert ns.no_kmsg is True and ns.create_topics is False and ns.no_nvml_events is True
    assert ns.pod_metadata == "off"  # podMetadata.enabled=false: no watch, no token, no ClusterRole
    assert "kube-api-access" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert not {"kmsg", "kmsg-socket"} & {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert [c["name"] for c in ds["spec"]["template"]["spec"]["containers"]] == ["producer"]  # no relay
    assert "add" not in ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]


def test_flags_of_every_kind_render_and_parse(helm: str) -> None:
    docs = render(
        helm,
        None,
        "chargeback.flags.window=15m",
        "chargeback.flags.batch-size=5000",
        "chargeback.flags.idle-threshold=0.02",
        "chargeback.flags.static-membership=true",
        "chargeback.flags.grace=null",
        "alerts.flags.dry-run=false",
        "alerts.flags.cordon=true",
        "alerts.cordonWithoutNodeIdentity=true",
        "alerts.flags.node-burst-gpus=3",
        "producer.flags.topic-partitions={gpu.samples.v1=24,gpu.xid.v1=6}",
    )
    lines = {args[0]: (args, env) for _, args, env in command_lines(docs)}
    cb = parse(*lines["chargeback"])
    assert (cb.window, cb.batch_size, cb.idle_threshold, cb.static_membership) == (900_000, 5000, 0.02, True)
    assert "--batch-size=5000" in lines["chargeback"][0] and not any(
        a.startswith("--grace") for a in lines["chargeback"][0]
    )
    al = parse(*lines["alerts"])
    assert al.cordon is True and al.dry_run is False and al.node_burst_gpus == 3
    pr = parse(*lines["produce"])
    assert pr.topic_partitions == ["gpu.samples.v1=24", "gpu.xid.v1=6"]


def test_values_mirror_dcgm_exporter_names() -> None:
    """Where dcgm-exporter's chart has a value with the same meaning, ours has its name."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in (
        "image",
        "imagePullSecrets",
        "nameOverride",
        "fullnameOverride",
        "namespaceOverride",
        "serviceMonitor",
    ):
        assert key in values
    assert {"repository", "pullPolicy", "tag"} <= set(values["image"])
    assert {
        "enabled",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "additionalLabels",
        "relabelings",
        "metricRelabelings",
    } <= set(values["serviceMonitor"])
    producer = values["producer"]
    for key in (
        "hostPID", "runtimeClassName", "priorityClassName", "serviceAccount", "rollingUpdate", "podLabels",
        "podAnnotations", "podSecurityContext", "securityContext", "resources", "nodeSelector", "tolerations",
        "affinity", "extraEnv", "extraVolumes", "extraVolumeMounts", "kubeletPath", "livenessProbe",
        "readinessProbe", "arguments",
    ):  # fmt: skip
        assert key in producer, key
    assert {"enable", "type", "port", "annotations"} <= set(values["metrics"]["service"])


def test_grafana_dashboards_as_sidecar_config_maps(rendered: dict) -> None:
    maps = [
        d
        for d in rendered["secured-kafka"]
        if d["kind"] == "ConfigMap" and d["metadata"]["labels"].get("grafana_dashboard") == "1"
    ]
    shipped = {p.name: p for p in (REPO / "deploy" / "grafana" / "dashboards").glob("*.json")}
    assert sorted(k for m in maps for k in m["data"]) == sorted(shipped)
    for m in maps:
        assert m["metadata"]["annotations"] == {"grafana_folder": "GPU"}
        for key, text in m["data"].items():
            assert json.loads(text) == json.loads(shipped[key].read_text())
    assert not [d for d in rendered["defaults"] if "grafana_dashboard" in d["metadata"].get("labels", {})]


# -- drift from deploy/kubernetes ------------------------------------------------------------------------
# The plain manifests are the reference deployment; the chart fell behind them once (alerts without
# --ha, cordon RBAC without `list`, no recommend, no pod metadata watch). These compare the two.
MANIFESTS = [
    d
    for p in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
    for d in yaml.safe_load_all(p.read_text())
    if d
]
COMPONENTS = ("produce", "metrics", "chargeback", "alerts", "recommend")


def _with_env_from(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, Any]:
    """The container with its envFrom ConfigMaps inlined as env (the manifests' gpupipe-config)."""
    maps = _by_name(docs, "ConfigMap")
    env = [
        {"name": k, "value": v}
        for ref in c.get("envFrom", [])
        for k, v in maps[ref["configMapRef"]["name"]]["data"].items()
    ]
    return c | {"env": env + c.get("env", [])}


def components(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], Any]]:
    """gpupipe subcommand -> (its workload, its parsed command line)."""
    out: dict[str, tuple[dict[str, Any], Any]] = {}
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        for c in w["spec"]["template"]["spec"]["containers"]:
            if "args" in c:
                args, env = _command(_with_env_from(docs, c))
                out[args[0]] = (w, parse(args, env))
    return out


def rbac_rules(docs: list[dict[str, Any]], workload: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the workload's service account is granted by (Cluster)RoleBindings."""
    spec = workload["spec"]["template"]["spec"]
    sa = (spec.get("serviceAccountName") or "default", workload["metadata"]["namespace"])
    roles = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("ClusterRole", "Role")}
    out: set[tuple[str, str, str]] = set()
    for b in (d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if any(
            s["kind"] == "ServiceAccount" and (s["name"], s.get("namespace")) == sa for s in b["subjects"]
        ):
            for rule in roles[(b["roleRef"]["kind"], b["roleRef"]["name"])]["rules"]:
                out |= {
                    (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
                }
    return out


def flags_that_matter(cmd: str, ns: Any) -> dict[str, Any]:
    """What a deployment must agree on: roles, modes, the port scraped, which files are given."""
    keys = {
        "produce": ("source", "pod_metadata", "pod_labels", "dra_resource_slices", "no_kmsg", "kmsg_path"),
        "metrics": (),
        "chargeback": ("instance_id",),
        "alerts": ("ha", "cordon", "dry_run"),
        "recommend": ("idle_after",),
    }[cmd]
    out = {k: getattr(ns, k) for k in keys} | {"port": ns.listen.rsplit(":", 1)[1]}
    if cmd in ("chargeback", "recommend"):
        out["prices"] = bool(ns.prices)  # costs need the price table (the paths may differ)
    return out


def test_the_chart_runs_every_component_of_the_manifests(rendered: dict) -> None:
    assert set(components(MANIFESTS)) == set(COMPONENTS)  # the reference is what the test thinks it is
    assert set(components(rendered["defaults"])) >= set(COMPONENTS)


@pytest.mark.parametrize("cmd", COMPONENTS)
def test_rbac_matches_the_manifests(rendered: dict, cmd: str) -> None:
    chart, manifests = components(rendered["defaults"]), components(MANIFESTS)
    assert cmd in chart, f"the chart does not run gpupipe {cmd}"
    got, want = rbac_rules(rendered["defaults"], chart[cmd][0]), rbac_rules(MANIFESTS, manifests[cmd][0])
    assert got == want, f"{cmd}: chart lacks {sorted(want - got)}, has extra {sorted(got - want)}"


@pytest.mark.parametrize("cmd", COMPONENTS)
def test_flags_that_matter_match_the_manifests(rendered: dict, cmd: str) -> None:
    chart, manifests = components(rendered["defaults"]), components(MANIFESTS)
    assert cmd in chart, f"the chart does not run gpupipe {cmd}"
    assert flags_that_matter(cmd, chart[cmd][1]) == flags_that_matter(cmd, manifests[cmd][1])


def test_the_producer_token_reaches_the_agent_only(rendered: dict) -> None:
    """--pod-metadata api needs the in-cluster token (kube_config fails without it); the relay none."""
    ds, ns = components(rendered["defaults"])["produce"]
    m_ds, _ = components(MANIFESTS)["produce"]
    assert ns.pod_metadata == "api"
    spec, m_spec = ds["spec"]["template"]["spec"], m_ds["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    vol = {v["name"]: v for v in spec["volumes"]}["kube-api-access"]
    m_vol = {v["name"]: v for v in m_spec["volumes"]}["kube-api-access"]
    assert vol == m_vol
    for c in spec["containers"] + spec.get("initContainers", []):
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        token = mounts.get("/var/run/secrets/kubernetes.io/serviceaccount")
        assert token == ("kube-api-access" if c["name"] == "producer" else None), c["name"]


def test_alerts_replicas_run_with_ha(helm: str, rendered: dict) -> None:
    deployment, ns = components(rendered["defaults"])["alerts"]
    assert deployment["spec"]["replicas"] == 2 and ns.ha is True
    _, ns = components(render(helm, None, "alerts.replicaCount=3"))["alerts"]
    assert ns.ha is True
    _, ns = components(render(helm, None, "alerts.replicaCount=1", "alerts.ha.enabled=false"))["alerts"]
    assert ns.ha is False  # one instance without leader election is a valid choice


def render_error(helm: str, *sets: str) -> str:
    cmd = [helm, "template", "rel", str(CHART), "--namespace", "gpu"]
    for s in sets:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, f"helm template {' '.join(sets)} rendered; it must refuse"
    return res.stderr


def test_replicas_without_leader_election_are_refused(helm: str) -> None:
    assert "alerts.ha.enabled" in render_error(helm, "alerts.ha.enabled=false")
    assert "alerts.ha.enabled" in render_error(helm, "alerts.ha.enabled=false", "alerts.replicaCount=3")
    assert "one active instance" in render_error(helm, "recommend.replicaCount=2")


def test_recommend_is_rendered_like_the_other_consumers(helm: str, rendered: dict) -> None:
    deployment, ns = components(rendered["defaults"])["recommend"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    spec = deployment["spec"]["template"]["spec"]
    alerts = components(rendered["defaults"])["alerts"][0]["spec"]["template"]["spec"]
    assert spec["securityContext"] == alerts["securityContext"]
    assert spec["containers"][0]["securityContext"] == alerts["containers"][0]["securityContext"]
    assert spec["automountServiceAccountToken"] is False  # it calls no Kubernetes API
    assert ns.alertmanager_url and ns.teams
    # prices.yaml and teams.yaml from the chargeback ConfigMap, rendered even with chargeback off.
    for docs, configmap in (
        (rendered["defaults"], "rel-gpupipe-chargeback"),
        (render(helm, None, "chargeback.enabled=false"), "rel-gpupipe-chargeback"),
        (rendered["no-alerts"], "gpupipe-prices"),
    ):
        deployment, ns = components(docs)["recommend"]
        spec = deployment["spec"]["template"]["spec"]
        mount = spec["containers"][0]["volumeMounts"][0]
        assert (
            ns.prices == f"{mount['mountPath']}/prices.yaml"
            and ns.teams == f"{mount['mountPath']}/teams.yaml"
        )
        assert {v["name"]: v for v in spec["volumes"]}[mount["name"]]["configMap"]["name"] == configmap
        maps = _by_name(docs, "ConfigMap")
        assert configmap == "gpupipe-prices" or {"prices.yaml", "teams.yaml"} <= set(maps[configmap]["data"])


#: The consumers that act on a record's hostname: each checks node identity when it is on.
HOSTNAME_READERS = ("alerts", "metrics", "chargeback", "recommend")


def _workload(docs: list[dict[str, Any]], service: str) -> dict[str, Any]:
    (w,) = [d for d in docs if d["kind"] in WORKLOADS and d["metadata"]["name"] == f"rel-gpupipe-{service}"]
    return w


def test_node_identity_signs_on_the_node_and_checks_in_every_consumer(helm: str, rendered: dict) -> None:
    docs = rendered["node-identity"]
    ds = _kinds(docs)["DaemonSet"][0]
    ns = parse(*command_lines([ds])[0][1:])
    assert (ns.node_cert, ns.node_key) == (
        "/etc/gpupipe-node/cert/node.crt",
        "/etc/gpupipe-node/key/node.key",
    )
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["node-cert"]["hostPath"] == {"path": "/etc/gpupipe-node/cert", "type": "Directory"}
    assert vols["node-key"]["hostPath"] == {"path": "/etc/gpupipe-node/key", "type": "Directory"}
    (agent,) = [c for c in pod["containers"] if c["name"] == "producer"]
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["node-cert"] == {
        "name": "node-cert",
        "mountPath": "/etc/gpupipe-node/cert",
        "readOnly": True,
    }
    assert mounts["node-key"]["readOnly"] is True
    # the kmsg relay, a second container or a native sidecar (an init container), never mounts them
    sidecar = _kinds(render(helm, None, "nodeIdentity.enabled=true", "producer.kmsg.nativeSidecar=true"))
    sidecar_pod = sidecar["DaemonSet"][0]["spec"]["template"]["spec"]
    for p in (pod, sidecar_pod):
        others = [c for c in [*p["containers"], *p.get("initContainers", [])] if c["name"] != "producer"]
        assert others, "the kmsg relay"
        assert not {m["name"] for c in others for m in c.get("volumeMounts", [])} & {"node-cert", "node-key"}
    # every service that acts on a record's hostname checks it, with the same flags and CA
    for service in HOSTNAME_READERS:
        w = _workload(docs, service)
        ns = parse(*command_lines([w])[0][1:])
        assert (ns.node_ca_file, ns.node_identity, ns.node_cert_names) == (
            "/etc/gpupipe/node-ca/ca.crt",
            "audit",
            "dedicated-ca",
        ), service
        pod = w["spec"]["template"]["spec"]
        assert {"name": "node-ca", "configMap": {"name": "gpupipe-node-ca"}} in pod["volumes"], service
        (main,) = pod["containers"]
        assert {"name": "node-ca", "mountPath": "/etc/gpupipe/node-ca", "readOnly": True} in main[
            "volumeMounts"
        ], service
    # the defaults: the kubelet's certificate, one mount, the cluster CA
    on = render(helm, None, "nodeIdentity.enabled=true")
    ds = _kinds(on)["DaemonSet"][0]
    assert parse(*command_lines([ds])[0][1:]).node_cert == "/var/lib/kubelet/pki/kubelet-client-current.pem"
    names = {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert "node-cert" in names and "node-key" not in names
    alerts = _by_name(on, "Deployment")["rel-gpupipe-alerts"]
    assert {"name": "node-ca", "configMap": {"name": "kube-root-ca.crt"}} in alerts["spec"]["template"][
        "spec"
    ]["volumes"]
    # off by default: no flag, no host mount, no CA
    ds = _kinds(rendered["defaults"])["DaemonSet"][0]
    assert parse(*command_lines([ds])[0][1:]).node_cert is None
    for service in HOSTNAME_READERS:
        w = _workload(rendered["defaults"], service)
        assert parse(*command_lines([w])[0][1:]).node_ca_file is None, service
        assert "node-ca" not in {v["name"] for v in w["spec"]["template"]["spec"].get("volumes", [])}
    assert "node-cert" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}


def test_no_node_can_cordon_another_with_the_charts_defaults(helm: str, rendered: dict) -> None:
    # With the defaults a cordon is at most decided (dry run); real cordons render only where node
    # identity proves which node wrote an XID, or where the user accepts the risk by name.
    _, ns = components(rendered["defaults"])["alerts"]
    assert ns.dry_run is True and ns.cordon is False
    err = render_error(helm, "alerts.flags.cordon=true", "alerts.flags.dry-run=false")
    assert "nodeIdentity.enabled" in err and "cordonWithoutNodeIdentity" in err
    _, ns = components(
        render(
            helm, None, "alerts.flags.cordon=true", "alerts.flags.dry-run=false", "nodeIdentity.enabled=true"
        )
    )["alerts"]
    assert ns.cordon is True and ns.dry_run is False and ns.node_ca_file and ns.node_identity == "enforce"


def test_the_alerts_pod_mounts_a_token_only_when_it_patches_nodes(helm: str, rendered: dict) -> None:
    def alerts_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
        return _by_name(docs, "Deployment")["rel-gpupipe-alerts"]["spec"]["template"]["spec"]

    dry = alerts_pod(rendered["defaults"])  # the default: a dry run, which never calls the API server
    assert dry["serviceAccountName"] == "rel-gpupipe-alerts" and dry["automountServiceAccountToken"] is False
    real = alerts_pod(
        render(
            helm, None, "alerts.flags.cordon=true", "alerts.flags.dry-run=false", "nodeIdentity.enabled=true"
        )
    )
    assert "automountServiceAccountToken" not in real  # the token its cordons need
