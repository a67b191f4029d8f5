"""API-server load of the pod-metadata watch, measured against the faithful double, scaled to 10k nodes.

Setup: ``NODES`` real :class:`PodMetadataWatcher` instances (one per simulated node, each its own
HTTP connections) against ``tests/k8s_pods_fake.py``; 8 GPU pods per node owned by Deployments
(pod -> ReplicaSet -> Deployment), PyTorchJobs and Notebooks (-> StatefulSet -> Notebook); pods
churn at ``CHURN_PER_NODE_HOUR`` new pods per node-hour, a third of them under a new controller.
Time is compressed by ``SPEED``: the watch timeout (300 s in production) is 300/SPEED seconds and
the churn runs SPEED times faster, so the request counts of ``SIM_HOURS`` real hours are measured
in a few seconds of wall time. Requests are counted by verb at the fake (what the API server would
see) and divided by nodes and hours: per-node rates, times 10,000 nodes.

Baseline: the kubelet's own pod watch on the same API server (per node: one list at start plus one
watch re-established each 5-10 min, client-go's default), i.e. what 10k kubelets already cost. The
ratio is ``target budget / our request rate``: ``podmeta_api_requests`` with a budget of 100
requests/s for the whole 10k-node fleet (a quarter of a default API server's 400 in-flight reads,
served from the watch cache). Prints both and the per-verb figures.

Run: ``.venv/bin/python bench/bench_podmeta_load.py``.
"""

from __future__ import annotations

import random
import threading
import time

from common import figure, ratio_line
from k8s_pods_fake import FakePodApi

from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe_producer.podmeta.kube_watch import PodMetadataWatcher

NODES = 40
PODS_PER_NODE = 8
CHURN_PER_NODE_HOUR = 2.0
SPEED = 300.0  # 300 s of watch timeout become 1 s
SIM_HOURS = 1.0
FLEET = 10_000
BUDGET_REQ_S = 100.0


def main() -> None:
    rng = random.Random(14)
    api = FakePodApi().start()
    owners: list[tuple[str, dict]] = []

    def new_owner(ns: str, i: int) -> dict:
        kind = i % 3
        if kind == 0:
            dep = api.add_owner("apps/v1", "Deployment", ns, f"svc-{i}")
            return api.add_owner("apps/v1", "ReplicaSet", ns, f"svc-{i}-7c9", owner=dep)
        if kind == 1:
            return api.add_owner("kubeflow.org/v1", "PyTorchJob", ns, f"train-{i}")
        nb = api.add_owner("kubeflow.org/v1", "Notebook", ns, f"nb-{i}")
        return api.add_owner("apps/v1", "StatefulSet", ns, f"nb-{i}", owner=nb)

    n_pod = 0
    for node in range(NODES):
        for _ in range(PODS_PER_NODE):
            ns = f"team-{node % 7}"
            ref = new_owner(ns, n_pod)
            owners.append((ns, ref))
            api.add_pod(ns, f"pod-{n_pod}", f"node-{node}", labels={"team": ns}, owner=ref)
            n_pod += 1
    kube = KubeClient(KubeConfig(api.url, None, None))
    timeout_s = max(1, round(300 / SPEED))
    watchers = [PodMetadataWatcher(kube, f"node-{n}", watch_timeout_s=timeout_s) for n in range(NODES)]
    started = time.monotonic()
    for w in watchers:
        w.start()
    for w in watchers:
        assert w.synced.wait(30)
    initial = {v: api.count(v) for v in ("list", "watch", "get")}
    # Steady state: churn for SIM_HOURS compressed.
    wall = SIM_HOURS * 3600 / SPEED
    churn_events = int(CHURN_PER_NODE_HOUR * NODES * SIM_HOURS)
    stop = threading.Event()
    t0 = time.monotonic()
    for i in range(churn_events):
        target = t0 + wall * i / churn_events
        time.sleep(max(0.0, target - time.monotonic()))
        node = rng.randrange(NODES)
        ns = f"team-{node % 7}"
        if i % 3 == 0:
            ref = new_owner(ns, n_pod)
        else:
            ns, ref = owners[rng.randrange(len(owners))]
        api.add_pod(ns, f"pod-{n_pod}", f"node-{node}", labels={"team": ns}, owner=ref)
        n_pod += 1
    time.sleep(max(0.0, t0 + wall - time.monotonic()))
    stop.set()
    steady = {v: api.count(v) - initial[v] for v in ("list", "watch", "get")}
    for w in watchers:
        w.stop(1.0)
    api.stop()
    per_node_hour = {v: n / NODES / SIM_HOURS for v, n in steady.items()}
    total_per_node_hour = sum(per_node_hour.values())
    fleet_req_s = total_per_node_hour * FLEET / 3600
    # The kubelet's own watch: one re-established every 5-10 min (7.5 on average) per node.
    kubelet_req_s = 3600 / 450 * FLEET / 3600
    ratio_line("podmeta_api_requests", BUDGET_REQ_S / fleet_req_s, 1.0)
    figure("nodes_measured", NODES)
    figure("start_requests_per_node", sum(initial.values()) / NODES)
    for verb, v in per_node_hour.items():
        figure(f"steady_{verb}_per_node_hour", round(v, 2))
    figure("fleet_10k_requests_per_s", round(fleet_req_s, 2))
    figure("fleet_10k_kubelet_watch_requests_per_s", round(kubelet_req_s, 2))
    figure("fleet_10k_open_watches", FLEET)
    figure("fleet_10k_restart_burst_requests", int(sum(initial.values()) / NODES * FLEET))
    figure("wall_s", round(time.monotonic() - started, 1))


if __name__ == "__main__":
    main()
