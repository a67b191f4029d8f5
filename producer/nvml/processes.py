"""Processes group (default every 5 s): the ``processes`` array of GpuSample.

* ``nvmlDeviceGetComputeRunningProcesses``, ``...GraphicsRunningProcesses`` (graphics contexts:
  Omniverse, Isaac) and ``...MPSComputeRunningProcesses`` (MPS clients; the compute list shows
  only the MPS server) -> pid, used_memory_bytes (bytes; NVML's "not available" is None in the
  binding and stays null). A pid in several lists is one process; each list that a device cannot
  answer is learned separately.
* ``nvmlDeviceGetProcessUtilization(handle, lastSeenTimeStamp)`` -> sm_util_ratio,
  mem_util_ratio (% /100). NVML returns one sample per sample period *in which the process was
  busy* (none for idle periods), so averaging the returned samples overstates a bursty process.
  The ratio is the sum over the window divided by the number of sample periods in it: counted by
  ``nvmlDeviceGetSamples(GPU_UTILIZATION)`` (every period, busy or not) where NVML answers it,
  else the window length over the shortest spacing of sample times seen on the device; the plain
  average only when neither is known yet. The first call (lastSeen 0 returns the driver's whole
  buffer: an undefined window) only primes the timestamp. "No sample since then" is
  ``NVMLError_NotFound`` per nvml.h, or ``NVMLError`` with value ``NVML_SUCCESS`` from pynvml when
  the library's size query answers success with zero samples (NVIDIA's mock does): both mean no
  samples (ratios null), never an error.
* ``nvmlSystemGetProcessName(pid)`` -> process_name, cached per pid while the pid runs.

NVML answers per-process utilisation neither for MIG slices nor for a GPU in MIG mode; a slice
lists its own processes (MIG device handle), and the whole-GPU record of a GPU in MIG mode has
an empty list so no process is counted twice. namespace/pod/container are filled downstream.
"""

from __future__ import annotations

import itertools
from typing import Any

from gpupipe_producer.nvml import convert
from gpupipe_producer.nvml.base import DeviceContext
from gpupipe_producer.nvml.identity import text


class ProcessCollector:
    name = "processes"
    fields = ("processes",)

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._gpu_util_samples = getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1)

    def collect(self, ctx: DeviceContext) -> dict[str, Any]:
        if not ctx.is_mig and ctx.mig_enabled:
            return {"processes": []}
        procs = ctx.call("procs", "nvmlDeviceGetComputeRunningProcesses", ctx.handle)
        if procs is None:
            return {}
        procs = list(procs)
        for key, fn in (
            ("procs_graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
            ("procs_mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
        ):
            more = ctx.call(key, fn, ctx.handle)
            if more:
                procs += list(more)
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
            ctx.unsupported.answered("proc_util")  # an answer: a later refusal backs off afresh
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
            if getattr(exc, "value", None) == 0:  # NVML_SUCCESS with zero samples (see docstring)
                ctx.unsupported.answered("proc_util")
                return {}
            ctx.reporter.error(type(exc).__name__)
            return {}
        # Called directly (not through ctx.call): say it answered, as ctx.call does, so that a
        # rights refusal after a success starts its back-off over (producer/nvml/learned.py).
        ctx.unsupported.answered("proc_util")
        acc: dict[int, list[float]] = {}  # pid -> [sm sum, sm n, mem sum, mem n]
        stamps: set[int] = set()
        for s in samples:
            ts = int(getattr(s, "timeStamp", 0) or 0)
            stamps.add(ts)
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
        newest = max(stamps, default=last_seen)
        counted, period_end = self._counted_periods(ctx, last_seen)
        ctx.state["proc_util_ts"] = max(newest, last_seen, period_end)
        ordered = sorted(stamps)
        gaps = [b - a for a, b in itertools.pairwise(ordered) if b > a]
        if gaps:
            ctx.state["proc_util_period_us"] = min([*gaps, ctx.state.get("proc_util_period_us", gaps[0])])
        if last_seen == 0:
            return {}  # the whole driver buffer: its window is undefined; this call primes lastSeen
        periods = counted or self._estimated_periods(ctx, last_seen, newest)

        def ratio(total: float, n: float) -> float | None:
            if not n:
                return None
            return min(1.0, total / periods) if periods else total / n

        return {pid: (ratio(a[0], a[1]), ratio(a[2], a[3])) for pid, a in acc.items()}

    def _counted_periods(self, ctx: DeviceContext, last_seen: int) -> tuple[float | None, int]:
        """(sample periods after ``last_seen``, newest period time) from nvmlDeviceGetSamples."""
        if "util_samples" in ctx.unsupported:
            return None, 0
        try:
            got = self._nvml.nvmlDeviceGetSamples(ctx.handle, self._gpu_util_samples, last_seen)
        except AttributeError:
            ctx.learn("util_samples", "nvmlDeviceGetSamples missing from the NVML binding")
            return None, 0
        except ctx.errors.lost:
            raise
        except ctx.errors.unsupported as exc:
            ctx.learn("util_samples", f"{type(exc).__name__}: {exc}")
            return None, 0
        except ctx.errors.base:
            return None, 0  # NotFound / SUCCESS-with-none: no period to count; estimate instead
        ctx.unsupported.answered("util_samples")
        if not got:
            return None, 0
        stamps = [int(getattr(p, "timeStamp", 0) or 0) for p in got[1]]
        stamps = [t for t in stamps if t > last_seen]
        return (float(len(stamps)) or None), max(stamps, default=0)

    @staticmethod
    def _estimated_periods(ctx: DeviceContext, last_seen: int, newest: int) -> float | None:
        period = ctx.state.get("proc_util_period_us")
        if period and newest > last_seen:
            return max(1.0, round((newest - last_seen) / period))
        return None

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
