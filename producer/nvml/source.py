"""``NvmlSource``: every GPU of the node, read through NVML, as complete GpuSample dicts.

``start()`` initialises NVML; ``poll()`` returns one dict per GPU plus one per MIG slice, running the
field groups that are due and repeating the others' last values, so every sample is complete. A lost
GPU is one ``gpu_lost`` record (``hooks.gpu_lost`` once) and probed until it returns; with
``call_timeout_s`` a stalled GPU is left out, never holding up the others. ``allocations`` stay empty.
More: docs/producer.md, "The NVML source".
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpupipe.common.errors import ConfigError
from gpupipe.domain import pci
from gpupipe_producer.nvml.base import Collector, DeviceContext, NvmlErrors
from gpupipe_producer.nvml.driver_info import DRIVER_GPUS_DIR, driver_gpu
from gpupipe_producer.nvml.errors import NvmlInitError, NvmlSourceError
from gpupipe_producer.nvml.fabric import FabricCollector
from gpupipe_producer.nvml.fast import FastCollector
from gpupipe_producer.nvml.gpm import GpmCollector
from gpupipe_producer.nvml.gpu_table import Gpu, GpuTable
from gpupipe_producer.nvml.identity import (
    SYSFS_PCI_DEVICES,
    IdentityCollector,
    read_driver_version,
    read_nvml_version,
    text,
)
from gpupipe_producer.nvml.mig import MigSlice, enumerate_slices
from gpupipe_producer.nvml.processes import ProcessCollector
from gpupipe_producer.nvml.records import DeviceIds, GpuRef, LostGpu, empty_sample
from gpupipe_producer.nvml.reporting import SourceHooks, SourceReporter, check_intervals
from gpupipe_producer.nvml.session import NvmlSession
from gpupipe_producer.nvml.slow import SlowCollector
from gpupipe_producer.nvml.workers import GpuWorker

log = logging.getLogger("gpupipe.nvml")

# Run order within a poll. Profiling goes first: when GPM turns out not to measure PCIe on a
# device, the fast group reads the legacy PCIe counter in the same poll.
# Fabric before fast: the NVLink link count it reads lets fast sum links where the aggregate reads 0.
GROUPS: tuple[str, ...] = ("profiling", "fabric", "fast", "slow", "processes")
DEFAULT_INTERVALS: dict[str, float] = {
    "fast": 1.0,
    "slow": 30.0,
    "profiling": 1.0,
    "processes": 5.0,
    "fabric": 10.0,
    "mig": 10.0,
    "lost_retry": 30.0,
    "refused_retry": 300.0,
    "lost_reinit": 60.0,
}
#: Fields a sample carries only when their group read them in the same poll (empty lists between):
#: per-link NVLink counters are 18 entries a GPU, and the alerts service reads them every 10 s anyway.
FRESH_ONLY: dict[str, tuple[str, ...]] = {"fabric": ("nvlink_link_counters",)}
DUE_SLACK = 0.1  # a group is due this much of the poll (fast) interval early: tick jitter

__all__ = ["DEFAULT_INTERVALS", "GROUPS", "NvmlSource", "SourceHooks", "default_nvml_module"]


def default_nvml_module() -> Any:
    """The real ``pynvml`` module (nvidia-ml-py); the only place the producer imports it."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlInitError(f"NVML init failed: the nvidia-ml-py package is not installed ({exc})") from exc
    return pynvml


COLLECTOR_FACTORIES: dict[str, Callable[[Any, Callable[[], float], frozenset[str]], Collector]] = {
    "fast": lambda nvml, clock, enabled: FastCollector(
        nvml, pcie_via_gpm="profiling" in enabled, clock=clock
    ),
    "slow": lambda nvml, clock, enabled: SlowCollector(nvml),
    "profiling": lambda nvml, clock, enabled: GpmCollector(nvml, clock),
    "processes": lambda nvml, clock, enabled: ProcessCollector(nvml),
    "fabric": lambda nvml, clock, enabled: FabricCollector(nvml),
}


