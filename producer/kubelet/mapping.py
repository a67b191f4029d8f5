"""Map kubelet PodResources allocations to GPUs (pure logic: no gRPC, no I/O).

:class:`AllocationMapper` turns a plain mirror of ``v1.ListPodResourcesResponse`` (:class:`PodResources`;
:func:`pod_resources_from_dict` reads it from JSON) into an :class:`AllocationMap`: device key -> sorted,
duplicate-free tuple of :class:`PodRef`, replicas keyed by their device, DRA claims by
:class:`DraDeviceKey`. Unknown resources and odd device ids are counted, never raised.
More: docs/producer.md, "Allocations to GPUs".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
GPU_SHARED_RESOURCE = "nvidia.com/gpu.shared"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
DEFAULT_DRA_DRIVERS: tuple[str, ...] = ("gpu.nvidia.com",)

_REPLICA_SEP = "::"
_GKE_VGPU = re.compile(r"^(?P<base>.+)/vgpu(?P<n>[0-9]+)$")


# --------------------------------------------------------------------------------------------------
# Plain mirror of the v1 messages (only the fields the mapping needs).


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    resource_name: str
    device_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimResource:
    driver_name: str = ""
    pool_name: str = ""
    device_name: str = ""
    cdi_devices: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class DynamicResource:
    claim_name: str = ""
    claim_namespace: str = ""
    claim_resources: tuple[ClaimResource, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerResources:
    name: str
    devices: tuple[ContainerDevices, ...] = ()
    dynamic_resources: tuple[DynamicResource, ...] = ()


@dataclass(frozen=True, slots=True)
class PodResources:
    name: str
    namespace: str
    containers: tuple[ContainerResources, ...] = ()


# --------------------------------------------------------------------------------------------------
# Output.


@dataclass(frozen=True, slots=True)
class PodRef:
    """One container's hold on a device.

    ``replica`` is the ``n`` of a ``<id>::<n>`` (or ``/vgpu<n>``) shared-device id, else None.
    ``claim_name`` is set for DRA allocations (then ``resource_name`` is the DRA driver name), with
    the claim's namespace and the pool and device names the driver published the device under;
    ``dra_share_id`` is ``ClaimResource.share_id`` (Kubernetes 1.35+) when the claim holds a share of
    a device another claim may hold too (DRA consumable capacity), else None.
    """

    namespace: str
    pod: str
    container: str
    resource_name: str
    replica: int | None = None
    claim_name: str | None = None
    claim_namespace: str | None = None
    dra_pool: str | None = None
    dra_device: str | None = None
    dra_share_id: str | None = None

    def sort_key(self) -> tuple[Any, ...]:
        return (
            self.namespace,
            self.pod,
            self.container,
            self.resource_name,
            -1 if self.replica is None else self.replica,
            self.claim_name or "",
            self.dra_share_id or "",
        )


@dataclass(frozen=True, slots=True, order=True)
class DraDeviceKey:
    driver: str
    pool: str
    device: str


class AllocationMap(Mapping[str, tuple[PodRef, ...]]):
    """Read-only mapping device key -> pods holding it (see the module docstring for keys).

    Extra attributes: ``dra`` (DraDeviceKey -> pods), ``ignored_resources`` (resource name -> count of
    device entries skipped), ``odd_device_ids`` (count). Falsy when it holds no allocation at all.
    """

    __slots__ = ("_devices", "dra", "ignored_resources", "odd_device_ids", "replicas")

    def __init__(
        self,
        devices: Mapping[str, tuple[PodRef, ...]] | None = None,
        dra: Mapping[DraDeviceKey, tuple[PodRef, ...]] | None = None,
        ignored_resources: Mapping[str, int] | None = None,
        odd_device_ids: int = 0,
        replicas: Mapping[str, int] | None = None,
    ) -> None:
        self._devices: Mapping[str, tuple[PodRef, ...]] = MappingProxyType(dict(devices or {}))
        self.dra: Mapping[DraDeviceKey, tuple[PodRef, ...]] = MappingProxyType(dict(dra or {}))
        self.ignored_resources: Mapping[str, int] = MappingProxyType(dict(ignored_resources or {}))
        self.odd_device_ids = odd_device_ids
        self.replicas: Mapping[str, int] = MappingProxyType(dict(replicas or {}))

    def with_replicas(self, replicas: Mapping[str, int]) -> AllocationMap:
        """The same map with the shared devices' replica counts (device key -> replicas)."""
        return AllocationMap(self._devices, self.dra, self.ignored_resources, self.odd_device_ids, replicas)

    @classmethod
    def empty(cls) -> AllocationMap:
        return _EMPTY

    def __getitem__(self, key: str) -> tuple[PodRef, ...]:
        return self._devices[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._devices)

    def __len__(self) -> int:
        return len(self._devices)

    def __bool__(self) -> bool:
        return bool(self._devices) or bool(self.dra)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AllocationMap):
            return NotImplemented
        return (
            dict(self._devices) == dict(other._devices)
            and dict(self.dra) == dict(other.dra)
            and dict(self.ignored_resources) == dict(other.ignored_resources)
            and self.odd_device_ids == other.odd_device_ids
            and dict(self.replicas) == dict(other.replicas)
        )

    __hash__ = None  # type: ignore[assignment]

    def pods(self) -> frozenset[tuple[str, str]]:
        """(namespace, pod) of every pod holding at least one mapped device."""
        out: set[tuple[str, str]] = set()
        for refs in (*self._devices.values(), *self.dra.values()):
            out.update((r.namespace, r.pod) for r in refs)
        return frozenset(out)

    def __repr__(self) -> str:
        return (
            f"AllocationMap(devices={dict(self._devices)!r}, dra={dict(self.dra)!r}, "
            f"ignored_resources={dict(self.ignored_resources)!r}, odd_device_ids={self.odd_device_ids})"
        )


