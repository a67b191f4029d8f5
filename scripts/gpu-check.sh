#!/usr/bin/env bash
# gpu-check: run the NVML source (and the XID inputs) once on a real GPU node and record what it sees.
#
#   scripts/gpu-check.sh [OUT_DIR]        # default: $OUT if set, else ./gpu-check-out
#
# Writes into OUT_DIR (and prints report.txt):
#   report.txt      versions, every GPU, supported / unsupported GpuSample fields per GPU (and MIG
#                   slice), NVML errors, CPU time per collection tick, XID event registration, which
#                   GPU Operational Event calls work (registration, v3 wait, CPER read), which
#                   newer memory-health and power-smoothing reads answer (bank remapper, unrepairable
#                   memory, recovery action, NVML_FI_PWR_SMOOTHING_*), the per-link NVLink state,
#                   far end and error counters (nvmlDeviceGetNvLinkErrorCounter) and whether
#                   nvmlDeviceGetNvLinkTelemetrySamples_v1 exists,
#                   the kernel-log backlog parse, a kubelet List if the socket is there
#   sample.json     one real GpuSample per GPU and MIG slice (pretty JSON, after every group ran)
#   summary.json    the same figures, machine-readable
#   nvidia-smi.txt  `nvidia-smi -q` for context (if nvidia-smi exists)
#
# Needs Python 3.9+ with nvidia-ml-py and fastavro importable: the repo's .venv, or a folder of
# packages named by GPUCHECK_DEPS (default ./.gpucheck; see docs/real-gpu.md). GPUCHECK_FAKE_NVML=H100:8
# does a dry run against the tests' fake NVML (checks the script, reads no GPU). Read-only: it sets no
# GPU state, starts no workload, and only reads /dev/kmsg's backlog. Takes about 15 s.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
DEPS=${GPUCHECK_DEPS:-.gpucheck}
if [ -d "$DEPS" ]; then
  export PYTHONPATH="$PWD/$DEPS${PYTHONPATH:+:$PYTHONPATH}"
fi
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import pynvml' 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -q >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
fi

"$PY" - "$OUT_DIR" <<'PY' 2>&1 | tee "$OUT_DIR/report.txt"
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
out_dir = Path(sys.argv[1])

from gpupipe_producer.nvml import NvmlSource, XidEventWatcher, default_nvml_module  # noqa: E402
from gpupipe_producer.nvml.records import METRIC_FIELDS  # noqa: E402

summary: dict = {"host": platform.node(), "python": platform.python_version()}


def section(title: str) -> None:
    print(f"\n== {title}")


fake_spec = os.environ.get("GPUCHECK_FAKE_NVML")  # dry run of this script without a GPU (tests' fake)
if fake_spec:
    sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
    from tests.fake_nvml_cli import build

    nvml = build(fake_spec)
    print(f"DRY RUN with the fake NVML ({fake_spec}): no real GPU was read")
    summary["dry_run"] = fake_spec
else:
    nvml = default_nvml_module()
try:
    from importlib.metadata import version

    summary["nvidia_ml_py"] = version("nvidia-ml-py")
except Exception:
    summary["nvidia_ml_py"] = getattr(nvml, "__version__", "unknown")

# 1. Every group on every poll: short intervals, three polls (GPM needs two samples >= 100 ms apart).
section("NVML source: one complete sample per GPU / MIG slice")
src = NvmlSource(nvml, platform.node(), {k: 0.25 for k in ("fast", "slow", "profiling", "processes", "mig")})
t0 = time.perf_counter()
try:
    src.start()
except Exception as exc:  # NvmlInitError: no driver, no GPU, no permission
    print(f"gpu-check: {exc}")
    sys.exit(2)
summary["start_s"] = round(time.perf_counter() - t0, 4)
samples = []
for _ in range(3):
    time.sleep(0.3)
    samples = src.poll()
summary["driver_version"] = samples[0]["driver_version"] if samples else None
print(f"driver {summary['driver_version']}, nvidia-ml-py {summary['nvidia_ml_py']}, {len(src.gpus())} GPU(s),"
      f" {len(samples)} record(s), start {summary['start_s']} s")
(out_dir / "sample.json").write_text(json.dumps(samples, indent=2, sort_keys=False) + "\n")
if samples:
    print(json.dumps(samples[0], indent=2))

