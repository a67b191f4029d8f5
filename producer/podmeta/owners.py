"""Pod metadata from Kubernetes objects: labels, priority class, and the top controller. Pure.

The *owner* of a pod is its top controller: follow the ``controller: true`` owner reference up
(pod -> ReplicaSet -> Deployment, pod -> Job -> CronJob, pod -> StatefulSet -> Notebook,
pod -> PodGroup/RayCluster, ...) until an object has no controller, or its owner cannot be read
(RBAC, deleted, an API group the cluster does not serve): then the last one reached is the owner.
A pod with no controller reference is its own owner (kind ``Pod``). The depth is bounded (8) so a
reference loop cannot hang the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 8

# (apiVersion, kind, namespace, name) -> that object's metadata, or None when it cannot be read.
OwnerGetter = Callable[[str, str, str, str], Mapping[str, Any] | None]


@dataclass(frozen=True, slots=True)
class PodMeta:
    namespace: str
    name: str
    uid: str
    labels: Mapping[str, str] = field(default_factory=dict)
    priority_class: str | None = None
    owner_kind: str = "Pod"
    owner_name: str = ""


def controller_ref(metadata: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The owner reference with ``controller: true`` (at most one exists), else None."""
    for ref in metadata.get("ownerReferences") or ():
        if ref.get("controller"):
            return ref
    return None


def plural(kind: str) -> str:
    """Resource name of a kind, as the API's RESTMapper guesses it (lower case, English plural)."""
    k = kind.lower()
    if k.endswith("y") and not k.endswith(("ay", "ey", "oy", "uy")):
        return k[:-1] + "ies"
    if k.endswith(("s", "x", "ch", "sh")):
        return k + "es"
    return k + "s"


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    """REST path of a namespaced object: ``/api/v1/...`` for the core group, ``/apis/<g>/<v>/...`` else."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural(kind)}/{name}"


def top_owner(namespace: str, metadata: Mapping[str, Any], get: OwnerGetter) -> tuple[str, str]:
    """(kind, name) of the top controller of the object with ``metadata`` (see module doc)."""
    ref = controller_ref(metadata)
    if ref is None:
        return "Pod", str(metadata.get("name", ""))
    kind, name = str(ref["kind"]), str(ref["name"])
    seen = {str(ref.get("uid") or f"{kind}/{name}")}
    for _ in range(MAX_DEPTH):
        meta = get(str(ref.get("apiVersion", "")), kind, namespace, name)
        if meta is None:
            break
        ref = controller_ref(meta)
        if ref is None:
            break
        uid = str(ref.get("uid") or f"{ref['kind']}/{ref['name']}")
        if uid in seen:
            break
        seen.add(uid)
        kind, name = str(ref["kind"]), str(ref["name"])
    return kind, name


def pod_meta(pod: Mapping[str, Any], get: OwnerGetter) -> PodMeta:
    """PodMeta of one Pod object (as the API returns it)."""
    md = pod.get("metadata") or {}
    ns = str(md.get("namespace", ""))
    kind, name = top_owner(ns, md, get)
    return PodMeta(
        namespace=ns,
        name=str(md.get("name", "")),
        uid=str(md.get("uid", "")),
        labels=dict(md.get("labels") or {}),
        priority_class=(pod.get("spec") or {}).get("priorityClassName") or None,
        owner_kind=kind,
        owner_name=name,
    )


def annotate(
    allocations: list[dict[str, Any]],
    lookup: Callable[[str, str], PodMeta | None],
    label_keys: tuple[str, ...],
    healthy: bool,
) -> None:
    """Fill owner, selected labels, priority class and metadata_status of each allocation in place.

    ``healthy``: the metadata source is live. A pod it knows gets ``ok`` (or ``stale`` when the source
    is down: last known values); a pod it does not know gets ``unknown`` and null fields. HPC
    allocations (``hpc_job`` set) carry their own owner and are left alone.
    """
    for a in allocations:
        if a.get("hpc_job"):
            continue
        meta = lookup(a["namespace"], a["pod"])
        if meta is None:
            a.update(
                owner_kind=None, owner_name=None, labels={}, priority_class=None, metadata_status="unknown"
            )
            continue
        a.update(
            owner_kind=meta.owner_kind,
            owner_name=meta.owner_name,
            labels={k: meta.labels[k] for k in label_keys if k in meta.labels},
            priority_class=meta.priority_class,
            metadata_status="ok" if healthy else "stale",
        )