_EMPTY = AllocationMap()


def split_device_id(device_id: str) -> tuple[str, int | None, bool]:
    """Split a device id into (key, replica, odd).

    ``GPU-x::3`` -> (``GPU-x``, 3, False); ``nvidia0/vgpu2`` -> (``nvidia0``, 2, False);
    ``GPU-x`` -> (``GPU-x``, None, False). Malformed replica forms (``::3``, ``GPU-x::``, ``GPU-x::a``)
    are kept verbatim with odd=True.
    """
    did = device_id.strip()
    if _REPLICA_SEP in did:
        base, _, suffix = did.rpartition(_REPLICA_SEP)
        if base and suffix.isascii() and suffix.isdigit():
            return base, int(suffix), False
        return did, None, True
    m = _GKE_VGPU.match(did)
    if m:
        return m.group("base"), int(m.group("n")), False
    return did, None, False


@dataclass(frozen=True)
class AllocationMapper:
    """Builds :class:`AllocationMap` from plain pod resources.

    ``extra_resource_names``: more device-plugin resource names to keep (exact, or a prefix when ending
    in ``*``). ``dra_driver_names``: DRA drivers whose claims are mapped. ``dra_device_resolver``: optional
    ``(driver, pool, device) -> device id or None`` to index DRA devices under a GPU/MIG UUID as well.
    """

    extra_resource_names: tuple[str, ...] = ()
    dra_driver_names: tuple[str, ...] = DEFAULT_DRA_DRIVERS
    dra_device_resolver: Callable[[str, str, str], str | None] | None = None
    _exact: frozenset[str] = field(init=False, repr=False, compare=False)
    _prefixes: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(self.extra_resource_names)
        object.__setattr__(self, "extra_resource_names", names)
        object.__setattr__(self, "dra_driver_names", tuple(self.dra_driver_names))
        exact = {GPU_RESOURCE, GPU_SHARED_RESOURCE}
        prefixes = [MIG_RESOURCE_PREFIX]
        for name in names:
            if name.endswith("*"):
                if name[:-1]:
                    prefixes.append(name[:-1])
            elif name:
                exact.add(name)
        object.__setattr__(self, "_exact", frozenset(exact))
        object.__setattr__(self, "_prefixes", tuple(prefixes))

    def wants(self, resource_name: str) -> bool:
        """Whether device-plugin resource ``resource_name`` is a GPU resource we map."""
        if resource_name in self._exact:
            return True
        return any(resource_name.startswith(p) and len(resource_name) > len(p) for p in self._prefixes)

    def build(self, pods: Iterable[PodResources]) -> AllocationMap:
        acc = _Accumulator()
        for pod in pods:
            for ctr in pod.containers:
                for dev in ctr.devices:
                    self._add_devices(acc, pod, ctr, dev)
                for dyn in ctr.dynamic_resources:
                    self._add_dra(acc, pod, ctr, dyn)
        return AllocationMap(
            {k: _sorted(v) for k, v in acc.devices.items()},
            {k: _sorted(v) for k, v in acc.dra.items()},
            acc.ignored,
            acc.odd,
        )

    def replica_counts(self, devices: Iterable[ContainerDevices]) -> dict[str, int]:
        """Device key -> distinct replicas advertised, for the allocatable ``devices`` of a node."""
        seen: dict[str, set[int]] = {}
        for dev in devices:
            if not isinstance(dev.resource_name, str) or not self.wants(dev.resource_name):
                continue
            for did in dev.device_ids:
                if not isinstance(did, str) or not did.strip():
                    continue
                key, replica, _ = split_device_id(did)
                if replica is not None:
                    seen.setdefault(key, set()).add(replica)
        return {key: len(replicas) for key, replicas in seen.items()}

    def _add_devices(
        self, acc: _Accumulator, pod: PodResources, ctr: ContainerResources, dev: ContainerDevices
    ) -> None:
        rname = dev.resource_name if isinstance(dev.resource_name, str) else str(dev.resource_name)
        if not self.wants(rname):
            acc.ignored[rname] = acc.ignored.get(rname, 0) + 1
            return
        for did in dev.device_ids:
            if not isinstance(did, str) or not did.strip():
                acc.odd += 1
                continue
            key, replica, is_odd = split_device_id(did)
            acc.odd += is_odd
            acc.devices.setdefault(key, set()).add(PodRef(pod.namespace, pod.name, ctr.name, rname, replica))

    def _add_dra(
        self, acc: _Accumulator, pod: PodResources, ctr: ContainerResources, dyn: DynamicResource
    ) -> None:
        for cres in dyn.claim_resources:
            if cres.driver_name not in self.dra_driver_names:
                continue
            key = DraDeviceKey(cres.driver_name, cres.pool_name, cres.device_name)
            ref = PodRef(
                pod.namespace,
                pod.name,
                ctr.name,
                cres.driver_name,
                None,
                dyn.claim_name,
                dyn.claim_namespace or pod.namespace,
                cres.pool_name,
                cres.device_name,
                cres.share_id or None,
            )
            acc.dra.setdefault(key, set()).add(ref)
            if self.dra_device_resolver is not None:
                resolved = self.dra_device_resolver(key.driver, key.pool, key.device)
                if isinstance(resolved, str) and resolved:
                    acc.devices.setdefault(resolved, set()).add(ref)