section("supported / unsupported fields per GPU (null = NVML could not give it)")
per_device = []
for s in samples:
    mig = s.get("mig")
    name = f"GPU {s['gpu_index']} {s['model_name']}" + (f" MIG {mig['profile']} gi={mig['gpu_instance_id']}" if mig else "")
    fields = [f for f in METRIC_FIELDS if f != "last_xid"]  # last_xid is the agent's, not NVML's
    have = [f for f in fields if s.get(f) is not None]
    null = [f for f in fields if s.get(f) is None]
    learned = sorted(src.unsupported(s["gpu_index"], mig["gpu_instance_id"] if mig else None))
    per_device.append({"device": name, "uuid": s["uuid"], "mig_uuid": mig and mig["mig_uuid"],
                       "supported": have, "null": null, "learned_unsupported_calls": learned,
                       "processes": len(s.get("processes") or []), "gpu_lost": s.get("gpu_lost")})
    print(f"{name} ({mig['mig_uuid'] if mig else s['uuid']}): {len(have)}/{len(fields)} fields")
    print(f"  supported:   {', '.join(have)}")
    print(f"  null:        {', '.join(null) or '-'}")
    print(f"  unsupported NVML calls learned: {', '.join(learned) or '-'}")
summary["devices"] = per_device
summary["nvml_errors"] = dict(src.error_counts)
summary["garbage"] = dict(src.garbage_counts)
summary["collector_failures"] = dict(src.collector_failures)
print(f"NVML errors {summary['nvml_errors']}, garbage {summary['garbage']}, collector failures {summary['collector_failures']}")
try:
    from gpupipe_schemas.codec import AvroCodec

    enc = AvroCodec().encoder("GpuSample").encode
    sizes = [len(enc(s)) for s in samples]
    summary["avro_bytes_per_sample"] = sizes
    print(f"every sample encodes (Avro bytes: {sizes})")
except Exception as exc:  # report, do not stop the check
    summary["encode_error"] = repr(exc)
    print(f"ENCODE FAILED: {exc!r}")

# 1b. The GPU topology record (NUMA, CPU affinity, NVLinks, PCIe common ancestors, NVLink P2P).
section("GPU topology (gpu.topology.v1)")
try:
    from gpupipe_producer.nvml.topology import read_topology

    t0 = time.perf_counter()
    topo = read_topology(nvml, src.gpus(), {g.uuid for g in src.lost_gpus})
    took = time.perf_counter() - t0
    rec = {"hostname": platform.node(), "timestamp_ms": int(time.time() * 1000), "driver_version": None,
           "gpus": topo.gpus, "pairs": topo.pairs}
    AvroCodec().encoder("GpuTopology").encode(rec)
    (out_dir / "topology.json").write_text(json.dumps(rec, indent=2) + "\n")
    summary["topology"] = {"seconds": round(took, 3), "errors": dict(topo.errors),
                           "refused": sorted({f"{k.split(':')[0]}: {r}" for _, k, r in topo.learned})}
    for g in topo.gpus:
        states = [link["state"] for link in g["nvlinks"]]
        print(f"GPU {g['gpu_index']} numa={g['numa_node']} memory_numa={g['memory_numa_node']} "
              f"cpus={g['cpu_affinity']} nvlinks={len(states)} active={states.count('active')} "
              f"domain={g['nvlink_domain']} remote={sorted({str(x['remote_type']) for x in g['nvlinks']})}")
    levels: dict = {}
    for p in topo.pairs:
        levels[(p["pcie_ancestor"], p["nvlink_p2p"])] = levels.get((p["pcie_ancestor"], p["nvlink_p2p"]), 0) + 1
    print(f"pairs (pcie ancestor, nvlink p2p): {levels}; read in {took:.3f} s; refused: {summary['topology']['refused']}")
except Exception as exc:  # report, do not stop the check
    summary["topology"] = {"error": repr(exc)}
    print(f"TOPOLOGY FAILED: {exc!r}")
src.shutdown()

# 2. CPU per collection tick with the default intervals (fast 1 s ... slow 30 s): a simulated clock
#    advances 1 s per poll so the slow/processes/MIG groups are amortised as in production; real
#    sleeps of 0.15 s keep GPM samples apart. NVML's own cost is included (this is a real GPU).
section("CPU time per collection tick (default intervals, 60 ticks = two slow cycles)")
clock = [1000.0]
src = NvmlSource(nvml, platform.node(), None, clock=lambda: clock[0])
src.start()
cpu_ms, wall_ms = [], []
groups: dict = {}
for _ in range(60):
    clock[0] += 1.0
    time.sleep(0.15)
    c, w = time.process_time(), time.perf_counter()
    src.poll()
    cpu_ms.append((time.process_time() - c) * 1000)
    wall_ms.append((time.perf_counter() - w) * 1000)
    for g, sec in src.collect_seconds.items():
        groups.setdefault(g, []).append(sec * 1000)
