"""DRA devices to UUIDs from the node's ResourceSlices: the slice shapes of each API version, and how
often the API server is asked."""

from __future__ import annotations

from typing import Any

from gpupipe.clients.kube import KubeApiError
from gpupipe_producer.agent.dra_slices import ResourceSliceIndex, slice_uuids

DRIVER = "gpu.nvidia.com"


def _slice(pool: str, devices: list[dict[str, Any]], driver: str = DRIVER) -> dict[str, Any]:
    return {"spec": {"driver": driver, "pool": {"name": pool}, "nodeName": pool, "devices": devices}}


def _dev(name: str, uuid: str, *, nested: bool = False, qualified: bool = False) -> dict[str, Any]:
    attrs = {(f"{DRIVER}/uuid" if qualified else "uuid"): {"string": uuid}, "type": {"string": "gpu"}}
    return {"name": name, "basic": {"attributes": attrs}} if nested else {"name": name, "attributes": attrs}


def test_every_served_shape_gives_the_uuid() -> None:
    items = [
        _slice("node-a", [_dev("gpu-0", "GPU-0"), _dev("gpu-0-mig-1g", "MIG-1")]),  # v1, v1beta2
        _slice("node-a-b1", [_dev("gpu-1", "GPU-1", nested=True)]),  # v1beta1: under "basic"
        _slice("node-a-q", [_dev("gpu-2", "GPU-2", qualified=True)]),  # the fully qualified name
        _slice("node-a", [_dev("nic-0", "NIC-0")], driver="example.com/nic"),  # not a GPU driver
        _slice("node-a", [{"name": "gpu-9", "attributes": {"type": {"string": "gpu"}}}]),  # no uuid
        {"spec": {"driver": DRIVER}},  # no pool: nothing to key it by
    ]
    assert slice_uuids(items, [DRIVER]) == {
        (DRIVER, "node-a", "gpu-0"): "GPU-0",
        (DRIVER, "node-a", "gpu-0-mig-1g"): "MIG-1",
        (DRIVER, "node-a-b1", "gpu-1"): "GPU-1",
        (DRIVER, "node-a-q", "gpu-2"): "GPU-2",
    }


class FakeApi:
    """The one call the index makes, with the versions a server serves and a count of requests."""

    def __init__(self, versions: dict[str, list[dict[str, Any]]]) -> None:
        self.versions = versions
        self.paths: list[str] = []
        self.fail: KubeApiError | None = None

    def get(self, path: str) -> dict[str, Any]:
        self.paths.append(path)
        if self.fail is not None:
            raise self.fail
        version = path.split("/")[3]
        if version not in self.versions:
            raise KubeApiError(404, "not found")
        return {"items": self.versions[version]}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lists_on_a_miss_at_most_once_per_interval_and_falls_back() -> None:
    api = FakeApi({"v1beta2": [_slice("node-a", [_dev("gpu-0-mig-1g", "MIG-1")])]})
    clock, errors = Clock(), []
    idx = ResourceSliceIndex(
        api,  # type: ignore[arg-type]
        "node-a",
        [DRIVER],
        clock=clock,
        on_error=errors.append,
        fallback=lambda d, p, n: "GPU-by-name" if n == "gpu-0" else None,
    )
    assert idx.uuid(DRIVER, "node-a", "gpu-0-mig-1g") == "MIG-1"
    # v1 is not served there: it fell back to v1beta2, and asks only that from now on
    assert [p.split("?")[0] for p in api.paths] == [
        "/apis/resource.k8s.io/v1/resourceslices",
        "/apis/resource.k8s.io/v1beta2/resourceslices",
    ]
    assert api.paths[0].endswith("fieldSelector=spec.nodeName%3Dnode-a")
    assert idx.uuid(DRIVER, "node-a", "gpu-0") == "GPU-by-name"  # unknown, listed recently: the naming
    assert idx.uuid("example.com/nic", "node-a", "nic-0") is None  # not ours: never asks
    assert len(api.paths) == 2
    clock.t += 30
    api.versions["v1beta2"].append(_slice("node-a", [_dev("gpu-1-mig-2g", "MIG-2")]))
    assert idx.uuid(DRIVER, "node-a", "gpu-1-mig-2g") == "MIG-2"  # a repartitioned GPU, listed again
    assert len(api.paths) == 3
    # the API refuses: what was known stays, the refusal is counted, the interval still holds
    clock.t += 30
    api.fail = KubeApiError(403, "forbidden")
    assert idx.uuid(DRIVER, "node-a", "gpu-7") is None
    assert idx.uuid(DRIVER, "node-a", "gpu-1-mig-2g") == "MIG-2"
    assert errors == ["http_403"] and len(api.paths) == 4 and len(idx) == 2
