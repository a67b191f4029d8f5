"""Reading dcgm-exporter scrapes of pre-Hopper GPUs (real ones, tests/fixtures/dcgm) onto GpuSamples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.nvml.records import empty_sample
from gpupipe_producer.samples.dcgm_profiling import ScrapeError, fill_samples, parse_scrape

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "dcgm"
A100_MIG = "GPU-2c2f45e8-0886-e3cc-02be-a4181a13fc9b"
A30_BUSY = "GPU-603a8873-0edd-c157-ce48-2078e8b1a935"
A100_SXM = "GPU-715daa1d-db6f-9e69-ab48-190158bd5360"


def scrape(name: str) -> str:
    return (FIXTURES / name).read_text()


def sample(uuid: str, gi: int | None = None, **values: Any) -> dict[str, Any]:
    s = empty_sample()
    s["uuid"] = uuid
    if gi is not None:
        s["mig"] = {"mig_uuid": f"MIG-{gi}", "gpu_instance_id": gi, "compute_instance_id": 0}
    s.update(values)
    return s


def test_a_mig_a100_scrape_gives_each_gpu_instance_its_own_ratio() -> None:
    r = parse_scrape(scrape("a100-pcie-mig.prom"))
    assert r == {
        (A100_MIG, 8): {"gr_engine_active_ratio": 0.029399},
        (A100_MIG, 9): {"gr_engine_active_ratio": 0.033893},
        (A100_MIG, 10): {"gr_engine_active_ratio": 0.0},
    }


def test_a_busy_a30_instance_carries_its_engine_and_tensor_ratios() -> None:
    r = parse_scrape(scrape("a30-mig-busy.prom"))
    assert r == {(A30_BUSY, 1): {"gr_engine_active_ratio": 0.381124, "tensor_active_ratio": 0.022137}}


def test_two_mig_a30s_keep_their_families_apart() -> None:
    r = parse_scrape(scrape("a30-mig-two-gpus.prom"))
    assert len(r) == 6
    assert r[("GPU-265c9814-6156-355b-e589-ff2064894f16", 3)] == {
        "sm_active_ratio": 0.0,
        "tensor_active_ratio": 0.0,
        "dram_active_ratio": 0.0,
    }
    assert r[("GPU-2d20791a-b4a6-ba59-97f1-e95b99fe5b49", 4)] == {
        "sm_active_ratio": 0.0,
        "dram_active_ratio": 0.0,
    }


def test_whole_a100s_get_their_nvlink_rate_under_the_gpu_key() -> None:
    r = parse_scrape(scrape("a100-sxm4-nvlink.prom"))
    assert len(r) == 4 and r[(A100_SXM, None)] == {"nvlink_tx_bytes_per_s": 0.0}


def test_the_renamed_metrics_of_4_9_and_4_10_and_lowercase_uuid_labels_are_read() -> None:
    text = (
        'DCGM_FI_PROF_SM_UTIL_RATIO{gpu="0",uuid="GPU-x"} 0.5\n'
        'DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND{gpu="0",uuid="GPU-x"} 1048576\n'
        'DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND{gpu="0",uuid="GPU-x"} 2e9\n'
    )
    assert parse_scrape(text) == {
        ("GPU-x", None): {
            "sm_active_ratio": 0.5,
            "pcie_tx_bytes_per_s": 1048576.0,
            "nvlink_rx_bytes_per_s": 2e9,
        }
    }


def test_a_gpu_repeated_per_pod_keeps_one_value_and_blank_or_bad_values_are_left_out() -> None:
    text = (
        'DCGM_FI_PROF_DRAM_ACTIVE{UUID="GPU-x",pod="a"} 0.25\n'
        'DCGM_FI_PROF_DRAM_ACTIVE{UUID="GPU-x",pod="b"} 0.25\n'
        'DCGM_FI_PROF_SM_ACTIVE{UUID="GPU-x"} 9223372036854775794\n'  # DCGM's blank sentinel
        'DCGM_FI_PROF_SM_OCCUPANCY{UUID="GPU-x"} NaN\n'
        'DCGM_FI_PROF_PIPE_FP64_ACTIVE{gpu="0"} 0.1\n'  # no UUID: not attributable
        'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-x"} 40\n'
    )
    assert parse_scrape(text) == {("GPU-x", None): {"dram_active_ratio": 0.25}}


@pytest.mark.parametrize(
    "text", ["<html>502 Bad Gateway</html>\n", 'DCGM_FI_PROF_SM_ACTIVE{UUID="GPU-x" 0.1\n']
)
def test_text_that_is_not_prometheus_is_a_scrape_error(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse_scrape(text)


def test_fill_marks_the_source_and_matches_slices_by_gpu_instance() -> None:
    readings = parse_scrape(scrape("a100-pcie-mig.prom"))
    parent = sample(A100_MIG, mig_enabled=True)
    gi9 = sample(A100_MIG, 9)
    gi3 = sample(A100_MIG, 3)  # an instance the exporter did not list
    assert fill_samples([parent, gi9, gi3], readings) == 1
    assert (gi9["gr_engine_active_ratio"], gi9["profiling_source"]) == (0.033893, "dcgm-exporter")
    assert parent["profiling_source"] is None and parent["gr_engine_active_ratio"] is None
    assert gi3["profiling_source"] is None


def test_fill_leaves_gpm_samples_lost_gpus_and_nvml_pcie_alone() -> None:
    readings = {("GPU-h", None): {"sm_active_ratio": 0.9}, ("GPU-a", None): {"sm_active_ratio": 0.4}}
    readings[("GPU-a", None)]["pcie_tx_bytes_per_s"] = 5.0
    readings[("GPU-a", None)]["pcie_rx_bytes_per_s"] = 6.0
    gpm = sample("GPU-h", sm_active_ratio=0.1, profiling_source="gpm")
    lost = sample("GPU-h", gpu_lost=True)
    a100 = sample("GPU-a", pcie_tx_bytes_per_s=1024.0, pcie_window_ms=20)
    assert fill_samples([gpm, lost, a100], readings) == 1
    assert gpm["sm_active_ratio"] == 0.1 and lost["sm_active_ratio"] is None
    assert a100["sm_active_ratio"] == 0.4
    # NVML's own TX stays with its 20 ms window; RX, which NVML did not give, comes from DCGM.
    assert (a100["pcie_tx_bytes_per_s"], a100["pcie_window_ms"], a100["pcie_rx_bytes_per_s"]) == (
        1024.0,
        20,
        6.0,
    )