src.shutdown()
tick = {
    "cpu_ms_mean": round(statistics.mean(cpu_ms), 3),
    "cpu_ms_median": round(statistics.median(cpu_ms), 3),
    "cpu_ms_max": round(max(cpu_ms), 3),
    "wall_ms_mean": round(statistics.mean(wall_ms), 3),
    "wall_ms_max": round(max(wall_ms), 3),
    "group_wall_ms_mean": {g: round(statistics.mean(v), 3) for g, v in groups.items()},
    "gpus": len(src.gpus()),
}
summary["tick"] = tick
print(json.dumps(tick, indent=2))

# 3. NVML XID events: which GPUs accept the registration, and what the waiting threads (one event
#    set per GPU) cost while nothing happens (NVIDIA's mock polls inside its wait: about 0.9 ms/s per
#    GPU there; a driver should block in the kernel).
section("NVML XID event sets")
received: list = []


def on_event(ev: dict) -> None:
    # Which device the event named and which GPU's set delivered it: the first real run shows
    # whether the driver ever hands one GPU's event to another GPU's set (NVIDIA's mock does).
    what = f"Xid {ev['xid']}" if "xid" in ev else f"{ev.get('type')} {ev.get('data')}"
    print(f"NVML event: {what} names GPU {ev.get('gpu_index')} ({ev.get('uuid')}, {ev.get('pci_bus_id')}); "
          f"delivered by GPU {ev.get('set_gpu_index')}'s event set")
    received.append({k: ev.get(k) for k in ("xid", "type", "gpu_index", "uuid", "pci_bus_id", "set_gpu_index",
                                             "gpu_instance_id", "compute_instance_id")})


w = XidEventWatcher(nvml, on_event, timeout_ms=500)
try:
    w.start()
    time.sleep(0.5)
    c0, t0 = time.process_time(), time.monotonic()
    time.sleep(3.0)
    idle = (time.process_time() - c0) / (time.monotonic() - t0) * 1000
    summary["xid_events"] = {
        "registered": w.registered,
        "unsupported": w.unsupported,
        "errors": dict(w.error_counts),
        "idle_cpu_ms_per_s": round(idle, 3),
        "delivery": dict(w.delivery_counts),
        "received": received,
    }
    w.stop()
except Exception as exc:
    summary["xid_events"] = {"error": repr(exc)}
print(summary["xid_events"])

# 3b. GPU Operational Events (driver R615+ preview): does each call exist and answer on this driver?
#     Registration per GPU, one v3 wait with a short timeout (Timeout = the call works, nothing pending),
#     and one UEFI CPER read. Older drivers answer FunctionNotFound; that is a finding, not a failure.
section("GPU Operational Events: registration, nvmlEventSetWait_v3, nvmlSystemGetCPER_v1")
goe: dict = {}


def _goe_try(name: str, fn) -> None:
    try:
        got = fn()
        goe[name] = "ok" if got is None else f"ok: {got}"
    except Exception as exc:  # AttributeError: the binding predates the call
        goe[name] = f"{type(exc).__name__}: {exc}"
    print(f"{name}: {goe[name]}")


goe_set = None
try:
    import ctypes

    nvml.nvmlInit()
    goe_set = nvml.nvmlEventSetCreate()
    for i in range(int(nvml.nvmlDeviceGetCount())):
        uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
        _goe_try(f"register GPU {i}", lambda u=uuid: nvml.nvmlEventSetRegisterGpuOperationalEvents_v1(
            goe_set, nvml.c_nvmlGpuOperationalEventConfig_v1_t(u)))

    def _wait_v3():
        p = nvml.c_nvmlEventSetWait_v3_t()
        p.timeoutMs = 200
        try:
            nvml.nvmlEventSetWait_v3(goe_set, p)
        except nvml.NVMLError_Timeout:
            return "Timeout (the call works; no event pending)"
        return (f"event dataType={p.dataType} uuid={p.uuid!r} module={p.sourceModule!r} "
                f"code={p.moduleEventCode:#06x} category={p.categoryId:#06x} severity={p.severity}")

    _goe_try("nvmlEventSetWait_v3", _wait_v3)

    def _cper():
        size = 1 << 16
        buf = (ctypes.c_ubyte * size)()
        req = nvml.c_nvmlGetCPER_v1_t()
        req.cursor.cperTypeMask = nvml.NVML_CPER_ACCESS_TYPE_GPU
        req.cursor.handle = nvml.NVML_CPER_CURSOR_HANDLE_INIT
        req.buffer = ctypes.cast(buf, ctypes.POINTER(ctypes.c_ubyte))
        req.bufferSize = size
        nvml.nvmlSystemGetCPER_v1(req)
        return f"bufferSize after the call {req.bufferSize}, cursor handle {req.cursor.handle}"

    _goe_try("nvmlSystemGetCPER_v1", _cper)
