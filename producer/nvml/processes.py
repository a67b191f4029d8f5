"""Processes group (default every 5 s): the ``processes`` array of GpuSample.

* ``nvmlDeviceGetComputeRunningProcesses`` -> pid, used_memory_bytes (bytes; NVML's
  "not available" is None in the binding and stays null).
* ``nvmlDeviceGetProcessUtilization(handle, lastSeenTimeStamp)`` -> sm_util_ratio,
  mem_util_ratio (% /100): NVML returns the samples newer than the timestamp (several per pid
  over a long interval); they are averaged per pid and the newest timestamp is kept for the next
  call, so each value covers exactly the time since the previous collection.
  ``NVMLError_NotFound`` means "no sample since then" (ratios null), not "unsupported".
* ``nvmlSystemGetProcessName(pid)`` -> process_name, cached per pid while the pid runs.

NVML answers per-process utilisation neither for MIG slices nor for a GPU in MIG mode; a slice
lists its own processes (MIG device handle), and the whole-GPU record of a GPU in MIG mode has
an empty list so no process is counted twice. namespace/pod/container are filled downstream.
"""

from __future__ import annotations

from typing import Any

from producer.nvml import convert
from producer.nvml.base import DeviceContext
from producer.nvml.identity import text


class ProcessCollector:
    name = "processes"
    fields = ("processes",)

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        if not ctx.is_mig and ctx.mig_enabled:
            return {"processes": []}
        procs = ctx.call("procs", "nvmlDeviceGetComputeRunningProcesses", ctx.handle)
        if procs is None:
            return {}
        util = {} if ctx.is_mig or ctx.mig_enabled else self._utilization(ctx)
        names: dict[int, str | None] = ctx.state.setdefault("proc_names", {})
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        for p in procs:
            pid = convert.count(getattr(p, "pid", None))
            if pid is None or pid in seen:
                if pid is None:
                    ctx.garbage("processes.pid")
                continue
            seen.add(pid)
            mem_raw = getattr(p, "usedGpuMemory", None)
            mem = convert.count(mem_raw) if mem_raw is not None else None
            if mem is None and mem_raw is not None:
                ctx.garbage("processes.used_memory_bytes")
            sm, mu = util.get(pid, (None, None))
            out.append(
                {
                    "pid": pid,
                    "process_name": self._name(ctx, names, pid),
                    "used_memory_bytes": mem,
                    "sm_util_ratio": sm,
                    "mem_util_ratio": mu,
                    "namespace": None,
                    "pod": None,
                    "container": None,
                }
            )
        for gone in names.keys() - seen:
            del names[gone]
        return {"processes": out}

    def _utilization(self, ctx: DeviceContext) -> dict[int, tuple[float | None, float | None]]:
        if "proc_util" in ctx.unsupported:
            return {}
        last_seen = ctx.state.get("proc_util_ts", 0)
        try:
            samples = self._nvml.nvmlDeviceGetProcessUtilization(ctx.handle, last_seen)
        except ctx.errors.not_found:
            return {}  # no sample since last_seen
        except AttributeError:
            ctx.learn("proc_util", "nvmlDeviceGetProcessUtilization missing from the NVML binding")
            return {}
        except ctx.errors.lost:
            raise
        except ctx.errors.unsupported as exc:
            ctx.learn("proc_util", f"{type(exc).__name__}: {exc}")
            return {}
        except ctx.errors.base as exc:
            ctx.reporter.error(type(exc).__name__)
            return {}
        acc: dict[int, list[float]] = {}  # pid -> [sm sum, sm n, mem sum, mem n]
        newest = last_seen
        for s in samples:
            ts = int(getattr(s, "timeStamp", 0) or 0)
            if ts > newest:
                newest = ts
            a = acc.setdefault(int(s.pid), [0.0, 0, 0.0, 0])
            sm = convert.pct_to_ratio(s.smUtil)
            if sm is None:
                ctx.garbage("processes.sm_util_ratio")
            else:
                a[0] += sm
                a[1] += 1
            mu = convert.pct_to_ratio(s.memUtil)
            if mu is None:
                ctx.garbage("processes.mem_util_ratio")
            else:
                a[2] += mu
                a[3] += 1
        ctx.state["proc_util_ts"] = newest
        return {pid: (a[0] / a[1] if a[1] else None, a[2] / a[3] if a[3] else None) for pid, a in acc.items()}

    def _name(self, ctx: DeviceContext, cache: dict[int, str | None], pid: int) -> str | None:
        if pid in cache:
            return cache[pid]
        try:
            name: str | None = text(self._nvml.nvmlSystemGetProcessName(pid)) or None
        except ctx.errors.base:
            name = None  # the process exited, or is in a namespace NVML cannot see
        except AttributeError:
            name = None
        cache[pid] = name
        return name

    def release(self, ctx: DeviceContext) -> None:
        return None
