"""The committed generated code matches api.proto, and matches the field table of the kubelet API."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
from google.protobuf import runtime_version

from gpupipe_producer.kubelet import api_pb2, api_pb2_grpc
from tests.paths import REPO

ROOT = REPO
GENERATED = ("api_pb2.py", "api_pb2_grpc.py")


def test_regenerating_gives_the_committed_files(tmp_path):
    import grpc_tools  # a dev dependency: fail, never skip, when it is missing

    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen-proto"), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "producer" / "kubelet"
    assert sorted(p.name for p in out.iterdir()) == sorted(GENERATED)
    for name in GENERATED:
        fresh = (out / name).read_text()
        committed = (ROOT / "producer" / "kubelet" / name).read_text()
        assert fresh == committed, (
            f"{name} differs from a fresh scripts/gen-proto run with grpcio-tools from "
            f"{grpc_tools.__file__}; regenerate and commit, or install the grpcio-tools version "
            f"recorded in api_pb2_grpc.py (GRPC_GENERATED_VERSION={api_pb2_grpc.GRPC_GENERATED_VERSION})"
        )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])


def test_runtime_satisfies_gencode_versions():
    assert _version(grpc.__version__) >= _version(api_pb2_grpc.GRPC_GENERATED_VERSION)
    gencode = next(
        line.split(":", 1)[1].strip()
        for line in (ROOT / "producer" / "kubelet" / "api_pb2.py").read_text().splitlines()
        if line.startswith("# Protobuf Python Version:")
    )
    runtime = (runtime_version.MAJOR, runtime_version.MINOR, runtime_version.PATCH)
    assert runtime >= _version(gencode)


def test_grpc_module_imports_messages_through_the_package():
    assert api_pb2_grpc.producer_dot_kubelet_dot_api__pb2 is api_pb2


FIELDS = {
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5},
    "ContainerResources": {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5},
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "DynamicResource": {"claim_name": 2, "claim_namespace": 3, "claim_resources": 4},
    "ClaimResource": {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4, "share_id": 5},
    "CDIDevice": {"name": 1},
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
    "ListPodResourcesRequest": {},
    "AllocatableResourcesRequest": {},
}


def test_wire_contract():
    fd = api_pb2.DESCRIPTOR
    assert fd.package == "v1"
    for msg, fields in FIELDS.items():
        desc = fd.message_types_by_name[msg]
        assert {f.name: f.number for f in desc.fields} == fields, msg
    assert set(fd.message_types_by_name) == set(FIELDS)
    svc = fd.services_by_name["PodResourcesLister"]
    assert svc.full_name == "v1.PodResourcesLister"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in svc.methods} == {
        "List": ("ListPodResourcesRequest", "ListPodResourcesResponse"),
        "GetAllocatableResources": ("AllocatableResourcesRequest", "AllocatableResourcesResponse"),
        "Get": ("GetPodResourcesRequest", "GetPodResourcesResponse"),
    }
    assert api_pb2.ClaimResource.DESCRIPTOR.fields_by_name["share_id"].has_presence