class NvmlSource:
    """Polls every GPU of the node through an injected NVML module (``pynvml`` or a fake)."""

    def __init__(
        self,
        nvml_module: Any,
        hostname: str,
        intervals: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        *,
        collectors: Iterable[str] | None = None,
        hooks: SourceHooks | None = None,
        sysfs_pci: str = SYSFS_PCI_DEVICES,
        driver_gpus_dir: str = DRIVER_GPUS_DIR,
    ) -> None:
        self._nvml = nvml_module if nvml_module is not None else default_nvml_module()
        self.hostname = hostname
        self.intervals = check_intervals(intervals, DEFAULT_INTERVALS)
        self._clock = clock
        self._wall_clock = wall_clock
        enabled = tuple(GROUPS if collectors is None else collectors)
        unknown = [n for n in enabled if n not in COLLECTOR_FACTORIES]
        if unknown:
            raise ConfigError(f"unknown NVML collector(s) {unknown}; known: {list(COLLECTOR_FACTORIES)}")
        self._now = 0.0
        enabled_set = frozenset(enabled)
        self._collectors: list[Collector] = [
            COLLECTOR_FACTORIES[n](self._nvml, self._current_time, enabled_set)
            for n in GROUPS
            if n in enabled_set
        ]
        self._groups_with_collectors = frozenset(c.name for c in self._collectors)
        self._identity = IdentityCollector(sysfs_pci)
        self._driver_gpus_dir = driver_gpus_dir
        self._table = GpuTable()
        self._session = NvmlSession(self._nvml, self.intervals["lost_reinit"])
        self._report = SourceReporter(hooks or SourceHooks(), self._current_time)
        #: GPUs NVML failed to open at start with an error other than "lost" (left out).
        self.unusable_gpus = 0
        self._errors: NvmlErrors | None = None
        self._next_due: dict[str, float] = {}
        self._nvml_version: str | None = None
        self._started = False
        self._interval_ms = round(self.intervals["fast"] * 1000)
        self.collect_seconds: dict[str, float] = {}
        #: Per-GPU time limit of a poll (None: sequential, no limit). See the module docstring.
        self.call_timeout_s: float | None = None
        self._workers: dict[int, GpuWorker] = {}
        self._stalled: set[int] = set()

    # -- the collaborators' state, as callers know it -------------------------------------------
    @property
    def hooks(self) -> SourceHooks:
        return self._report.hooks

    @property
    def error_counts(self) -> Counter[str]:
        """NVML errors by class (``call_timeout`` for a stalled GPU); also fed to the hooks."""
        return self._report.error_counts

    @property
    def garbage_counts(self) -> Counter[str]:
        return self._report.garbage_counts

    @property
    def collector_failures(self) -> Counter[str]:
        return self._report.collector_failures

    @property
    def released(self) -> bool:
        """True between :meth:`suspend` and a successful :meth:`resume`."""
        return self._session.released

    @property
    def resume_error(self) -> str | None:
        """NVML's error class when the last :meth:`resume` failed."""
        return self._session.resume_error

    @property
    def sessions_resumed(self) -> int:
        return self._session.sessions_resumed

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """``nvmlInit`` and enumerate the GPUs; raises :class:`NvmlInitError` with NVML's text."""
        if self._started:
            return
        nvml = self._nvml
        try:
            self._errors = NvmlErrors(nvml)
        except AttributeError as exc:
            raise NvmlInitError(f"NVML init failed: {nvml!r} is not an NVML binding ({exc})") from exc
        count = self._session.open()
        self._table.driver_version = read_driver_version(nvml)
        self._nvml_version = read_nvml_version(nvml)
        self._now = self._clock()
        gpus: list[Gpu] = []
        for index in range(count):
            gpu = self._open(index)
            if gpu is not None:
                gpus.append(gpu)
        self._table.entries = gpus
        self._next_due["mig"] = self._now + self.intervals["mig"]  # enumerated just now
        self._started = True
        log.info(
            "NVML source started",
            extra={"fields": {"gpus": len(self._table.entries), "driver": self._table.driver_version}},
        )

    def shutdown(self) -> None:
        """Free GPM samples and shut NVML down (idempotent, never raises)."""
        if not self._started:
            return
        for w in self._workers.values():
            w.close()
        for gpu in self._table.entries:
            w = self._workers.get(gpu.ctx.index)
            if w is not None and w.busy:
                continue  # a hung call still uses this GPU's handles: leave them alone
            for ctx in gpu.contexts():
                self._release(ctx)
        self._started = False
        if not self.released:  # a released source holds no NVML reference to give back
            self._session.close()

    def _release(self, ctx: DeviceContext) -> None:
        for c in self._collectors:
            try:
                c.release(ctx)
            except Exception as exc:
                log.debug("release of %s failed: %s", c.name, exc)

    # -- letting go of NVML (gpupipe_producer.nvml.session) ----------------------------------------------
    def can_suspend(self) -> bool:
        """False while a GPU's NVML call is in flight (a stalled GPU's worker)."""
        return not any(w.busy for w in self._workers.values())

    def suspend(self) -> bool:
        """Free what the source holds and let NVML go; ``poll`` returns nothing meanwhile. True
        when released (or already); False while a GPU's call is in flight: NVML must not be shut
        down under a running call."""
        if self.released or not self._started:
            return True
        if not self.can_suspend():
            return False
        for gpu in self._table.entries:
            for ctx in gpu.contexts():
                self._release(ctx)
                ctx.state.clear()
        self._session.let_go()
        return True

    def resume(self) -> bool:
        """Take NVML again and re-enumerate: each GPU found again by UUID (else PCI bus id, else
        NVML index) keeps its place and telemetry continues under new handles, with everything
        learned per device asked again (a new driver may answer differently); a GPU lost before
        and answering now is reported recovered; one still lost keeps its identity and is not
        reported again; one that vanished from the enumeration stays listed as lost. False
        (still released, ``resume_error`` set) when NVML cannot be initialised."""
        if not self.released:
            return True
        count = self._session.take_again()
        if count is None:
            return False
        self._reenumerate(count)
        self._session.resumed()
        return True

    def reinit(self) -> bool:
        """:meth:`suspend` then :meth:`resume` (a new session only if nobody else holds NVML)."""
        return self.suspend() and self.resume()

    def reinit_due(self, now: float) -> bool:
        """True when a re-initialisation should be tried for the GPUs lost now (back-off)."""
        return self._session.reinit_due(now, self._table.any_lost())

    def reinit_tried(self, now: float) -> None:
        """A re-initialisation was tried: the next one (if GPUs stay lost) waits twice as long."""
        self._session.reinit_tried(now)

    def _reenumerate(self, count: int) -> None:
        old = list(self._table.entries)
        by_uuid = {g.ctx.uuid: g for g in old if g.ctx.uuid}
        by_bus = {pci.device_key(g.ctx.pci_bus_id): g for g in old if g.ctx.pci_bus_id}
        by_index = {g.ctx.index: g for g in old}
        self._stalled.clear()
        self.unusable_gpus = 0
        found: list[Gpu] = []
        matched: set[int] = set()  # id() of the old entries found again
        for index in range(count):
            gpu = self._open(index, by_index.get(index))
            if gpu is None:
                continue
            prev = gpu if any(gpu is g for g in old) else by_uuid.get(gpu.ctx.uuid or "")
            if prev is None and gpu.ctx.pci_bus_id:
                prev = by_bus.get(pci.device_key(gpu.ctx.pci_bus_id))
            if prev is not None:
                matched.add(id(prev))
                if prev is not gpu and prev.lost and not gpu.lost:
                    log.info("GPU %d answers NVML again after re-initialisation", gpu.ctx.index)
                    self._report.hook("gpu_recovered", self._table.ref(gpu))
            found.append(gpu)
        for g in old:  # gone from the enumeration: still a GPU of this node, reported lost
            if id(g) not in matched:
                if not g.lost:
                    exc = self._errs.base(self._nvml.NVML_ERROR_GPU_IS_LOST)
                    self._mark_lost(g, int(self._wall_clock() * 1000), "reinit", exc)
                found.append(g)
        self._table.entries = found

    # -- polling --------------------------------------------------------------------------------
    def poll(self, now: float | None = None) -> list[dict[str, Any]]:
        """One complete GpuSample dict per GPU and per MIG slice; never raises for NVML trouble."""
        if not self._started:
            raise NvmlSourceError("NvmlSource.poll() called before start() (or after shutdown())")
        if self.released:
            return []  # NVML let go of (gpupipe_producer.nvml.session): nothing to read
        now = self._clock() if now is None else now
        self._now = now
        ts = int(self._wall_clock() * 1000)
        due = self._due(now)
        spent = dict.fromkeys(self._groups_with_collectors, 0.0)
        ran: set[str] = set()
        out: list[dict[str, Any]] = []
        if self.call_timeout_s is None:
            for gpu in self._table.entries:
                out += self._poll_gpu(gpu, due, now, ts, spent, ran)
        else:
            out = self._poll_parallel(due, now, ts, spent, ran, self.call_timeout_s)
        for group, seconds in spent.items():
            if group in ran:
                self.collect_seconds[group] = seconds
                self._report.hook("collect_duration", group, seconds)
        return out

    def _poll_gpu(
        self, gpu: Gpu, due: set[str], now: float, ts: int, spent: dict[str, float], ran: set[str]
    ) -> list[dict[str, Any]]:
        if gpu.lost and not self._probe(gpu, now):
            return [self._lost_sample(gpu, ts)]
        try:
            self._collect_gpu(gpu, due, spent, ran)
        except self._errs.lost as exc:
            self._mark_lost(gpu, ts, "poll", exc)
        if gpu.lost:
            return [self._lost_sample(gpu, ts)]
        out = [self._sample(gpu, gpu.ctx, ts, None)]
        for sl in gpu.slices:
            out.append(self._sample(gpu, sl.ctx, ts, sl))
        return out

    def _poll_parallel(
        self, due: set[str], now: float, ts: int, spent: dict[str, float], ran: set[str], limit: float
    ) -> list[dict[str, Any]]:
        jobs = []
        for gpu in self._table.entries:
            idx = gpu.ctx.index
            w = self._workers.get(idx)
            if w is None:
                w = self._workers[idx] = GpuWorker(f"nvml-gpu{idx}")
            if w.busy:
                continue  # still stalled in an earlier poll's call
            local_spent: dict[str, float] = dict.fromkeys(spent, 0.0)
            local_ran: set[str] = set()

            def job(
                gpu: Gpu = gpu, sp: dict[str, float] = local_spent, rn: set[str] = local_ran
            ) -> tuple[list[dict[str, Any]], dict[str, float], set[str]]:
                return self._poll_gpu(gpu, set(due), now, ts, sp, rn), sp, rn

            jobs.append((gpu, w.submit(job)))
        deadline = time.monotonic() + limit
        for _, j in jobs:
            j.done.wait(max(0.0, deadline - time.monotonic()))
        out: list[dict[str, Any]] = []
        for gpu in self._table.entries:
            idx = gpu.ctx.index
            w = self._workers[idx]
            job = w.job
            if w.busy or job is None or not any(job is j for _, j in jobs):
                if idx not in self._stalled:
                    self._stalled.add(idx)
                    log.error(
                        "GPU %d: NVML calls did not return within %.1fs; left out of the samples "
                        "until they do (see gpupipe_producer_nvml_stalled_gpus)",
                        idx,
                        limit,
                        extra={"fields": {"gpu": idx, "uuid": gpu.ctx.uuid}},
                    )
                    self._report.nvml_error("call_timeout")
                continue
            if idx in self._stalled:
                self._stalled.discard(idx)
                log.warning("GPU %d: NVML calls return again", idx)
            if job.error is not None:
                raise job.error
            samples, sp, rn = job.result
            out += samples
            for g, sec in sp.items():
                spent[g] = spent.get(g, 0.0) + sec
            ran |= rn
        return out

    def stalled_count(self) -> int:
        """GPUs whose NVML calls did not return within ``call_timeout_s``."""
        return len(self._stalled)

    @property
    def _errs(self) -> NvmlErrors:
        assert self._errors is not None
        return self._errors

    def _current_time(self) -> float:
        return self._now

    def _due(self, now: float) -> set[str]:
        due = set()
        for group in (*(c.name for c in self._collectors), "mig"):
            interval = self.intervals[group]
            nxt = self._next_due.get(group)
            if nxt is None or now >= nxt - DUE_SLACK * min(interval, self.intervals["fast"]):
                due.add(group)
                self._next_due[group] = now + interval
        return due

    def _collect_gpu(self, gpu: Gpu, due: set[str], spent: dict[str, float], ran: set[str]) -> None:
        """Run the due groups on the GPU and its slices.

        A device with no values yet for a group (a new MIG slice, a GPU back from lost or whose
        MIG mode changed) runs that group now instead of waiting for its next interval.
        """
        if "mig" in due:
            try:
                self._refresh_mig(gpu, check_mode=True)
            except self._errs.lost:
                raise
            except Exception as exc:  # garbage from NVML must not stop the poll: keep old slices
                self._report.collector_failure(
                    "mig", f"MIG enumeration failed on GPU {gpu.ctx.index}: {exc!r}", exc
                )
        ctxs = gpu.contexts()
        for c in self._collectors:
            name = c.name
            is_due = name in due
            t0 = time.perf_counter()
            try:
                for ctx in ctxs:
                    values = ctx.state.setdefault("values", {})
                    fresh = ctx.state.setdefault("fresh", set())
                    fresh.discard(name)
                    if is_due or name not in values:
                        values[name] = self._run(c, ctx)
                        fresh.add(name)
                        ran.add(name)
            finally:
                spent[name] += time.perf_counter() - t0

    def _run(self, c: Collector, ctx: DeviceContext) -> dict[str, Any]:
        try:
            return c.collect(ctx)
        except self._errs.lost:
            raise
        except Exception as exc:  # a failing collector never stops the poll
            self._report.collector_failure(c.name, f"collector {c.name} failed on {ctx!r}: {exc!r}", exc)
            return {}

    def _sample(self, gpu: Gpu, ctx: DeviceContext, ts: int, sl: MigSlice | None) -> dict[str, Any]:
        s = empty_sample()
        s.update(gpu.identity)
        s["timestamp_ms"] = ts
        for values in ctx.state.get("values", {}).values():
            s.update(values)
        for group, fields in FRESH_ONLY.items():
            if group not in ctx.state.get("fresh", ()):
                for f in fields:  # read this poll or not at all: repeating them costs bytes and decoding
                    s[f] = []
        procs = s["processes"]
        if procs:
            s["processes"] = [dict(p) for p in procs]
        if sl is None:
            s["last_xid"] = self._table.last_xid(gpu.ctx.index)
        else:
            s["mig"] = sl.identity()
            s["mig_enabled"] = None
            s["last_xid"] = self._table.last_xid(gpu.ctx.index, sl.gpu_instance_id)
        return s

    def _lost_sample(self, gpu: Gpu, ts: int) -> dict[str, Any]:
        s = empty_sample()
        s.update(gpu.identity)
        s["timestamp_ms"] = ts
        s["gpu_lost"] = True
        s["last_xid"] = self._table.last_xid(gpu.ctx.index)
        return s

    # -- devices --------------------------------------------------------------------------------
    def _new_ctx(self, index: int, handle: Any, **kw: Any) -> DeviceContext:
        return DeviceContext(
            self._nvml,
            index,
            handle,
            self._report,
            errors=self._errs,
            clock=self._current_time,
            refused_retry_s=self.intervals["refused_retry"],
            **kw,
        )

    def _open(self, index: int, prev: Gpu | None = None) -> Gpu | None:
        """Open GPU ``index``; ``prev``: the GPU at that index before a re-initialisation."""
        nvml = self._nvml
        where = "start" if prev is None else "reinit"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except self._errs.lost as exc:
            if prev is not None and prev.lost:
                return prev  # still lost: reported already, probed as before
            gpu = Gpu(self._new_ctx(index, None))
            if prev is not None:  # lost during a re-initialisation: it keeps the identity it had
                p = prev.ctx
                gpu.ctx.pci_bus_id, gpu.ctx.uuid, gpu.minor = p.pci_bus_id, p.uuid, prev.minor
                gpu.ctx.model_name = p.model_name
                gpu.identity = dict(prev.identity)
            else:  # NVML gives no handle, hence no identity: the driver's own view still names it.
                known = driver_gpu(self._driver_gpus_dir, index)
                if known is not None:
                    gpu.ctx.pci_bus_id, gpu.ctx.uuid, gpu.minor = known.pci_bus_id, known.uuid, known.minor
            self._set_identity(gpu, {})
            self._mark_lost(gpu, int(self._wall_clock() * 1000), where, exc)
            gpu.next_probe = self._now + self.intervals["lost_retry"]
            return gpu
        except nvml.NVMLError as exc:
            self.unusable_gpus += 1
            log.error("GPU %d is not usable through NVML, skipped: %s", index, exc)
            self._report.nvml_error(type(exc).__name__)
            return None
        gpu = Gpu(self._new_ctx(index, handle))
        try:
            self._read_minor(gpu)
            self._set_identity(gpu, self._identity.collect(gpu.ctx))
            self._refresh_mig(gpu)
        except self._errs.lost as exc:
            self._set_identity(gpu, {})
            self._mark_lost(gpu, int(self._wall_clock() * 1000), where, exc)
        return gpu

    def _set_identity(self, gpu: Gpu, ident: Mapping[str, Any]) -> None:
        ctx = gpu.ctx
        gpu.identity = {
            "hostname": self.hostname,
            "gpu_index": ctx.index,
            "uuid": ctx.uuid,
            "pci_bus_id": ctx.pci_bus_id,
            "model_name": ctx.model_name,
            "driver_version": self._table.driver_version,
            "numa_node": ident.get("numa_node", gpu.identity.get("numa_node")),
            "mig_enabled": ctx.mig_enabled,
            "interval_ms": self._interval_ms,
            "nvml_version": self._nvml_version,
            **{
                k: ident.get(k, gpu.identity.get(k))
                for k in ("serial", "vbios_version", "brand", "inforom_image_version")
            },
        }

    def _refresh_mig(self, gpu: Gpu, *, check_mode: bool = False) -> None:
        ctx = gpu.ctx
        if check_mode and "mig_mode" not in ctx.unsupported:
            mode = IdentityCollector._mig_mode(ctx)
            if mode is not None and mode != ctx.mig_enabled:
                if ctx.mig_enabled is not None:
                    log.info("GPU %d MIG mode changed to %s: support re-learned", ctx.index, mode)
                    self._release(ctx)
                    ctx.unsupported.clear()
                    ctx.state.clear()
                    ctx.gpm_supported = None
                ctx.mig_enabled = mode
                gpu.identity["mig_enabled"] = mode
        old = {s.mig_uuid: s for s in gpu.slices}
        try:
            slices = enumerate_slices(
                ctx,
                lambda h, gi, ci: self._new_ctx(
                    ctx.index, h, parent=ctx, gpu_instance_id=gi, compute_instance_id=ci
                ),
                old,
            )
        except self._errs.lost:
            raise
        kept = {s.mig_uuid for s in slices}
        for uuid, s in old.items():
            if uuid not in kept:
                self._release(s.ctx)
        gpu.slices = slices

    def _mark_lost(self, gpu: Gpu, ts: int, where: str, exc: BaseException) -> None:
        if gpu.lost:
            return
        gpu.lost = True
        gpu.next_probe = self._now + self.intervals["lost_retry"]
        for ctx in gpu.contexts():
            self._release(ctx)
            ctx.state.pop("values", None)
        ref = self._table.ref(gpu)
        lost = LostGpu(ref, ts, where, f"NVML reported the GPU lost ({where}): {exc}")
        log.error(
            "GPU lost",
            extra={"fields": {"gpu": ref.gpu_index, "uuid": ref.uuid, "pci_bus_id": ref.pci_bus_id}},
        )
        self._report.nvml_error(type(exc).__name__)
        self._report.hook("gpu_lost", lost)

    def _probe(self, gpu: Gpu, now: float) -> bool:
        """True when a lost GPU answers again (it is then re-read like at start)."""
        if now < gpu.next_probe:
            return False
        gpu.next_probe = now + self.intervals["lost_retry"]
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.ctx.index)
            uuid = text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError:
            return False
        if gpu.ctx.uuid and uuid != gpu.ctx.uuid:
            log.warning("GPU %d came back with another UUID (%s, was %s)", gpu.ctx.index, uuid, gpu.ctx.uuid)
        gpu.ctx = self._new_ctx(gpu.ctx.index, handle)
        gpu.slices = []
        try:
            self._set_identity(gpu, self._identity.collect(gpu.ctx))
            self._refresh_mig(gpu)
        except self._errs.lost:
            return False
        gpu.lost = False
        log.info("GPU %d answers NVML again", gpu.ctx.index)
        self._report.hook("gpu_recovered", self._table.ref(gpu))
        return True

    @staticmethod
    def _read_minor(gpu: Gpu) -> None:
        """Read once at open (never on the XID path: a hung GPU must not block attribution)."""
        c = gpu.ctx
        minor = c.call("minor", "nvmlDeviceGetMinorNumber", c.handle)
        gpu.minor = minor if isinstance(minor, int) and 0 <= minor < 1 << 20 else None

    # -- what the rest of the producer asks (gpupipe_producer.nvml.gpu_table) ----------------------------
    def gpus(self) -> list[GpuRef]:
        """Every GPU the source knows (lost ones included)."""
        return self._table.refs()

    @property
    def lost_gpus(self) -> list[GpuRef]:
        """The GPUs currently reported lost."""
        return self._table.lost_refs()

    def device_ids(self) -> DeviceIds:
        """What kubelet matching needs beyond UUIDs: minor numbers and MIG slice aliases."""
        return self._table.device_ids()

    def dra_device_uuid(self, driver: str, pool: str, device: str) -> str | None:
        """The GPU UUID of an NVIDIA DRA driver device name ``gpu-<n>`` (whole GPUs only)."""
        return self._table.dra_device_uuid(driver, pool, device)

    def bus_id_map(self) -> dict[str, GpuRef]:
        """PCI bus id (:func:`gpupipe.domain.pci.device_key`) -> GPU, for kernel-log attribution."""
        return self._table.bus_id_map()

    def mig_uuid_for(
        self, uuid: str, gpu_instance_id: int | None, compute_instance_id: int | None
    ) -> str | None:
        """The MIG device UUID of a GPU/compute instance of GPU ``uuid``, when known."""
        return self._table.mig_uuid_for(uuid, gpu_instance_id, compute_instance_id)

    def record_xid(self, gpu_index: int, xid: int, gpu_instance_id: int | None = None) -> None:
        """Remember an XID for ``last_xid`` on the GPU's (and the attributed slice's) samples."""
        self._table.record_xid(gpu_index, xid, gpu_instance_id)

    def unsupported(self, gpu_index: int, gpu_instance_id: int | None = None) -> frozenset[str]:
        """The call keys learned as unsupported for a GPU (or one of its slices)."""
        return self._table.unsupported(gpu_index, gpu_instance_id)

    def learned(self) -> Counter[tuple[str, str]]:
        """(call, refusal kind) -> how many device contexts have it learned now."""
        return self._table.learned()
