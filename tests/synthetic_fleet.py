"""A deterministic synthetic fleet of GpuSample dicts, as a chargeback consumer would read them.

For tests and benchmarks of the chargeback engine: exclusive GPUs with pod churn and unallocated
spells, time-sliced GPUs shared by several pods (with and without per-process attribution), MIG
GPUs (a whole-GPU record in MIG mode plus slice records), an unknown GPU model, a GPU lost for a
while, energy counters that reset or are missing, timestamp jitter, dropped and duplicated samples,
and nodes whose samples arrive late (within or beyond the grace period). Same seed, same records.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from functools import cache
from typing import Any

NAMESPACES = ("ml-train", "ml-infer", "research-a", "research-b", "platform")
MODELS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "Acme X1")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    gpus: int = 20
    gpus_per_node: int = 4
    hours: float = 2.0
    interval_ms: int = 10_000
    start_ms: int = 1_767_225_600_000  # 2026-01-01T00:00:00Z
    partitions: int = 4
    seed: int = 7
    jitter_ms: int = 40  # +- uniform jitter on each timestamp
    drop_ratio: float = 0.01  # samples never sent
    duplicate_ratio: float = 0.005  # samples sent twice
    # Nodes whose samples are held back: (hold from, relative to start_ms; extra delay after the hold).
    # With 1 h windows and 5 min grace: the first arrives within grace, the second after its window closed.
    late: tuple[tuple[int, int], ...] = ((3_300_000, 120_000), (3_000_000, 900_000))
    late_hold_ms: int = 300_000
    # Node clocks that jump: (node number, from, relative to start_ms; jump in ms, negative = backwards).
    clock_jumps: tuple[tuple[int, int, int], ...] = ()
    mig: bool = True
    shared: bool = True
    lost: bool = True


@dataclass(frozen=True, slots=True)
class FleetRecord:
    partition: int
    offset: int
    arrival_ms: int
    sample: dict[str, Any]


@cache
def _template() -> tuple[tuple[str, Any], ...]:
    from gpupipe_schemas import catalog

    raw = catalog.current("GpuSample").raw
    return tuple((f["name"], f.get("default")) for f in raw["fields"])


def blank_sample(**fields: Any) -> dict[str, Any]:
    """A GpuSample dict with every schema field (defaults, else None), overridden by ``fields``."""
    sample = {
        name: (list(default) if isinstance(default, list) else default) for name, default in _template()
    }
    sample.update(fields)
    return sample


def partition_of(key: str, partitions: int) -> int:
    return zlib.crc32(key.encode()) % partitions


def _segments(rng: random.Random, start: int, end: int, lo_ms: int, hi_ms: int) -> list[tuple[int, int]]:
    out, t = [], start
    while t < end:
        nxt = min(end, t + rng.randrange(lo_ms, hi_ms))
        out.append((t, nxt))
        t = nxt
    return out


class _Gpu:
    """One simulated device (whole GPU, MIG parent or MIG slice) and its timeline."""

    def __init__(
        self,
        rng: random.Random,
        spec: FleetSpec,
        node: str,
        index: int,
        uuid: str,
        model: str,
        kind: str,
        mig: dict[str, Any] | None = None,
    ) -> None:
        self.node, self.index, self.uuid, self.model, self.kind, self.mig = (
            node,
            index,
            uuid,
            model,
            kind,
            mig,
        )
        end = spec.start_ms + int(spec.hours * 3_600_000)
        self.plan: list[tuple[int, int, list[tuple[str, str]], float]] = []
        for a, b in _segments(rng, spec.start_ms, end, 300_000, 2_400_000):
            roll = rng.random()
            if kind == "parent":
                pods: list[tuple[str, str]] = []
            elif kind == "shared":
                n = rng.choice((2, 2, 3))
                pods = [(rng.choice(NAMESPACES), f"svc-{rng.randrange(1000)}") for _ in range(n)]
            elif roll < 0.2:
                pods = []
            else:
                pods = [(rng.choice(NAMESPACES), f"job-{rng.randrange(10_000)}")]
            activity = rng.choice((0.0, 0.01, 0.3, 0.6, 0.9))
            self.plan.append((a, b, pods, activity))
        self.energy_mj: int | None = rng.randrange(10**9) if rng.random() < 0.85 else None
        self.reset_at = (
            spec.start_ms + rng.randrange(int(spec.hours * 3_600_000)) if rng.random() < 0.2 else None
        )
        self.lost_span: tuple[int, int] | None = None

    def at(self, t: int) -> tuple[list[tuple[str, str]], float]:
        for a, b, pods, activity in self.plan:
            if a <= t < b:
                return pods, activity
        return [], 0.0

    def sample(self, rng: random.Random, t_nominal: int, ts: int, interval_ms: int) -> dict[str, Any]:
        pods, activity = self.at(t_nominal)
        lost = self.lost_span is not None and self.lost_span[0] <= t_nominal < self.lost_span[1]
        power = 70.0 + 600.0 * activity * (self.mig["slice_fraction"] if self.mig else 1.0)
        if self.energy_mj is not None:
            if self.reset_at is not None and t_nominal >= self.reset_at:
                self.energy_mj, self.reset_at = rng.randrange(1000), None  # driver reload
            else:
                self.energy_mj += int(power * interval_ms)  # W x ms = mJ
        allocations = [
            {
                "namespace": ns,
                "pod": pod,
                "container": "main",
                "resource_name": "nvidia.com/gpu.shared" if self.kind == "shared" else "nvidia.com/gpu",
                "replica": i if self.kind == "shared" else None,
            }
            for i, (ns, pod) in enumerate(pods)
        ]
        processes = []
        if self.kind == "shared" and pods and self.index % 2 == 0:  # half the shared GPUs attribute processes
            for i, (ns, pod) in enumerate(pods):
                processes.append(
                    {
                        "pid": 1000 + i,
                        "process_name": "python",
                        "used_memory_bytes": 2**30,
                        "sm_util_ratio": round(activity * (i + 1) / len(pods), 3),
                        "mem_util_ratio": None,
                        "namespace": ns,
                        "pod": pod,
                        "container": "main",
                    }
                )
        is_slice = self.kind == "slice"
        fields: dict[str, Any] = dict(
            timestamp_ms=ts,
            hostname=self.node,
            gpu_index=self.index,
            uuid=self.uuid,
            pci_bus_id=f"00000000:{0x10 + self.index:02X}:00.0",
            model_name=self.model,
            mig=self.mig,
            mig_enabled=self.kind in ("parent", "slice"),
            allocations=[] if lost else allocations,
            processes=[] if lost else processes,
            interval_ms=interval_ms,
            gpu_lost=lost,
        )
        if not lost:
            fields.update(
                gpu_util_ratio=None if is_slice else activity,
                sm_active_ratio=activity * 0.9 if (is_slice or self.index % 3 == 0) else None,
                power_w=None if is_slice else power,
                total_energy_mj=None if is_slice else self.energy_mj,
            )
        return blank_sample(**fields)

    @property
    def key(self) -> str:
        return self.mig["mig_uuid"] if self.mig else self.uuid


def generate_fleet(spec: FleetSpec = FleetSpec()) -> list[FleetRecord]:
    """The fleet's records in arrival order, with per-partition offsets."""
    rng = random.Random(spec.seed)
    devices: list[_Gpu] = []
    nodes = max(1, spec.gpus // spec.gpus_per_node)
    for g in range(spec.gpus):
        node = f"gpu-node-{g % nodes:02d}"
        index = g // nodes
        uuid = f"GPU-{spec.seed:04x}{g:04x}-0000-4000-8000-{g:012x}"
        model = MODELS[g % len(MODELS)]
        if spec.mig and g % 10 == 0:
            devices.append(_Gpu(rng, spec, node, index, uuid, model, "parent"))
            for s, (profile, frac) in enumerate((("3g.40gb", 3 / 7), ("2g.20gb", 2 / 7), ("1g.10gb", 1 / 7))):
                mig = {
                    "mig_uuid": f"MIG-{uuid[4:]}-{s}",
                    "gpu_instance_id": s + 1,
                    "compute_instance_id": 0,
                    "profile": profile,
                    "slice_fraction": frac,
                }
                devices.append(_Gpu(rng, spec, node, index, uuid, model, "slice", mig))
        elif spec.shared and g % 10 == 1:
            devices.append(_Gpu(rng, spec, node, index, uuid, model, "shared"))
        else:
            devices.append(_Gpu(rng, spec, node, index, uuid, model, "whole"))
    if spec.lost and len(devices) > 2:
        lost = devices[2]
        lost.lost_span = (spec.start_ms + 1_800_000, spec.start_ms + 2_100_000)

    late: dict[str, tuple[int, int, int]] = {}  # node -> (from, to, delay)
    for i, (rel_from, delay) in enumerate(spec.late[:nodes]):
        a = spec.start_ms + rel_from
        late[f"gpu-node-{(i * 3 + 1) % nodes:02d}"] = (a, a + spec.late_hold_ms, delay)

    steps = int(spec.hours * 3_600_000) // spec.interval_ms
    pending: list[tuple[int, int, int, dict[str, Any]]] = []  # (arrival, seq, partition, sample)
    node_clock: dict[str, int] = {}
    seq = 0
    for k in range(steps):
        t = spec.start_ms + k * spec.interval_ms
        for dev in devices:
            if rng.random() < spec.drop_ratio:
                continue
            true_ts = t + (rng.randint(-spec.jitter_ms, spec.jitter_ms) if spec.jitter_ms else 0)
            ts = true_ts
            for node_no, rel_from, jump in spec.clock_jumps:
                if dev.node == f"gpu-node-{node_no:02d}" and t >= spec.start_ms + rel_from:
                    ts += jump
            sample = dev.sample(rng, t, ts, spec.interval_ms)
            arrival = true_ts + 50
            held = late.get(dev.node)
            if held and held[0] <= t < held[1]:
                arrival = held[1] + held[2]
            arrival = max(arrival, node_clock.get(dev.node, arrival))  # a node sends in order
            node_clock[dev.node] = arrival
            copies = 2 if rng.random() < spec.duplicate_ratio else 1
            for _ in range(copies):
                pending.append((arrival, seq, partition_of(dev.key, spec.partitions), sample))
                seq += 1
    pending.sort(key=lambda r: (r[0], r[1]))
    offsets = [0] * spec.partitions
    out = []
    for arrival, _, part, sample in pending:
        out.append(FleetRecord(part, offsets[part], arrival, sample))
        offsets[part] += 1
    return out
