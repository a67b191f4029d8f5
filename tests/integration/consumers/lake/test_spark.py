"""Three readers of one lake agree: Apache Spark (the shipped recompute recipe, through Iceberg's
JdbcCatalog on the SQLite file pyiceberg writes), DuckDB
(`gpupipe lake query`) and the chargeback windows themselves; and Spark's recompute from the raw
samples matches what the chargeback engine billed from the same samples to 1e-9 relative.

No Kafka: the samples go through the real chargeback engine and, with the windows it closes, through
the real lake writer (tests/lake_chargeback.py). The same readers over a REST catalog with an S3
warehouse: test_rest_s3.py."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog

from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.lake_chargeback import (
    FIELDS,
    INTERVAL_MS,
    PRICES,
    RECIPE,
    T0,
    assert_duckdb_agrees,
    assert_spark_agrees,
    build_lake,
    close,
)
from tests.lake_records import end_pyiceberg_threads
from tests.spark_recipe import run_recipe

pytestmark = pytest.mark.integration

#: (the catalog, the catalog flags of the recipe and the CLI, the CLI's extra environment)
Lake = tuple[Catalog, list[str], dict[str, str]]


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    yield
    end_pyiceberg_threads()


@pytest.fixture
def lake(tmp_path: Path) -> Iterator[tuple[Catalog, list[str], dict[str, str]]]:
    """The lake on the embedded SQLite catalog. Behind a REST catalog server (with its warehouse in
    S3, the production path) the same checks run in test_rest_s3.py."""
    (tmp_path / "warehouse").mkdir()
    uri = f"sqlite:///{tmp_path}/catalog.db"
    flags = ["--catalog-uri", uri, "--warehouse", str(tmp_path / "warehouse")]
    yield SqlCatalog("gpupipe", uri=uri, warehouse=(tmp_path / "warehouse").as_uri()), flags, {}


def test_spark_recompute_and_three_readers_agree(lake: Lake, tmp_path: Path) -> None:
    cat, flags, env = lake
    engine = build_lake(cat).billed
    assert {"__unallocated__", "__unattributed__"} <= set(engine)
    # Spark's recompute from the raw samples against what chargeback billed (Spark reading the
    # windows table, and the engine's own records).
    assert_spark_agrees(engine, flags, tmp_path)
    # DuckDB through the CLI, the same tables.
    assert_duckdb_agrees(engine, flags, {**os.environ, **env})


SHARED_HOURS = 2
#: Hand-made tenants of the shared GPUs, each in a namespace of its own so that the test sees
#: every rule's namespace billed (and the bill would miss it if the rule were left out).
ALONE = ("tenant-alone", "alone-0")  # one pod on a 4-replica GPU
THREE = ("tenant-three", "three-0")  # one pod holding 3 of 4 replicas
POD_C = ("tenant-c", "c-0")
POD_D = ("tenant-d", "d-0")
GUEST = ("tenant-guest", "guest-0")  # runs on a GPU it does not hold
DRA_E = ("tenant-dra-e", "e-0")
DRA_F = ("tenant-dra-f", "f-0")
DRA_G = ("tenant-dra-g", "g-0")
HAND_MADE = {p[0] for p in (ALONE, THREE, POD_C, POD_D, GUEST, DRA_E, DRA_F, DRA_G)}


def _alloc(
    pod: tuple[str, str], replica: int | None, container: str = "main", dra: bool = False
) -> dict[str, Any]:
    ns, name = pod
    return {
        "namespace": ns,
        "pod": name,
        "container": container,
        "resource_name": None if dra else "nvidia.com/gpu.shared",
        "replica": replica,
        "owner_kind": None,
        "owner_name": None,
        "labels": {},
        "priority_class": None,
        "metadata_status": "ok",
        "hpc_job": None,
        "claim_name": f"{name}-gpu" if dra else None,
        "claim_namespace": ns if dra else None,
        "dra_pool": "gpus" if dra else None,
        "dra_device": "gpu-0" if dra else None,
    }


def _proc(
    pod: tuple[str | None, str | None], sm: float | None, memory: int | None = 2 * 10**9, pid: int = 100
) -> dict[str, Any]:
    return {
        "pid": pid,
        "process_name": "python3",
        "used_memory_bytes": memory,
        "sm_util_ratio": sm,
        "mem_util_ratio": None,
        "namespace": pod[0],
        "pod": pod[1],
        "container": "main",
    }


def _time_sliced(s: dict[str, Any], i: int) -> None:
    """A time-sliced GPU through every case of the shared-GPU rule, 40 samples each."""
    phase = (i // 40) % 12
    s["shared_replicas"] = None
    s["sm_active_ratio"] = 0.4
    two = [_alloc(POD_C, 0), _alloc(POD_D, 1)]
    if phase == 0:  # alone on 4 replicas: the idle 3/4 is __unallocated__
        s.update(shared_replicas=4, allocations=[_alloc(ALONE, 0)], processes=[_proc(ALONE, 0.3)])
    elif phase == 1:  # 3 of 4 replicas (one of them in two containers)
        allocs = [_alloc(THREE, 0), _alloc(THREE, 1), _alloc(THREE, 2), _alloc(THREE, 1, "sidecar")]
        procs = [_proc(THREE, 0.3), _proc(THREE, 0.2, pid=101)]
        s.update(shared_replicas=4, allocations=allocs, processes=procs)
    elif phase == 2:  # a process no pod owns (split among holders) and a guest that holds nothing
        procs = [_proc(POD_C, 0.2), _proc(POD_D, 0.1), _proc((None, None), 0.15), _proc(GUEST, 0.05)]
        s.update(allocations=two, processes=procs)
    elif phase == 3:  # SM over the whole GPU: scaled down (and one process clamped to 1)
        procs = [_proc(POD_C, 1.4), _proc(POD_D, 0.7), _proc(("", "x"), 0.1)]
        s.update(allocations=two, processes=procs)
    elif phase == 4:  # no SM per process: activity by memory
        procs = [_proc(POD_C, None, 3 * 10**9), _proc(POD_D, None, 10**9), _proc((None, None), None, 10**9)]
        s.update(allocations=two, processes=procs)
    elif phase == 5:  # nothing measures use: by allocation, of 3 replicas
        s.update(shared_replicas=3, allocations=two, processes=[])
    elif phase == 6:  # zero SM and zero activity (or none): by allocation too
        s.update(allocations=two, processes=[_proc(POD_C, 0.0), _proc(POD_D, None)], sm_active_ratio=0.0)
        if i % 2:
            s.update(sm_active_ratio=None, gpu_util_ratio=None)
    elif phase == 7:  # lost: __unallocated__, whoever holds it
        s.update(allocations=two, processes=[_proc(POD_C, 0.2)], gpu_lost=True)
    elif phase == 8:  # the kubelet could not say: __unattributed__
        s.update(allocations=[], allocations_known=False, processes=[_proc(POD_C, 0.2)])
    elif phase == 9:  # all 4 replicas: exclusive, the guest's use is the holder's
        allocs = [_alloc(THREE, r) for r in range(4)]
        s.update(shared_replicas=4, allocations=allocs, processes=[_proc(THREE, 0.2), _proc(GUEST, 0.3)])
    elif phase == 10:  # SM of the holders only, a shared_replicas below the replicas held
        s.update(shared_replicas=1, allocations=two, processes=[_proc(POD_C, 0.25), _proc(POD_D, 0.5)])
    else:  # no pod: __unallocated__
        s.update(allocations=[], processes=[])


def _dra_shared(s: dict[str, Any], i: int) -> None:
    """A DRA-shared GPU (devices without replica ids: one unit per pod), 60 samples per case."""
    phase = (i // 60) % 4
    s["sm_active_ratio"] = 0.3
    if phase == 0:
        allocs = [_alloc(DRA_E, None, dra=True), _alloc(DRA_F, None, dra=True)]
        s.update(allocations=allocs, processes=[_proc(DRA_E, 0.25), _proc(DRA_F, 0.1)])
    elif phase == 1:  # one claim alone: exclusive
        s.update(allocations=[_alloc(DRA_G, None, dra=True)], processes=[_proc(DRA_G, 0.1)])
    elif phase == 2:  # three claims, no per-process measure: a third each
        pods = (DRA_E, DRA_F, DRA_G)
        s.update(allocations=[_alloc(p, None, dra=True) for p in pods], processes=[])
    else:  # one claim on a device shared 2 ways
        s.update(
            shared_replicas=2, allocations=[_alloc(DRA_G, None, dra=True)], processes=[_proc(DRA_G, 0.4)]
        )


def shared_fleet_samples() -> list[dict[str, Any]]:
    """Two hours of 4 nodes: two MIG nodes (whole GPUs and a GPU in two slices each, with the MIG
    parent record NVML adds: one node bills the parent's energy by slice, the other leaves it to
    ``__mig_shared__`` and leaves 2/7 of the GPU unconfigured) and two time-sliced nodes (two GPUs
    as simulated, one through every shared-GPU case by hand, one DRA-shared)."""
    codec = AvroCodec()
    enc = codec.encoder("GpuSample")
    fleet = SimulatedFleet(
        FleetConfig(
            nodes=4,
            gpus_per_node=4,
            interval_ms=INTERVAL_MS,
            mig_node_ratio=0,
            shared_node_ratio=0,
            mig_nodes=(0, 1),
            shared_nodes=(2, 3),
        )
    )
    out: list[dict[str, Any]] = []
    for i in range(SHARED_HOURS * 3_600_000 // INTERVAL_MS):
        samples, _ = fleet.tick(T0 + i * INTERVAL_MS)
        assert [bool(s["mig"]) for s in samples[:8]] == [False, False, True, True] * 2
        assert all(s["processes"] for s in (samples[13], samples[15]) if s["allocations"])
        _time_sliced(samples[9], i)
        _dra_shared(samples[11], i)
        if i == 200:
            samples[7]["gpu_lost"] = True  # a lost slice
        for node, by_slice in ((0, True), (1, False)):
            slices = samples[node * 4 + 2 : node * 4 + 4]
            parent = dict(slices[0], mig=None, mig_enabled=True, allocations=[], processes=[])
            counter = sum(s["total_energy_mj"] for s in slices)
            if by_slice and i >= 400:  # driver reload: the parent's counter starts again
                counter -= 10**9
            parent["total_energy_mj"] = None if by_slice and i == 500 else counter
            parent["power_w"] = sum(s["power_w"] for s in slices)
            parent["mig_energy_by_slice"] = by_slice
            configured = 0.0
            for s in slices:
                if by_slice and s is slices[1] and 600 <= i < 660:
                    s["drop"] = True  # its slice destroyed for 10 minutes: 3/7 uncovered
                    continue
                configured += s["mig"]["slice_fraction"]
                s["mig_enabled"] = True
                if by_slice:  # NVML has no counter per slice: each carries the parent's
                    s["total_energy_mj"] = None
                    s["mig_parent_energy_mj"] = parent["total_energy_mj"]
            parent["mig_configured_fraction"] = configured if by_slice else 5 / 7
            samples.append(parent)
        out.extend(codec.decode(enc.encode(s)).record for s in samples if not s.pop("drop", False))
    return out


def test_spark_recompute_shared_and_mig_gpus(tmp_path: Path) -> None:
    """The fair-share rules: time-sliced and DRA-shared GPUs by measured use and replicas held,
    MIG slices by their fraction of the GPU (time and the parent's energy), the parent's uncovered
    capacity and unsliced energy; the recompute agrees with the engine for every namespace."""
    (tmp_path / "warehouse").mkdir()
    uri = f"sqlite:///{tmp_path}/catalog.db"
    cat = SqlCatalog("gpupipe", uri=uri, warehouse=(tmp_path / "warehouse").as_uri())
    written = build_lake(cat, shared_fleet_samples())
    engine, windows = written.billed, written.windows
    assert HAND_MADE | {"__unallocated__", "__unattributed__", "__mig_shared__"} <= set(engine)
    assert sum(w["shared_gpu_seconds"] for w in windows) > 3600
    assert sum(w["mig_gpu_seconds"] for w in windows) > 3600
    assert engine["__mig_shared__"]["energy_joules"] > 0
    end = T0 + SHARED_HOURS * 3_600_000
    flags = ["--catalog-uri", uri, "--warehouse", str(tmp_path / "warehouse")]
    spark = run_recipe(
        RECIPE, [*flags, "--prices", str(PRICES), "--start", str(T0), "--end", str(end)], tmp_path
    )
    got = spark["recomputed"]
    wrong = [
        (ns, f, got[ns][f] if ns in got else None, want[f])
        for ns, want in sorted(engine.items())
        for f in FIELDS
        if ns not in got or not close(got[ns][f], want[f])
    ]
    assert not wrong, "differ (namespace, field, Spark, engine): " + "; ".join(map(str, wrong))
    assert set(got) == set(spark["billed"]) == set(engine)
    assert set(spark) == {"recomputed", "billed"}  # nothing is left out any more