@dataclass(slots=True)
class _Accumulator:
    devices: dict[str, set[PodRef]] = field(default_factory=dict)
    dra: dict[DraDeviceKey, set[PodRef]] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    odd: int = 0


def _sorted(refs: Iterable[PodRef]) -> tuple[PodRef, ...]:
    return tuple(sorted(refs, key=PodRef.sort_key))


def replica_count(amap: AllocationMap, keys: Iterable[str]) -> int | None:
    """Replicas advertised for the first of ``keys`` (a device's UUID, then its aliases) that has
    them; None for a device that is not shared, or when the counts are unknown."""
    for key in keys:
        if key and key in amap.replicas:
            return amap.replicas[key]
    return None


def build_allocation_map(
    pods: Iterable[PodResources], extra_resource_names: Iterable[str] = ()
) -> AllocationMap:
    """Convenience: ``AllocationMapper(tuple(extra_resource_names)).build(pods)``."""
    return AllocationMapper(tuple(extra_resource_names)).build(pods)


def lookup(
    amap: AllocationMap,
    gpu_uuid: str,
    mig_uuid: str | None = None,
    *,
    aliases: Iterable[str] = (),
) -> tuple[PodRef, ...]:
    """Pods holding a GPU (``mig_uuid`` None) or one MIG slice of it.

    With ``mig_uuid`` only the MIG device's holders are returned (a MIG-enabled GPU is never allocated
    whole). ``aliases`` are other ids of the same device (index, PCI bus id, ...) for device plugins that
    do not advertise UUIDs; their holders are merged in. Unknown devices give ``()``.
    """
    keys = [mig_uuid if mig_uuid else gpu_uuid, *aliases]
    found: set[PodRef] = set()
    for key in keys:
        if key:
            found.update(amap.get(key, ()))
    return _sorted(found)


# --------------------------------------------------------------------------------------------------
# JSON / dict input (fixtures, debugging dumps). Accepts protobuf JSON names (snake or lowerCamel).


def _get(obj: Mapping[str, Any], snake: str, default: Any) -> Any:
    if snake in obj:
        return obj[snake]
    head, *rest = snake.split("_")
    camel = head + "".join(p.title() for p in rest)
    return obj.get(camel, default)


def _seq(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def pod_resources_from_dict(obj: Mapping[str, Any]) -> tuple[PodResources, ...]:
    """Read a ``ListPodResourcesResponse`` in protobuf JSON form into plain dataclasses.

    Raises ValueError/TypeError on a structurally wrong document (not a mapping, etc.).
    """
    if not isinstance(obj, Mapping):
        raise TypeError(f"expected a mapping, got {type(obj).__name__}")
    pods = []
    for p in _seq(_get(obj, "pod_resources", [])):
        containers = []
        for c in _seq(_get(p, "containers", [])):
            devs = tuple(
                ContainerDevices(
                    _get(d, "resource_name", ""),
                    tuple(_seq(_get(d, "device_ids", []))),
                )
                for d in _seq(_get(c, "devices", []))
            )
            dyns = tuple(
                DynamicResource(
                    _get(dr, "claim_name", ""),
                    _get(dr, "claim_namespace", ""),
                    tuple(
                        ClaimResource(
                            _get(cr, "driver_name", ""),
                            _get(cr, "pool_name", ""),
                            _get(cr, "device_name", ""),
                            tuple(x.get("name", "") for x in _seq(_get(cr, "cdi_devices", []))),
                            _get(cr, "share_id", None),
                        )
                        for cr in _seq(_get(dr, "claim_resources", []))
                    ),
                )
                for dr in _seq(_get(c, "dynamic_resources", []))
            )
            containers.append(ContainerResources(_get(c, "name", ""), devs, dyns))
        pods.append(PodResources(_get(p, "name", ""), _get(p, "namespace", ""), tuple(containers)))
    return tuple(pods)
