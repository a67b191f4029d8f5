"""Per-link NVLink counters through the real pynvml calls on the NVML double: what
``nvlink_link_counters`` carries for NVLink 4 (nvmlDeviceGetNvLinkErrorCounter) and NVLink 5 (field
values), the link's far end read once, and what a GPU without NVLink or a down link gives."""

from __future__ import annotations

import pynvml

from tests.fake_nvml import FakeNvml
from tests.fake_nvml_topology import GPU
from tests.unit.producer.nvml.test_source import by_gpu, make, tick

FLIT, DATA = pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA
REPLAY, RECOVERY = pynvml.NVML_NVLINK_ERROR_DL_REPLAY, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY


def test_each_link_carries_its_counters_state_and_peer() -> None:
    fake = FakeNvml.node("H100", 2)
    g0, g1 = fake.gpus
    g0.nvlink_dl_errors = {(3, FLIT): 12, (3, DATA): 2, (3, REPLAY): 14, (3, RECOVERY): 1}
    g0.nvlink_remote = {5: (GPU, g1.pci_bus_id)}
    g0.nvlink_down = {7}
    _, src, clock, hooks = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock, 10.0))[0]
    links = {e["link"]: e for e in s["nvlink_link_counters"]}
    assert sorted(links) == list(range(18))
    assert links[3] == {
        "link": 3,
        "up": True,
        "peer": "nvswitch",
        "crc_flit": 12,
        "crc_data": 2,
        "replay": 14,
        "recovery": 1,
        "rcv": 0,
        "symbol": 0,
        "recovery_failed": 0,
    }
    assert links[5]["peer"] == g1.pci_bus_id
    assert (links[7]["up"], links[7]["peer"], links[7]["crc_flit"]) == (False, None, None), (
        "a down link is not asked"
    )
    # the counters move, the far end is read once per link
    g0.nvlink_dl_errors[(3, FLIT)] = 40
    s = by_gpu(tick(src, clock, 10.0))[0]
    assert s["nvlink_link_counters"][3]["crc_flit"] == 40
    assert fake.count("nvmlDeviceGetNvLinkRemoteDeviceType", gpu=0) == 17
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter", gpu=0) == 3 * 17 * 4, (
        "three polls, four counters of 17 active links"
    )
    assert hooks.errors == [] and src.error_counts == {}
    src.shutdown()


def test_a_reset_shows_as_counters_back_at_zero() -> None:
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    g.nvlink_dl_errors = {(0, REPLAY): 9}
    _, src, clock, _ = make(fake)
    src.poll()
    assert by_gpu(tick(src, clock, 10.0))[0]["nvlink_link_counters"][0]["replay"] == 9
    fake.nvmlDeviceResetNvLinkErrorCounters(fake.nvmlDeviceGetHandleByIndex(0), 0)
    assert by_gpu(tick(src, clock, 10.0))[0]["nvlink_link_counters"][0]["replay"] == 0
    src.shutdown()


def test_nvlink5_counts_by_field_and_a_refused_counter_is_learned_once() -> None:
    fake = FakeNvml.node("H100", 1)
    g = fake.gpus[0]
    g.nvlink_rcv_errors = {2: 5}
    g.nvlink_symbol_errors = {2: 7}
    g.nvlink_recovery_failed = {2: 1}
    g.fail("nvmlDeviceGetNvLinkErrorCounter", pynvml.NVML_ERROR_NOT_SUPPORTED, times=10**6)
    _, src, clock, _ = make(fake)
    src.poll()
    for _ in range(3):
        s = by_gpu(tick(src, clock, 10.0))[0]
    e = s["nvlink_link_counters"][2]
    assert (e["rcv"], e["symbol"], e["recovery_failed"]) == (5, 7, 1)
    assert (e["crc_flit"], e["replay"], e["recovery"]) == (None, None, None)
    # one refusal per counter, for every link of the GPU
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter", gpu=0) == 4
    assert src.error_counts == {}
    src.shutdown()


def test_a_gpu_without_nvlink_and_a_mig_slice_carry_no_links() -> None:
    fake = FakeNvml.node("L40S", 1)
    _, src, clock, _ = make(fake)
    src.poll()
    s = by_gpu(tick(src, clock, 10.0))[0]
    assert s["nvlink_link_counters"] == [] and s["nvlink_links"] is None
    assert fake.count("nvmlDeviceGetNvLinkErrorCounter") == 0
    src.shutdown()


def test_the_links_ride_only_on_the_samples_of_the_polls_that_read_them() -> None:
    fake = FakeNvml.node("H100", 1)
    _, src, clock, _ = make(fake)
    src.poll()  # every group runs on the first poll
    sizes = [len(by_gpu(tick(src, clock, 1.0))[0]["nvlink_link_counters"]) for _ in range(20)]
    assert sizes.count(18) == 2 and set(sizes) == {0, 18}, sizes  # the fabric group's 10 s
    assert by_gpu(tick(src, clock, 1.0))[0]["nvlink_links"] == 18, "the scalar fields stay on every sample"
    src.shutdown()
