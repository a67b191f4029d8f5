"""A deterministic simulated GPU fleet: many virtual nodes in one process.

Pure: no clock, no I/O. `SimulatedFleet.tick(ts_ms)` returns one `GpuSample`
dict per GPU slot (plus any `XidEvent` dicts) for that instant, so the same seed
and start time always give the same records, at any `--speed`.

What it models, per GPU slot (one slot = one whole GPU, or one MIG slice):
- pods that come and go (training for hours, long-lived bursty inference,
  notebooks that hold a GPU and do nothing, short batch jobs) and idle gaps
  in which the GPU is unallocated;
- time-sliced GPUs on some nodes (`nvidia.com/gpu.shared`, several pods, with
  per-process utilisation so per-pod shares can be computed);
- MIG on some nodes: the node's last physical GPU is split into two slices that
  occupy the node's last two slots (so the record count stays exactly
  nodes x gpus-per-node x ticks; the simulator does not emit the MIG parent
  record that the real NVML source adds);
- optionally (``hpc_nodes``) Slurm-style nodes after the others, whose GPUs are held by HPC jobs
  (allocations with ``hpc_job``, as the producer's ``--hpc-job-mapping-dir`` makes them), each
  slot with its own RNG stream so the other nodes' records do not change;
- power capping and thermal throttling (a few GPUs run hot), energy counters,
  slow ECC/row-remap counters that move with memory XIDs, and XIDs at a
  configurable rate per GPU-hour.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpupipe_producer.nvml.records import VENDOR
from gpupipe_producer.podmeta.hpc_jobs import DEFAULT_NAMESPACE as HPC_NAMESPACE
from gpupipe_producer.podmeta.hpc_jobs import job_allocation
from gpupipe_producer.simulated.models import (
    COST_CENTERS,
    MIG_LAYOUT,
    MIG_LAYOUT_H200,
    MODEL_WEIGHTS,
    MODELS,
    NAMESPACE_TEAMS,
    NAMESPACES,
    NOTEBOOK_TEAMS,
    GpuModel,
)
from gpupipe_producer.simulated.xid_text import MESSAGES, WITH_PROCESS, XID_WEIGHTS
from gpupipe_schemas import catalog

HOUR_MS = 3_600_000
DEFAULT_XID_RATE_PER_GPU_HOUR = 0.002

_IDLE, _TRAIN, _INFER, _NOTEBOOK, _BATCH = range(5)
_KIND_NAMES = {_TRAIN: "train", _INFER: "serve", _NOTEBOOK: "notebook", _BATCH: "batch"}
PRIORITY_CLASSES = {_TRAIN: "training", _INFER: "production"}
_XID_CODES = tuple(XID_WEIGHTS)
_XID_CUM = []
_acc = 0
for _c in _XID_CODES:
    _acc += XID_WEIGHTS[_c]
    _XID_CUM.append(_acc)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    nodes: int = 2
    gpus_per_node: int = 8
    interval_ms: int = 1000
    seed: int = 1
    xid_rate_per_gpu_hour: float = DEFAULT_XID_RATE_PER_GPU_HOUR
    hostname_prefix: str = "sim-node"
    mig_node_ratio: float = 0.125
    shared_node_ratio: float = 0.125
    hpc_nodes: int = 0  # extra nodes after the others, GPUs held by Slurm-style jobs (own RNG streams)
    # Nodes (indexes) that are MIG / time-sliced whatever the ratios draw: a small fleet (the demo's
    # four nodes) may draw neither, and then shows none of what those nodes look like. A MIG node
    # whose drawn model has no MIG gets the first MIG-capable model. Other nodes are unchanged.
    mig_nodes: tuple[int, ...] = ()
    shared_nodes: tuple[int, ...] = ()


@dataclass(slots=True)
class _Pod:
    namespace: str
    name: str
    kind: int
    ends_ms: int
    pid: int
    resource: str
    replica: int | None = None


@dataclass(slots=True)
class _Slot:
    """One GPU slot's static identity and evolving state."""

    rng: random.Random
    model: GpuModel
    template: dict[str, Any]
    key: str
    shared: bool
    slice_fraction: float
    hot: bool
    pods: list[_Pod] = field(default_factory=list)
    hpc: bool = False
    idle_until_ms: int = 0
    energy_mj: int = 0
    burst: bool = False
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    remap_corr: int = 0
    remap_unc: int = 0
    remap_pending: bool = False
    last_xid: int | None = None
    allocations: list[dict[str, Any]] = field(default_factory=list)


