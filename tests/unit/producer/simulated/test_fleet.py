"""The simulated fleet: deterministic, complete records, realistic mix."""

import itertools
from collections import Counter

from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec

T0 = 1_795_000_000_000


def _run(cfg: FleetConfig, ticks: int) -> tuple[list[dict], list[dict]]:
    fleet = SimulatedFleet(cfg)
    samples, xids = [], []
    for k in range(ticks):
        s, x = fleet.tick(T0 + k * cfg.interval_ms)
        samples += s
        xids += x
    return samples, xids


def test_same_seed_same_records() -> None:
    cfg = FleetConfig(nodes=4, gpus_per_node=8, seed=5, xid_rate_per_gpu_hour=100, interval_ms=10_000)
    assert _run(cfg, 50) == _run(cfg, 50)


def test_different_seed_differs() -> None:
    a = _run(FleetConfig(nodes=2, seed=1), 3)[0]
    b = _run(FleetConfig(nodes=2, seed=2), 3)[0]
    assert [r["uuid"] for r in a] != [r["uuid"] for r in b]


def test_one_sample_per_slot_per_tick_and_encodable() -> None:
    cfg = FleetConfig(nodes=10, gpus_per_node=4, seed=3)
    samples, _ = _run(cfg, 5)
    assert len(samples) == 10 * 4 * 5
    enc = AvroCodec().encoder("GpuSample")
    for r in samples:
        enc.encode(r)
    keys = Counter((r["mig"]["mig_uuid"] if r["mig"] else r["uuid"], r["timestamp_ms"]) for r in samples)
    assert max(keys.values()) == 1


def test_realistic_mix_over_simulated_hours() -> None:
    cfg = FleetConfig(nodes=40, gpus_per_node=8, seed=9, interval_ms=60_000, xid_rate_per_gpu_hour=0.5)
    samples, xids = _run(cfg, 6 * 60)  # six simulated hours at 1/min
    allocated = [r for r in samples if r["allocations"]]
    unallocated = [r for r in samples if not r["allocations"]]
    assert 0.05 < len(unallocated) / len(samples) < 0.5
    training = [r for r in allocated if (r["tensor_active_ratio"] or 0) > 0.4]
    idle_alloc = [r for r in allocated if r["gpu_util_ratio"] == 0.0]
    assert training and idle_alloc
    assert any(r["mig"] for r in samples), "some MIG slices"
    assert any(len(r["allocations"]) > 1 for r in samples), "some time-sliced GPUs"
    assert any(r["processes"] for r in samples)
    assert any(r["clock_event_reasons"] & 0x4 for r in samples), "power capping"
    assert any(r["clock_event_reasons"] & 0x20 for r in samples), "thermal throttling"
    pods = {(a["namespace"], a["pod"]) for r in allocated for a in r["allocations"]}
    assert len(pods) > 320, "pods come and go"
    codes = Counter(x["xid"] for x in xids)
    # rate 0.5/GPU-hour x 320 GPUs x 6 h = 960 expected
    assert 700 < len(xids) < 1250
    assert {13, 31, 43, 94, 119} <= set(codes)
    assert all(x["source"] == "simulated" and x["kind"] == "xid" for x in xids)


def test_energy_counter_monotonic_and_matches_power() -> None:
    cfg = FleetConfig(nodes=1, gpus_per_node=2, seed=4, interval_ms=1000)
    samples, _ = _run(cfg, 20)
    gpu0 = [r for r in samples if r["gpu_index"] == 0 and not r["mig"]]
    for a, b in itertools.pairwise(gpu0):
        delta_j = (b["total_energy_mj"] - a["total_energy_mj"]) / 1000
        assert abs(delta_j - b["power_w"]) < 1.0


def _by_host(samples: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in samples:
        out.setdefault(r["hostname"], []).append(r)
    return out


def test_forced_mig_and_time_sliced_nodes_in_a_small_fleet() -> None:
    # Seed 1's four nodes draw neither kind (L40S, H200, A100, H100), so the demo would show neither.
    plain = _by_host(_run(FleetConfig(nodes=4, gpus_per_node=8), 30)[0])
    assert not any(r["mig"] or len(r["allocations"]) > 1 for rs in plain.values() for r in rs)
    forced = _by_host(_run(FleetConfig(nodes=4, gpus_per_node=8, mig_nodes=(3,), shared_nodes=(0,)), 30)[0])
    assert any(r["mig"] for r in forced["sim-node-0003"]), "a MIG GPU on node 3"
    assert not any(r["mig"] for h, rs in forced.items() if h != "sim-node-0003" for r in rs)
    assert any(len(r["allocations"]) > 1 for r in forced["sim-node-0000"]), "a time-sliced GPU on node 0"
    # the nodes not named are exactly as drawn
    for host in ("sim-node-0001", "sim-node-0002"):
        assert forced[host] == plain[host]


def test_a_forced_mig_node_without_a_mig_model_gets_one() -> None:
    samples, _ = _run(FleetConfig(nodes=1, gpus_per_node=4, mig_nodes=(0,)), 2)  # node 0 draws an L40S
    assert {r["model_name"] for r in samples} == {"NVIDIA H100 80GB HBM3"}
    assert sum(1 for r in samples if r["mig"]) == 2 * 2  # two slices, two ticks
