"""DRA claims in the metrics: dcgm-exporter's ``dra_*`` labels with ``--kubernetes-enable-dra``.

The reference is the series dcgm-exporter printed for a GPU that NVIDIA's DRA driver allocated, as
the Kubernetes documentation publishes them (``tests/fixtures/metrics/dra-kubernetes-docs.prom``,
its source in its header); the layout rules (one series per container, none with the virtual-GPU
layout, MIG labels) follow dcgm-exporter's ``internal/pkg/transformation/kubernetes.go``.
"""

from __future__ import annotations

from gpupipe.commands.cli import build_parser
from gpupipe_consumers.metrics.command import render_options
from gpupipe_consumers.metrics.render import RenderOptions
from tests.paths import TESTS
from tests.unit.consumers.metrics.test_render import BASE, alloc, blank, expo, lines_of

REFERENCE = TESTS / "fixtures" / "metrics" / "dra-kubernetes-docs.prom"
DRA = RenderOptions(dra_labels=True)


def claim(
    ns: str, pod: str, name: str, ctr: str = "ctr", pool: str = "node-1", device: str = "gpu-0"
) -> dict:
    return {
        **alloc(ns, pod, ctr),
        "resource_name": "gpu.nvidia.com",
        "claim_name": name,
        "claim_namespace": ns,
        "dra_pool": pool,
        "dra_device": device,
    }


def test_a_shared_claim_renders_as_dcgm_exporter_printed_it() -> None:
    want = [ln for ln in REFERENCE.read_text().splitlines() if ln and not ln.startswith("#")]
    rec = blank(
        gpu_index=0,
        uuid="GPU-a4f34abc-7715-3560-dcea-7238b9611a45",
        pci_bus_id="00000009:01:00.0",
        model_name="NVIDIA GH200 96GB HBM3",
        hostname="sc-starwars-xxxx",
        driver_version=None,
        pcie_rx_bytes_per_s=23792.0,
        allocations=[
            claim("gpu-test3", "pod1", "single-gpu", pool="sc-starwars-xxxx"),
            claim("gpu-test3", "pod2", "single-gpu", pool="sc-starwars-xxxx"),
        ],
    )
    assert lines_of(expo(rec, options=DRA), "DCGM_FI_PROF_PCIE_RX_BYTES") == want


def test_without_the_flag_a_claim_is_a_plain_pod_as_before() -> None:
    rec = blank(gpu_temp_c=40.0, allocations=[claim("a", "p", "c1")])
    (line,) = lines_of(expo(rec), "DCGM_FI_DEV_GPU_TEMP")
    assert line == f'DCGM_FI_DEV_GPU_TEMP{{{BASE},container="ctr",namespace="a",pod="p"}} 40'


def test_claims_of_two_namespaces_on_one_gpu_are_two_series_and_plugin_holders_are_left_out() -> None:
    allocs = [alloc("legacy", "old-0"), claim("team-a", "a-0", "ca"), claim("team-b", "b-0", "cb")]
    lines = lines_of(expo(blank(gpu_temp_c=40.0, allocations=allocs), options=DRA), "DCGM_FI_DEV_GPU_TEMP")
    assert len(lines) == 2
    assert {ln.split('pod="')[1].split('"')[0] for ln in lines} == {"a-0", "b-0"}
    assert all('dra_claim_namespace="team-' in ln for ln in lines) and "old-0" not in "".join(lines)


def test_one_container_through_two_claims_is_one_series_of_its_first_claim() -> None:
    allocs = [claim("a", "p", "first"), claim("a", "p", "second", device="gpu-1")]
    (line,) = lines_of(expo(blank(gpu_temp_c=40.0, allocations=allocs), options=DRA), "DCGM_FI_DEV_GPU_TEMP")
    assert 'dra_claim_name="first"' in line and "second" not in line


def test_a_mig_instance_carries_its_profile_and_uuid() -> None:
    mig = {"mig_uuid": "MIG-bbbb", "gpu_instance_id": 3, "compute_instance_id": 0, "profile": "1g.10gb",
           "slice_fraction": 1 / 7}  # fmt: skip
    rec = blank(
        mig=mig, sm_active_ratio=0.25, allocations=[claim("a", "p", "c", device="gpu-0-mig-1g10gb-0")]
    )
    (line,) = lines_of(expo(rec, options=DRA), "DCGM_FI_PROF_SM_ACTIVE")
    assert line.endswith(
        'container="ctr",dra_claim_name="c",dra_claim_namespace="a",dra_device_name="gpu-0-mig-1g10gb-0",'
        'dra_driver_name="gpu.nvidia.com",dra_mig_device_uuid="MIG-bbbb",dra_mig_profile="1g.10gb",'
        'dra_pool_name="node-1",namespace="a",pod="p"} 0.250000'
    )


def test_the_virtual_gpu_layout_has_no_dra_labels_as_dcgm_exporter() -> None:
    opts = RenderOptions(dra_labels=True, virtual_gpus=True)
    text = expo(blank(gpu_temp_c=40.0, allocations=[claim("a", "p", "c")]), options=opts)
    assert "dra_" not in text and 'pod="p"' in text


def test_the_flag() -> None:
    args = build_parser().parse_args(["metrics", "--kubernetes-enable-dra"])
    assert render_options(args).dra_labels
    assert not render_options(build_parser().parse_args(["metrics"])).dra_labels