except Exception as exc:
    goe["error"] = repr(exc)
    print(f"GPU Operational Events check failed: {exc!r}")
finally:
    if goe_set is not None:
        try:
            nvml.nvmlEventSetFree(goe_set)
        except Exception:
            pass
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
summary["operational_events"] = goe

# 3c. The newer reads of the slow group, raw: each call's answer or error per GPU (the source above
#     already learned them; this says why). Bank remapper R615+, unrepairable memory R590+, power
#     smoothing Blackwell with in-band access granted.
section("memory health and power smoothing: raw NVML answers")
newer: dict = {}
try:
    import ctypes

    from gpupipe_producer.nvml.convert import field_value

    nvml.nvmlInit()
    fids = {n: getattr(nvml, n) for n in (
        "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
        "NVML_FI_PWR_SMOOTHING_ENABLED",
        "NVML_FI_PWR_SMOOTHING_ACTIVE_PRESET_PROFILE",
        "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_CEIL",
        "NVML_FI_PWR_SMOOTHING_APPLIED_TMP_FLOOR",
        "NVML_FI_PWR_SMOOTHING_HW_CIRCUITRY_PERCENT_LIFETIME_REMAINING",
    ) if isinstance(getattr(nvml, n, None), int)}
    for i in range(int(nvml.nvmlDeviceGetCount())):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        got: dict = {}

        def _try(name, fn, got=got):
            try:
                got[name] = fn()
            except Exception as exc:  # AttributeError: the binding predates the call
                got[name] = f"{type(exc).__name__}: {exc}"

        def _bank(h=h):
            st = nvml.c_nvmlEccBankRemapperStatus_v1_t()
            nvml.nvmlDeviceGetBankRemapperStatus_v1(h, ctypes.byref(st))
            return {"bPending": st.bPending, "activeRemappings": st.activeRemappings,
                    "inactiveRemappings": st.inactiveRemappings,
                    "noSpareGroupCount": st.histogram.noSpareGroupCount}

        _try("nvmlDeviceGetBankRemapperStatus_v1", _bank)
        _try("nvmlDeviceGetUnrepairableMemoryFlag_v1", lambda h=h: nvml.nvmlDeviceGetUnrepairableMemoryFlag_v1(h))
        _try("nvmlDeviceGetRemappedRows", lambda h=h: list(nvml.nvmlDeviceGetRemappedRows(h)))
        try:
            values = nvml.nvmlDeviceGetFieldValues(h, list(fids.values()))
            for (name, fid), fv in zip(fids.items(), values):
                got[f"{name} ({fid})"] = (
                    field_value(fv) if fv.nvmlReturn == 0 else f"{nvml.NVMLError(fv.nvmlReturn)}"
                )
        except Exception as exc:
            got["nvmlDeviceGetFieldValues"] = f"{type(exc).__name__}: {exc}"
        newer[f"GPU {i}"] = got
        for k, v in got.items():
            print(f"GPU {i} {k}: {v}")
except Exception as exc:
    newer["error"] = repr(exc)
    print(f"newer reads check failed: {exc!r}")
finally:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
summary["newer_reads"] = newer