def _null_template() -> dict[str, Any]:
    """Every GpuSample field at its default, so each record is complete for the encoder."""
    out: dict[str, Any] = {}
    for f in catalog.current("GpuSample").raw["fields"]:
        out[f["name"]] = f.get("default")
    return out


def pod_metadata(namespace: str, pod: str, kind: int) -> dict[str, Any]:
    """Owner, labels and priority class of a simulated pod, derived from its name (no RNG draw, so
    adding them changed no other simulated value).

    Top controllers as real clusters have them: training runs as a Kubeflow PyTorchJob, serving as
    a Deployment (pod -> ReplicaSet -> Deployment), notebooks as Kubeflow Notebooks (pod ->
    StatefulSet -> Notebook), batch as Jobs, every other one started by a CronJob. Labels ``team``,
    ``project`` and ``cost-center``: the team follows the namespace, except in the shared
    ``notebooks`` namespace, where it comes from the notebook (so billing by the team label differs
    from billing by namespace, as it does in real clusters).
    """
    app = pod.rsplit("-", 1)[0]
    tag = int(app.rsplit("-", 1)[-1], 16)
    if kind == _TRAIN:
        owner = ("PyTorchJob", app)
    elif kind == _INFER:
        owner = ("Deployment", app)
    elif kind == _NOTEBOOK:
        owner = ("Notebook", app)
    else:
        owner = ("CronJob", app) if tag % 2 == 0 else ("Job", app)
    team = (
        NOTEBOOK_TEAMS[tag % len(NOTEBOOK_TEAMS)] if namespace == "notebooks" else NAMESPACE_TEAMS[namespace]
    )
    return {
        "owner_kind": owner[0],
        "owner_name": owner[1],
        "labels": {"team": team, "project": _KIND_NAMES[kind], "cost-center": COST_CENTERS[team]},
        "priority_class": PRIORITY_CLASSES.get(kind),
        "metadata_status": "ok",
        "hpc_job": None,
        "claim_name": None,
        "claim_namespace": None,
        "dra_pool": None,
        "dra_device": None,
        "dra_share_id": None,
    }


class SimulatedFleet:
    """The fleet. Deterministic for a given config: one RNG per slot, seeded from (seed, node, slot)."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.slots: list[_Slot] = []
        self._xid_p = cfg.xid_rate_per_gpu_hour * cfg.interval_ms / HOUR_MS
        base = _null_template()
        base["interval_ms"] = cfg.interval_ms
        for n in range(cfg.nodes):
            node_rng = random.Random(f"{cfg.seed}/node/{n}")
            model = node_rng.choices(MODELS, MODEL_WEIGHTS)[0]
            hostname = f"{cfg.hostname_prefix}-{n:04d}"
            mig = model.mig_capable and cfg.gpus_per_node >= 2 and node_rng.random() < cfg.mig_node_ratio
            shared = (not mig) and node_rng.random() < cfg.shared_node_ratio
            # Forced kinds are applied after the draws, so every other value of the node stays as drawn.
            if n in cfg.mig_nodes and cfg.gpus_per_node >= 2 and not mig:
                mig, shared = True, False
                if not model.mig_capable:
                    model = next(m for m in MODELS if m.mig_capable)
            elif n in cfg.shared_nodes and n not in cfg.mig_nodes:
                mig, shared = False, True
            numa_split = max(1, cfg.gpus_per_node // 2)
            phys_uuids = [
                str(uuid.UUID(int=node_rng.getrandbits(128), version=4)) for _ in range(cfg.gpus_per_node)
            ]
            for s in range(cfg.gpus_per_node):
                rng = random.Random(f"{cfg.seed}/slot/{n}/{s}")
                phys = s
                mig_id = None
                if mig and s >= cfg.gpus_per_node - 2:
                    phys = cfg.gpus_per_node - 2
                    layout = MIG_LAYOUT_H200 if "H200" in model.name else MIG_LAYOUT
                    j = s - phys
                    prof, slices = layout[j]
                    mig_id = {
                        "mig_uuid": "MIG-" + str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                        "gpu_instance_id": 1 + j,
                        "compute_instance_id": 0,
                        "profile": prof,
                        "slice_fraction": slices / 7,
                    }
                gpu_uuid = "GPU-" + phys_uuids[phys]
                t = dict(base)
                t.update(
                    hostname=hostname,
                    gpu_index=phys,
                    uuid=gpu_uuid,
                    pci_bus_id=f"00000000:{0x18 + 0x10 * phys:02X}:00.0",
                    model_name=model.name,
                    driver_version=model.driver_version,
                    numa_node=0 if phys < numa_split else 1,
                    mig=mig_id,
                )
                frac = mig_id["slice_fraction"] if mig_id else 1.0
                t["fb_total_bytes"] = int(model.fb_total_bytes * frac)
                t["fb_reserved_bytes"] = model.fb_reserved_bytes
                t["power_limit_w"] = model.power_limit_w
                self.slots.append(
                    _Slot(
                        rng=rng,
                        model=model,
                        template=t,
                        key=gpu_uuid,  # a slice too: gpupipe_schemas.meaning.sample_kafka_key
                        shared=shared and s % 2 == 1,
                        slice_fraction=frac,
                        hot=rng.random() < 0.03,
                        energy_mj=rng.randrange(10**9, 10**11),
                        idle_until_ms=0,
                    )
                )
        for n in range(cfg.hpc_nodes):
            self._add_hpc_node(n, base)

    def _add_hpc_node(self, n: int, base: dict[str, Any]) -> None:
        """One Slurm-style node: whole GPUs (no MIG, no time-slicing) held by HPC jobs, not pods."""
        cfg = self.cfg
        node_rng = random.Random(f"{cfg.seed}/hpc-node/{n}")
        model = MODELS[0]
        hostname = f"{cfg.hostname_prefix}-hpc-{n:02d}"
        for s in range(cfg.gpus_per_node):
            rng = random.Random(f"{cfg.seed}/hpc-slot/{n}/{s}")
            gpu_uuid = "GPU-" + str(uuid.UUID(int=node_rng.getrandbits(128), version=4))
            t = dict(base)
            t.update(
                hostname=hostname,
                gpu_index=s,
                uuid=gpu_uuid,
                pci_bus_id=f"00000000:{0x18 + 0x10 * s:02X}:00.0",
                model_name=model.name,
                driver_version=model.driver_version,
                numa_node=0 if s < max(1, cfg.gpus_per_node // 2) else 1,
                mig=None,
                fb_total_bytes=model.fb_total_bytes,
                fb_reserved_bytes=model.fb_reserved_bytes,
                power_limit_w=model.power_limit_w,
            )
            self.slots.append(
                _Slot(
                    rng,
                    model,
                    t,
                    gpu_uuid,
                    False,
                    1.0,
                    False,
                    energy_mj=rng.randrange(10**9, 10**11),
                    hpc=True,
                )
            )

    @property
    def gpu_count(self) -> int:
        return len(self.slots)

    # -- pod lifecycle ------------------------------------------------------------
    def _new_pod(self, slot: _Slot, ts_ms: int, replica: int | None = None) -> _Pod:
        rng = slot.rng
        if slot.hpc:  # a Slurm job: training or batch, a numeric job id
            kind = rng.choices((_TRAIN, _BATCH), (60, 40))[0]
            life = int(rng.uniform(*((2, 8) if kind == _TRAIN else (0.5, 2))) * HOUR_MS)
            job = str(rng.randrange(100_000, 1_000_000))
            return _Pod(HPC_NAMESPACE, job, kind, ts_ms + life, rng.randrange(1000, 4_000_000), "", None)
        if slot.shared:
            kind = _INFER
        else:
            kind = rng.choices((_TRAIN, _INFER, _NOTEBOOK, _BATCH), (35, 30, 15, 20))[0]
        hours = {_TRAIN: (2, 12), _INFER: (4, 48), _NOTEBOOK: (1, 8), _BATCH: (0.5, 3)}[kind]
        life = int(rng.uniform(*hours) * HOUR_MS)
        ns = rng.choice(NAMESPACES[4:6] if kind == _NOTEBOOK else NAMESPACES)
        if kind == _NOTEBOOK:
            ns = "notebooks"
        elif kind == _INFER and ns in ("llm-training", "notebooks"):
            ns = "inference-prod"
        app = f"{_KIND_NAMES[kind]}-{rng.getrandbits(20):05x}"
        name = f"{app}-{rng.getrandbits(32):08x}"[:40]
        resource = "nvidia.com/gpu.shared" if slot.shared else "nvidia.com/gpu"
        mig = slot.template["mig"]
        if mig is not None:
            resource = f"nvidia.com/mig-{mig['profile']}"
        return _Pod(ns, name, kind, ts_ms + life, rng.randrange(1000, 4_000_000), resource, replica)

    def _churn(self, slot: _Slot, ts_ms: int) -> None:
        changed = False
        if slot.pods and any(p.ends_ms <= ts_ms for p in slot.pods):
            slot.pods = [p for p in slot.pods if p.ends_ms > ts_ms]
            changed = True
            if not slot.pods:
                # Gap before the next pod: mostly short, sometimes hours (unallocated capacity).
                gap_h = slot.rng.choice((0.05, 0.1, 0.25, 0.5, 1.0, 3.0))
                slot.idle_until_ms = ts_ms + int(gap_h * HOUR_MS)
        want = (2 + slot.rng.randrange(2)) if slot.shared else 1
        if not slot.pods and ts_ms >= slot.idle_until_ms:
            if slot.idle_until_ms == 0 and slot.rng.random() < 0.15:
                slot.idle_until_ms = ts_ms + int(slot.rng.uniform(0.2, 2.0) * HOUR_MS)
            else:
                for i in range(want):
                    slot.pods.append(self._new_pod(slot, ts_ms, i if slot.shared else None))
                changed = True
        if changed and slot.hpc:
            slot.allocations = [job_allocation(p.name, HPC_NAMESPACE) for p in slot.pods]
        elif changed:
            slot.allocations = [
                {
                    "namespace": p.namespace,
                    "pod": p.name,
                    "container": "main",
                    "resource_name": p.resource,
                    "replica": p.replica,
                    **pod_metadata(p.namespace, p.name, p.kind),
                }
                for p in slot.pods
            ]

    # -- the tick -------------------------------------------------------------------
    def tick(self, ts_ms: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Samples (one per slot, in slot order) and XID events for instant `ts_ms`."""
        samples = []
        xids: list[dict[str, Any]] = []
        dt_s = self.cfg.interval_ms / 1000.0
        xid_p = self._xid_p
        for slot in self.slots:
            self._churn(slot, ts_ms)
            rec = self._sample(slot, ts_ms, dt_s)
            if xid_p and slot.rng.random() < xid_p:
                xids.append(self._xid(slot, rec, ts_ms))
            samples.append(rec)
        return samples, xids

    def _sample(self, slot: _Slot, ts_ms: int, dt_s: float) -> dict[str, Any]:
        rng = slot.rng
        rnd = rng.random
        m = slot.model
        frac = slot.slice_fraction
        rec = dict(slot.template)
        rec["timestamp_ms"] = ts_ms
        rec["allocations"] = slot.allocations
        pods = slot.pods
        kind = pods[0].kind if pods else _IDLE
        reasons = 0
        if kind == _TRAIN:
            util = 0.93 + 0.07 * rnd()
            sm = 0.80 + 0.15 * rnd()
            tensor = 0.45 + 0.25 * rnd()
            dram = 0.35 + 0.25 * rnd()
            mem_frac = 0.88 + 0.08 * rnd()
            power = m.power_limit_w * (0.86 + 0.16 * rnd())
        elif kind == _INFER:
            if rnd() < 0.15:
                slot.burst = not slot.burst
            util = (0.55 + 0.4 * rnd()) if slot.burst else (0.03 + 0.15 * rnd())
            sm = util * (0.7 + 0.2 * rnd())
            tensor = util * (0.25 + 0.2 * rnd())
            dram = util * (0.4 + 0.3 * rnd())
            mem_frac = 0.55 + 0.1 * rnd()
            power = m.idle_power_w + (m.power_limit_w - m.idle_power_w) * util * 0.8
        elif kind == _BATCH:
            util = 0.6 + 0.35 * rnd()
            sm = util * 0.85
            tensor = util * 0.15
            dram = util * 0.5
            mem_frac = 0.4 + 0.3 * rnd()
            power = m.idle_power_w + (m.power_limit_w - m.idle_power_w) * util * 0.7
        else:  # idle notebook or unallocated
            util = 0.0 if rnd() < 0.9 else 0.01 * rnd()
            sm = util
            tensor = 0.0
            dram = 0.0
            mem_frac = (0.05 + 0.05 * rnd()) if kind == _NOTEBOOK else 0.006
            power = m.idle_power_w * (0.95 + 0.1 * rnd())
            reasons = 0x1  # GpuIdle
        power *= frac
        if power > m.power_limit_w * frac * 0.97:
            power = m.power_limit_w * frac
            reasons |= 0x4  # SwPowerCap
        temp = 32.0 + 50.0 * power / (m.power_limit_w * frac) + 4.0 * rnd() + (14.0 if slot.hot else 0.0)
        sm_clock = m.sm_clock_max_mhz if util > 0.05 else 345
        if temp > 87.0:
            reasons |= 0x20  # SwThermalSlowdown
            sm_clock = int(sm_clock * 0.8)
        slot.energy_mj += int(power * dt_s * 1000)
        fb_total = rec["fb_total_bytes"]
        used = int(fb_total * mem_frac)
        rec["gpu_util_ratio"] = None if slot.template["mig"] else int(util * 1000 + 0.5) / 1000
        rec["mem_copy_util_ratio"] = None if slot.template["mig"] else int((dram * 0.9) * 1000 + 0.5) / 1000
        rec["enc_util_ratio"] = 0.0
        rec["dec_util_ratio"] = 0.0
        rec["fb_used_bytes"] = used
        rec["fb_free_bytes"] = (
            fb_total - used - m.fb_reserved_bytes if fb_total > used + m.fb_reserved_bytes else 0
        )
        rec["power_w"] = int(power * 100 + 0.5) / 100
        rec["total_energy_mj"] = slot.energy_mj
        rec["gpu_temp_c"] = int(temp + 0.5)
        rec["memory_temp_c"] = int(temp + 6 + 0.5)
        rec["sm_clock_mhz"] = sm_clock
        rec["mem_clock_mhz"] = m.mem_clock_mhz
        rec["clock_event_reasons"] = reasons
        rec["pcie_tx_bytes_per_s"] = int(util * 2.1e9 * rnd() + 0.5)
        rec["pcie_rx_bytes_per_s"] = int(util * 3.4e9 * rnd() + 0.5)
        rec["pcie_replay_count"] = 0
        rec["ecc_sbe_volatile_total"] = slot.ecc_sbe
        rec["ecc_dbe_volatile_total"] = slot.ecc_dbe
        rec["ecc_sbe_aggregate_total"] = slot.ecc_sbe
        rec["ecc_dbe_aggregate_total"] = slot.ecc_dbe
        rec["remapped_rows_correctable"] = slot.remap_corr
        rec["remapped_rows_uncorrectable"] = slot.remap_unc
        rec["row_remap_pending"] = slot.remap_pending
        rec["row_remap_failure"] = False
        rec["last_xid"] = slot.last_xid
        rec["sm_active_ratio"] = int(sm * 1000 + 0.5) / 1000
        rec["sm_occupancy_ratio"] = int((sm * 0.55) * 1000 + 0.5) / 1000
        rec["tensor_active_ratio"] = int(tensor * 1000 + 0.5) / 1000
        rec["dram_active_ratio"] = int(dram * 1000 + 0.5) / 1000
        rec["gr_engine_active_ratio"] = int(util * 1000 + 0.5) / 1000
        if m.hopper_or_newer:
            rec["fp64_active_ratio"] = 0.0
            rec["fp32_active_ratio"] = int((sm * 0.2) * 1000 + 0.5) / 1000
            rec["fp16_active_ratio"] = int((tensor * 0.1) * 1000 + 0.5) / 1000
            nv = util * 1.8e10 * rnd() if kind == _TRAIN else 0.0
            rec["nvlink_tx_bytes_per_s"] = int(nv + 0.5)
            rec["nvlink_rx_bytes_per_s"] = int(nv + 0.5)
        if slot.shared and pods:
            shares = [rnd() + 0.1 for _ in pods]
            tot = sum(shares)
            rec["processes"] = [
                {
                    "pid": p.pid,
                    "process_name": "python3",
                    "used_memory_bytes": used // len(pods),
                    "sm_util_ratio": int((util * s / tot) * 1000 + 0.5) / 1000,
                    "mem_util_ratio": None,
                    "namespace": p.namespace,
                    "pod": p.name,
                    "container": "main",
                }
                for p, s in zip(pods, shares, strict=True)
            ]
        return rec

    def _xid(self, slot: _Slot, rec: dict[str, Any], ts_ms: int) -> dict[str, Any]:
        rng = slot.rng
        code = rng.choices(_XID_CODES, cum_weights=_XID_CUM)[0]
        slot.last_xid = code
        if code == 48:
            slot.ecc_dbe += 1
        elif code == 63:
            slot.remap_unc += 1
            slot.remap_pending = True
        elif code == 94:
            slot.ecc_dbe += 1
        pod = slot.pods[0] if slot.pods else None
        with_proc = code in WITH_PROCESS and pod is not None
        mig = rec["mig"]
        bus = rec["pci_bus_id"]
        return {
            "event_id": f"{rec['hostname']}/{bus}/{code}/{ts_ms}/sim",
            "timestamp_ms": ts_ms,
            "hostname": rec["hostname"],
            "kind": "xid",
            "xid": code,
            "pci_bus_id": bus,
            "gpu_index": rec["gpu_index"],
            "uuid": rec["uuid"],
            "model_name": rec["model_name"],
            "driver_version": rec["driver_version"],
            "pid": pod.pid if with_proc else None,
            "process_name": "python3" if with_proc else None,
            "message": MESSAGES[code],
            "gpu_instance_id": mig["gpu_instance_id"] if mig else None,
            "compute_instance_id": mig["compute_instance_id"] if mig else None,
            "mig_uuid": mig["mig_uuid"] if mig else None,
            "source": "simulated",
            "vendor": VENDOR,
            "allocations": slot.allocations,
            "boot_id": None,  # a simulated node never reboots: no boot to tell apart
            "operational": None,  # a simulated XID is a legacy report, never an operational event
        }