# 3d. NVLink link health inputs, raw: per link its state, far end and the four data-link error counters
#     (nvmlDeviceGetNvLinkErrorCounter: CRC flit/data, replay, recovery; what nvlink_link_counters
#     carries), and whether nvmlDeviceGetNvLinkTelemetrySamples_v1 (R615+) exists on this driver (asked
#     for no sample: its v1 types are TX/RX throughput only, which the link-health state does not use).
section("NVLink link health: per-link counters, raw NVML answers")
links_raw: dict = {}
try:
    nvml.nvmlInit()
    counters = {n: getattr(nvml, f"NVML_NVLINK_ERROR_DL_{n.upper()}", v)
                for n, v in (("crc_flit", 2), ("crc_data", 3), ("replay", 0), ("recovery", 1))}
    for i in range(int(nvml.nvmlDeviceGetCount())):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        per_gpu: dict = {}
        for link in range(36):  # NVML_NVLINK_MAX_LINKS
            entry: dict = {}
            try:
                entry["state"] = int(nvml.nvmlDeviceGetNvLinkState(h, link))
            except nvml.NVMLError as exc:
                if link == 0:
                    per_gpu["nvmlDeviceGetNvLinkState"] = f"{type(exc).__name__}: {exc}"
                break  # past the last link (InvalidArgument) or no NVLink (NotSupported)
            for name, counter in counters.items():
                try:
                    entry[name] = int(nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                except Exception as exc:
                    entry[name] = f"{type(exc).__name__}: {exc}"
            try:
                entry["remote_type"] = int(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link))
            except Exception as exc:
                entry["remote_type"] = f"{type(exc).__name__}: {exc}"
            per_gpu[f"link {link}"] = entry
        if hasattr(nvml, "nvmlDeviceGetNvLinkTelemetrySamples_v1"):
            try:
                req = nvml.c_nvmlNvlinkTelemetrySamples_v1_t()  # telemetryCount 0: existence only
                nvml.nvmlDeviceGetNvLinkTelemetrySamples_v1(h, req)
                per_gpu["nvmlDeviceGetNvLinkTelemetrySamples_v1"] = "Success"
            except Exception as exc:
                per_gpu["nvmlDeviceGetNvLinkTelemetrySamples_v1"] = f"{type(exc).__name__}: {exc}"
        else:
            per_gpu["nvmlDeviceGetNvLinkTelemetrySamples_v1"] = "missing from the binding"
        links_raw[f"GPU {i}"] = per_gpu
        for k, v in per_gpu.items():
            print(f"GPU {i} {k}: {v}")
except Exception as exc:
    links_raw["error"] = repr(exc)
    print(f"NVLink link check failed: {exc!r}")
finally:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass
summary["nvlink_links"] = links_raw

# 4. The kernel log: read the backlog of /dev/kmsg once and parse it.
section("kernel log (/dev/kmsg backlog)")
try:
    from gpupipe_producer.xid.kmsg_parse import KernelXid, KmsgParser, to_json_dict
    from gpupipe_producer.xid.kmsg_reader import KmsgReader

    reader = KmsgReader("/dev/kmsg", follow=False, from_start=True)
    parser = KmsgParser()
    found = []
    t0 = time.process_time()
    for line in reader:
        found += parser.feed(line)
    found += parser.flush()
    cpu = time.process_time() - t0
    xids = [to_json_dict(e) for e in found if isinstance(e, KernelXid)]
    summary["kmsg"] = {"lines": reader.stats.lines, "records": reader.stats.records, "xids": xids,
                       "fallen_off_bus": sum(1 for e in found if not isinstance(e, KernelXid)),
                       "cpu_s": round(cpu, 4)}
    print(f"{reader.stats.lines} lines, {len(xids)} Xid/SXid, cpu {cpu:.4f} s")
    for x in xids[-10:]:
        print(" ", json.dumps(x))
except Exception as exc:
    summary["kmsg"] = {"error": repr(exc)}
    print(f"kernel log not readable: {exc!r}")

# 5. The kubelet, if this is a Kubernetes node.
section("kubelet PodResources")
sock = "/var/lib/kubelet/pod-resources/kubelet.sock"
if os.path.exists(sock):
    try:
        from gpupipe_producer.kubelet.client import PodResourcesClient

        amap = PodResourcesClient(sock, 2.0).list_allocations()
        summary["kubelet"] = {k: [f"{r.namespace}/{r.pod}/{r.container}" for r in v] for k, v in amap.items()}
        # DRA claims with the Kubernetes 1.35 share_id (a share of a device), as the agent carries them
        summary["kubelet_dra"] = {
            "/".join(k): [f"{r.namespace}/{r.pod} claim={r.claim_name} share_id={r.dra_share_id}" for r in v]
            for k, v in amap.dra.items()
        }
    except Exception as exc:
        summary["kubelet"] = {"error": repr(exc)}
else:
    summary["kubelet"] = "socket absent (not a Kubernetes node)"
print(summary["kubelet"])

(out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"\nwritten: {out_dir}/sample.json, {out_dir}/summary.json, {out_dir}/report.txt")
PY
