"""The node agent behind ``gpupipe produce --source nvml``: I/O orchestration around pure parts.

Threads (all daemon, all joined on shutdown):

* **main loop** (the caller's thread): every ``--interval`` polls the :class:`NvmlSource`, attaches
  the kubelet allocations and the processes' pods (:mod:`producer.enrich`), encodes and queues the
  samples in a bounded :class:`SampleQueue` (oldest dropped first, counted). Between ticks it waits
  on one queue fed by the threads below, pairs XIDs in the :class:`XidMerger`, builds XidEvent
  records (:mod:`producer.xid_events`) and sends them through the spooled :class:`XidSender`. All
  state that is not thread-safe (merger, sender, sample queue, NVML source) is touched here only.
* **kubelet**: ``List`` on the PodResources socket once per interval, with ``--kubelet-timeout``;
  the main loop never waits on it and uses the newest map (empty after a failure: no stale labels;
  ignored when older than two intervals plus the timeout).
* **NVML events** (:class:`XidEventWatcher`): XID critical-error events, pushed to the queue.
* **kernel log**: :class:`KmsgReader` (``/dev/kmsg``, a file, or ``-`` for stdin) + :class:`KmsgParser`,
  Xid/SXid/fallen-off-the-bus events pushed to the queue with their arrival time.

The NVML module is injected: ``run_nvml(..., nvml=module)``, else the module-level
:data:`nvml_factory` (``pynvml`` through :func:`default_nvml_module`) is called. Tests and the
benchmark replace ``nvml_factory`` (see ``tests/fake_nvml_cli.py``); production code never imports
the fake.

Shutdown (stop event set): the reader threads are stopped and joined, held XIDs are flushed from
the merger and sent (spooled first), NVML is shut down, queued samples are handed to librdkafka and
the producer flushed for up to ``SHUTDOWN_FLUSH_S``; what Kafka did not acknowledge stays in the
spool for the next start.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.errors import ConfigError
from gpupipe.logs import fields
from producer.delivery import SampleQueue, XidSender
from producer.enrich import PidResolver, enrich_sample
from producer.kubelet.client import DEFAULT_SOCKET_PATH, AllocationRefresher
from producer.kubelet.mapping import AllocationMap
from producer.nvml.errors import NvmlSourceError
from producer.nvml.events import XidEventWatcher
from producer.nvml.records import GpuRef, LostGpu, gpu_lost_xid_event
from producer.nvml.source import NvmlSource, SourceHooks, default_nvml_module
from producer.pid_pods import PidPodResolver
from producer.publish import Publisher
from producer.self_metrics import ProducerMetrics
from producer.spool import XidSpool
from producer.xid.kmsg_parse import FallenOffBus, KernelXid, KmsgParser, parse_line
from producer.xid.kmsg_reader import DEFAULT_KMSG_PATH, KmsgReader
from producer.xid.xid_merge import DEFAULT_WINDOW_S, XidMerger
from producer.xid_events import XidContext, build_xid_event, fallen_off_bus_event, kmsg_fields, nvml_fields
from schemas.errors import EncodeError

log = logging.getLogger("gpupipe.agent")

#: Returns the NVML module to use. Tests replace it; the default imports ``pynvml``.
nvml_factory: Callable[[], Any] = default_nvml_module

DEFAULT_SPOOL_DIR = "/var/lib/gpupipe/spool"
DEFAULT_SPOOL_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_SAMPLE_QUEUE_MAX = 10_000
DEFAULT_IN_FLIGHT_LIMIT = 2_000
SHUTDOWN_FLUSH_S = 5.0
KMSG_RETRY_S = 10.0
_WAKE_S = 0.25  # longest wait between loop passes (stop is noticed within this)


@dataclass
class AgentConfig:
    """Everything the agent needs; ``config_from_args`` builds it from the ``produce`` flags."""

    hostname: str
    interval_s: float = 1.0
    slow_interval_s: float = 30.0
    profiling_interval_s: float = 1.0
    processes_interval_s: float = 5.0
    kubelet_socket: str | None = DEFAULT_SOCKET_PATH  # None: kubelet enrichment off
    kubelet_timeout_s: float = 1.0
    extra_resource_names: tuple[str, ...] = ()
    kmsg_path: str | None = DEFAULT_KMSG_PATH  # None: kernel-log reader off
    nvml_events: bool = True
    xid_merge_window_s: float = DEFAULT_WINDOW_S
    spool_dir: str = DEFAULT_SPOOL_DIR
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    sample_queue_max: int = DEFAULT_SAMPLE_QUEUE_MAX
    in_flight_limit: int = DEFAULT_IN_FLIGHT_LIMIT
    xid_retry_after_s: float = 5.0
    proc_root: str = "/proc"
    pod_logs_dir: str = "/var/log/pods"
    #: Overrides the /proc + /var/log/pods resolver (tests); ``resolve_pids=False`` turns it off.
    pid_resolver: PidResolver | None = None
    resolve_pids: bool = True
    nvml_event_timeout_ms: int = 500

    def __post_init__(self) -> None:
        for name in ("interval_s", "slow_interval_s", "profiling_interval_s", "processes_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.removesuffix('_s').replace('_', '-')} must be positive")
        if not self.kubelet_timeout_s > 0:
            raise ConfigError("--kubelet-timeout must be positive")
        if self.xid_merge_window_s < 0:
            raise ConfigError("--xid-merge-window must not be negative")
        if self.sample_queue_max < 1 or self.spool_max_bytes < 1024:
            raise ConfigError("--sample-queue-max must be >= 1 and --spool-max-bytes >= 1024")
        if self.kubelet_socket and not os.path.isabs(self.kubelet_socket):
            raise ConfigError(f"--kubelet-socket must be an absolute path, got {self.kubelet_socket!r}")


def default_hostname(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The node name: ``NODE_NAME`` (``spec.nodeName`` in the DaemonSet), else the host name."""
    return environ.get("NODE_NAME") or socket.gethostname()


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the agent config from ``gpupipe produce`` flags (defaults where a flag is absent)."""

    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    names = get("extra_resource_names", "")
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    kmsg = None if get("no_kmsg", False) else get("kmsg_path", DEFAULT_KMSG_PATH)
    return AgentConfig(
        hostname=get("hostname", "") or default_hostname(),
        interval_s=get("interval", 1000) / 1000.0,
        slow_interval_s=get("slow_interval", 30_000) / 1000.0,
        profiling_interval_s=get("profiling_interval", 1000) / 1000.0,
        processes_interval_s=get("processes_interval", 5000) / 1000.0,
        kubelet_socket=get("kubelet_socket", DEFAULT_SOCKET_PATH) or None,
        kubelet_timeout_s=get("kubelet_timeout", 1000) / 1000.0,
        extra_resource_names=tuple(n for n in names if n),
        kmsg_path=kmsg or None,
        nvml_events=not get("no_nvml_events", False),
        xid_merge_window_s=get("xid_merge_window", round(DEFAULT_WINDOW_S * 1000)) / 1000.0,
        spool_dir=get("spool_dir", DEFAULT_SPOOL_DIR),
        spool_max_bytes=int(get("spool_max_bytes", DEFAULT_SPOOL_MAX_BYTES)),
        sample_queue_max=int(get("sample_queue_max", DEFAULT_SAMPLE_QUEUE_MAX)),
        proc_root=get("proc_root", "/proc"),
        pod_logs_dir=get("pod_logs_dir", "/var/log/pods"),
    )


def run_nvml(
    args: argparse.Namespace,
    publisher: Publisher,
    metrics: ProducerMetrics,
    stop: threading.Event,
    codec: Any,
    t_samples: str,
    t_xid: str,
    *,
    nvml: Any = None,
) -> int:
    """``gpupipe produce --source nvml``: run the agent until ``stop`` is set; returns the ticks run.

    Raises :class:`producer.nvml.errors.NvmlInitError` (a GpupipeError: one line, non-zero exit)
    when NVML cannot be initialised.
    """
    agent = NodeAgent(config_from_args(args), publisher, metrics, codec, t_samples, t_xid, nvml=nvml)
    return agent.run(stop)


class _XidProducer:
    """XidSender's view of the Publisher's librdkafka producer (per-message delivery callbacks).

    Successes are counted like every other record (``records_sent{topic}``); a failure is counted
    in ``records_failed{topic,reason}`` but not in ``Publisher.failed``: the event stays in the
    spool and is retried, so it is not lost.
    """

    def __init__(self, publisher: Publisher, metrics: ProducerMetrics) -> None:
        self._pub = publisher
        self._metrics = metrics

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Callable[[Any, Any], None]) -> None:
        def done(err: Any, msg: Any) -> None:
            if err is not None:
                self._metrics.records_failed.labels(topic, err.name()).inc()
            on_delivery(err, msg)

        self._pub.produce_tracked(topic, key, value, done)

    def poll(self, timeout: float = 0.0) -> int:
        return self._pub.poll(timeout)


class _Hooks(SourceHooks):
    def __init__(self, agent: NodeAgent) -> None:
        self._a = agent

    def collect_duration(self, group: str, seconds: float) -> None:
        self._a.metrics.collect_seconds.labels(group).observe(seconds)

    def nvml_error(self, kind: str) -> None:
        self._a.metrics.nvml_errors.labels(kind).inc()

    def garbage(self, field: str) -> None:
        self._a.metrics.nvml_errors.labels("garbage").inc()

    def collector_failure(self, group: str, exc: BaseException) -> None:
        self._a.metrics.nvml_errors.labels("collector_failure").inc()

    def gpu_lost(self, lost: LostGpu) -> None:
        self._a._on_gpu_lost(lost)

    def gpu_recovered(self, gpu: GpuRef) -> None:
        log.info("GPU answers NVML again", extra=fields(gpu=gpu.gpu_index, uuid=gpu.uuid))


class _AgentCollector(Collector):
    """Agent counters read at scrape time (plain ints on the hot paths, no locks)."""

    def __init__(self, agent: NodeAgent) -> None:
        self._a = agent

    def collect(self) -> Iterator[Any]:
        a = self._a
        st = a.kmsg_stats()
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_lines", "Kernel-log lines read.", value=st.get("lines", 0)
        )
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_malformed_lines",
            "Kernel-log lines that looked like an Xid report, or kmsg records, that did not parse.",
            value=a.kmsg_malformed + st.get("malformed", 0),
        )
        yield CounterMetricFamily(
            "gpupipe_producer_kmsg_overruns",
            "Times /dev/kmsg overwrote records before the agent read them.",
            value=st.get("overrun", 0),
        )
        yield CounterMetricFamily(
            "gpupipe_producer_xid_merged",
            "XIDs seen by both NVML and the kernel log and sent as one event.",
            value=a.xid_merged,
        )
        yield CounterMetricFamily(
            "gpupipe_producer_xid_spool_dropped",
            "XID events dropped because the spool exceeded --spool-max-bytes (oldest first).",
            value=a.sender.spool.dropped if a.sender is not None else 0,
        )
        yield CounterMetricFamily(
            "gpupipe_producer_encode_errors",
            "Records that did not match their schema.",
            value=a.encode_errors,
        )
        amap = a.allocations
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_ignored_devices",
            "Device entries of non-GPU resource names in the last kubelet List.",
            value=sum(amap.ignored_resources.values()),
        )
        yield GaugeMetricFamily(
            "gpupipe_producer_kubelet_odd_device_ids",
            "Malformed or non-UUID device ids in the last kubelet List.",
            value=amap.odd_device_ids,
        )
        up = GaugeMetricFamily(
            "gpupipe_producer_source_up", "1 when an input of the agent works.", labels=["input"]
        )
        up.add_metric(["kubelet"], 1 if a.refresher is not None and a.refresher.healthy else 0)
        up.add_metric(["nvml_events"], 1 if a.watcher is not None and a.watcher.running else 0)
        up.add_metric(["kmsg"], 1 if a.kmsg_ready.is_set() and a.kmsg_alive() else 0)
        yield up


class NodeAgent:
    """One node's producer. Construct, then ``run(stop_event)`` on the thread that should poll."""

    def __init__(
        self,
        config: AgentConfig,
        publisher: Publisher,
        metrics: ProducerMetrics,
        codec: Any,
        t_samples: str,
        t_xid: str,
        *,
        nvml: Any = None,
    ) -> None:
        self.config = config
        self.publisher = publisher
        self.metrics = metrics
        self.t_samples = t_samples
        self.t_xid = t_xid
        self._nvml = nvml
        self._enc_sample = codec.encoder("GpuSample", t_samples).encode
        self._enc_xid = codec.encoder("XidEvent", t_xid).encode
        c = config
        self.source: NvmlSource | None = None
        self.watcher: XidEventWatcher | None = None
        self.refresher: AllocationRefresher | None = None
        self.sender: XidSender | None = None
        self.samples = SampleQueue(
            publisher.produce, lambda: len(publisher), c.sample_queue_max, c.in_flight_limit
        )
        # Pairing only makes sense with both sources on; with one, holding an XID for the window
        # would only add latency to the alert.
        both = c.nvml_events and c.kmsg_path is not None
        self.merger = XidMerger(c.xid_merge_window_s if both else 0.0)
        self.pid_resolver: PidResolver | None = None
        if c.pid_resolver is not None:
            self.pid_resolver = c.pid_resolver
        elif c.resolve_pids:
            self.pid_resolver = PidPodResolver(c.proc_root, c.pod_logs_dir)
        # Shared with the threads.
        self._events: queue.SimpleQueue[tuple[str, float, int, Any]] = queue.SimpleQueue()
        self._amap_state: tuple[AllocationMap, float] = (AllocationMap.empty(), float("-inf"))  # map, when
        self._threads_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._kmsg_reader: KmsgReader | None = None
        self._kmsg_thread: threading.Thread | None = None
        self.kmsg_ready = threading.Event()  # set once the kernel-log reader is positioned
        self.started = threading.Event()
        # Counters (main loop or the one thread that owns them).
        self.ticks = 0
        self.kmsg_malformed = 0
        self.xid_merged = 0
        self.encode_errors = 0
        self.xids_sent = 0
        self._dropped_seen = 0
        self._slices: dict[str, list[str]] = {}
        self._tick_amap: AllocationMap = AllocationMap.empty()
        self._collector = _AgentCollector(self)
        metrics.registry.register(self._collector)

    # -- public state ---------------------------------------------------------------------------
    @property
    def allocations(self) -> AllocationMap:
        """The newest kubelet map (empty when the last refresh failed or it is stale)."""
        amap, at = self._amap_state
        if time.monotonic() - at > self._stale_after:
            return AllocationMap.empty()
        return amap

    @property
    def allocations_known(self) -> bool:
        """False while kubelet enrichment is on but its map is missing or stale (chargeback L1)."""
        if not self.config.kubelet_socket:
            return True
        r = self.refresher  # a failed refresh also stores a (fresh) empty map: ask the refresher
        return r is not None and r.healthy and time.monotonic() - self._amap_state[1] <= self._stale_after

    @property
    def _stale_after(self) -> float:
        return 2 * self.config.interval_s + self.config.kubelet_timeout_s

    def kmsg_stats(self) -> dict[str, int]:
        r = self._kmsg_reader
        if r is None:
            return {}
        s = r.stats
        return {"lines": s.lines, "malformed": s.malformed, "overrun": s.overrun}

    def kmsg_alive(self) -> bool:
        return self._kmsg_thread is not None and self._kmsg_thread.is_alive()

    # -- lifecycle ------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        try:
            self._start()
            self._loop(stop)
        finally:
            self._shutdown()
        return self.ticks

    def _start(self) -> None:
        c = self.config
        nvml = self._nvml if self._nvml is not None else nvml_factory()
        self.source = NvmlSource(
            nvml,
            c.hostname,
            {
                "fast": c.interval_s,
                "slow": c.slow_interval_s,
                "profiling": c.profiling_interval_s,
                "processes": c.processes_interval_s,
            },
            hooks=_Hooks(self),
        )
        self.source.start()  # NvmlInitError: the caller exits with NVML's message
        self.sender = XidSender(
            _XidProducer(self.publisher, self.metrics),
            self.t_xid,
            XidSpool(c.spool_dir, c.spool_max_bytes),  # ConfigError when the directory cannot be made
            retry_after_s=c.xid_retry_after_s,
        )
        if c.nvml_events:
            self.watcher = XidEventWatcher(
                nvml,
                self._on_nvml_event,
                timeout_ms=c.nvml_event_timeout_ms,
                on_error=lambda kind: self.metrics.nvml_errors.labels(kind).inc(),
                mig_uuid_lookup=self.source.mig_uuid_for,
            )
            try:
                self.watcher.start()
            except NvmlSourceError as exc:  # NvmlInitError included: kmsg still reports XIDs
                log.warning("NVML XID events unavailable; the kernel log still reports XIDs: %s", exc)
                self.metrics.nvml_errors.labels("event_set").inc()
                self.watcher = None
        if c.kubelet_socket:
            self.refresher = AllocationRefresher(
                socket_path=c.kubelet_socket,
                timeout_s=c.kubelet_timeout_s,
                extra_resource_names=c.extra_resource_names,
                on_error=lambda kind: self.metrics.kubelet_errors.labels(kind).inc(),
            )
            self._spawn("kubelet-refresh", self._kubelet_loop)
        if c.kmsg_path:
            self._kmsg_thread = self._spawn("kmsg-reader", self._kmsg_loop)
        log.info(
            "node agent started",
            extra=fields(
                hostname=c.hostname,
                gpus=len(self.source.gpus()),
                interval_s=c.interval_s,
                nvml_events=self.watcher is not None,
                kmsg=c.kmsg_path,
                kubelet=c.kubelet_socket,
                spooled_xids=self.sender.depth,
            ),
        )
        self.started.set()

    def _spawn(self, name: str, target: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _shutdown(self) -> None:
        """Stop whatever ``_start`` got to start (it may have failed half way); never raises for that."""
        self._threads_stop.set()
        if self.sender is None:  # failed before anything was queued or spooled
            for t in self._threads:
                t.join(self.config.kubelet_timeout_s + 2.0)
            if self.watcher is not None:
                self.watcher.stop()
            if self.source is not None:
                self.source.shutdown()
            return
        if self._kmsg_reader is not None:
            self._kmsg_reader.stop()
        if self.watcher is not None:
            self.watcher.stop()
        for t in self._threads:
            t.join(self.config.kubelet_timeout_s + 2.0)
            if t.is_alive():
                log.warning("thread %s did not stop in time", t.name)
        self._drain_events(0.0)
        self._emit_all(self.merger.flush(time.monotonic()))
        if self.refresher is not None:
            self.refresher.close()
        if self.source is not None:
            self.source.shutdown()
        deadline = time.monotonic() + SHUTDOWN_FLUSH_S
        while len(self.samples) and time.monotonic() < deadline:
            if not self.samples.pump():
                self.publisher.poll(0.05)
        left = self.publisher.flush(max(0.0, deadline - time.monotonic()))
        self._sync_metrics()
        if self.sender is not None and not left:
            self.sender.spool.close()  # else late delivery reports may still ack into it
        log.info(
            "node agent stopped",
            extra=fields(
                ticks=self.ticks,
                xids_sent=self.xids_sent,
                xid_spool_depth=self.sender.depth if self.sender else 0,
                samples_dropped=self.samples.dropped,
                undelivered=left,
            ),
        )

    # -- main loop ------------------------------------------------------------------------------
    def _loop(self, stop: threading.Event) -> None:
        interval = self.config.interval_s
        next_tick = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_tick:
                self._tick()
                next_tick += interval
                now = time.monotonic()
                if next_tick <= now:  # fell behind (a slow tick): skip, never burst
                    next_tick = now + interval - (now - next_tick) % interval
            wait = min(next_tick - now, 0.05 if len(self.merger) else _WAKE_S)
            self._drain_events(max(0.0, wait))
            self._service()

    def _tick(self) -> None:
        src = self.source
        assert src is not None
        began = time.perf_counter()
        amap = self.allocations
        known = self.allocations_known
        self._tick_amap = amap
        resolve = self.pid_resolver
        samples = src.poll()  # may call _on_gpu_lost (hooks) on this thread
        configured: dict[str, float] = {}  # per MIG-mode GPU: the fractions its slices cover
        for s in samples:
            if s["mig"]:
                configured[s["uuid"]] = configured.get(s["uuid"], 0.0) + (s["mig"]["slice_fraction"] or 0.0)
        slices: dict[str, list[str]] = {}
        put, enc, topic = self.samples.put, self._enc_sample, self.t_samples
        ts = 0
        for s in samples:
            enrich_sample(s, amap, resolve)
            s["allocations_known"] = known
            mig = s["mig"]
            if not mig and s.get("mig_enabled"):
                s["mig_configured_fraction"] = configured.get(s["uuid"], 0.0)
            if mig:
                slices.setdefault(s["uuid"], []).append(mig["mig_uuid"])
            try:
                value = enc(s)
            except EncodeError as exc:
                self.encode_errors += 1
                log.error("sample dropped: %s", exc, extra=fields(gpu=s.get("gpu_index")))
                continue
            put(topic, (mig["mig_uuid"] if mig else s["uuid"]).encode(), value)
            ts = s["timestamp_ms"]
        self._slices = slices
        self.samples.pump()
        self.ticks += 1
        m = self.metrics
        m.samples_built.inc(len(samples))
        m.tick_seconds.observe(time.perf_counter() - began)
        if ts:
            m.last_tick.set(ts / 1000)
        m.gpus_lost.set(len(src.lost_gpus))

    def _service(self) -> None:
        self._emit_all(self.merger.expire(time.monotonic()))
        sender = self.sender
        assert sender is not None
        sender.retry_failed()
        self.publisher.poll(0)
        self.samples.pump()
        self._sync_metrics()

    def _sync_metrics(self) -> None:
        dropped = self.samples.dropped
        if dropped > self._dropped_seen:
            self.metrics.records_dropped.inc(dropped - self._dropped_seen)
            if self._dropped_seen == 0:
                log.warning("sample queue full (broker unreachable?): dropping the oldest samples")
            self._dropped_seen = dropped
        if self.sender is not None:
            self.metrics.spool_depth.set(self.sender.depth)

    # -- XIDs -----------------------------------------------------------------------------------
    def _on_nvml_event(self, event: dict[str, Any]) -> None:  # watcher thread
        self._events.put(("nvml", time.monotonic(), int(event["timestamp_ms"]), event))

    def _drain_events(self, timeout: float) -> None:
        try:
            item = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item: tuple[str, float, int, Any]) -> None:
        kind, at, seen_ms, payload = item
        if kind == "nvml":
            released = self.merger.add(
                "nvml", payload.get("pci_bus_id") or "", payload["xid"], at, nvml_fields(payload)
            )
        elif isinstance(payload, FallenOffBus):
            self._emit(fallen_off_bus_event(payload, seen_ms, self._context()))
            return
        else:
            ev: KernelXid = payload
            released = self.merger.add("kmsg", ev.pci_bus_id, ev.xid, at, kmsg_fields(ev, seen_ms))
        self._emit_all(released)

    def _context(self) -> XidContext:
        src = self.source
        assert src is not None
        return XidContext(
            self.config.hostname,
            src.bus_id_map(),
            self.allocations,
            slices=self._slices,
            mig_lookup=src.mig_uuid_for,
        )

    def _emit_all(self, merged: list[dict[str, Any]]) -> None:
        if not merged:
            return
        ctx = self._context()
        for m in merged:
            if m.get("source") == "nvml+kmsg":
                self.xid_merged += 1
            self._emit(build_xid_event(m, ctx))

    def _emit(self, event: dict[str, Any]) -> None:
        try:
            value = self._enc_xid(event)
        except EncodeError as exc:
            self.encode_errors += 1
            log.error("XID event could not be encoded: %s", exc, extra=fields(event=repr(event)[:500]))
            return
        key = (event["mig_uuid"] or event["uuid"] or event["pci_bus_id"] or "unknown").encode()
        assert self.sender is not None
        self.sender.send(key, value)
        self.xids_sent += 1
        self.metrics.xid_events.labels(event["kind"]).inc()
        if event["kind"] == "xid" and event["gpu_index"] is not None and self.source is not None:
            self.source.record_xid(event["gpu_index"], event["xid"], event["gpu_instance_id"])
        log.warning(
            "GPU error event",
            extra=fields(
                kind=event["kind"],
                xid=event["xid"],
                gpu=event["gpu_index"],
                uuid=event["uuid"],
                pci_bus_id=event["pci_bus_id"],
                source=event["source"],
                pid=event["pid"],
                process=event["process_name"],
                message=event["message"][:200],
                pods=[f"{a['namespace']}/{a['pod']}" for a in event["allocations"]],
            ),
        )

    def _on_gpu_lost(self, lost: LostGpu) -> None:  # main loop (NvmlSource.poll)
        event = gpu_lost_xid_event(lost, self.config.hostname)
        ctx = XidContext(self.config.hostname, {}, self._tick_amap, slices=self._slices)
        event["allocations"] = ctx.allocations(event["uuid"], None, lost.gpu)
        self._emit(event)

    # -- kubelet thread -------------------------------------------------------------------------
    def _kubelet_loop(self) -> None:
        refresher = self.refresher
        assert refresher is not None
        interval = self.config.interval_s
        while not self._threads_stop.is_set():
            began = time.monotonic()
            amap = refresher.refresh()  # never raises; empty on failure
            self._amap_state = (amap, time.monotonic())  # one assignment: readers see a consistent pair
            self._threads_stop.wait(max(0.0, interval - (time.monotonic() - began)))

    # -- kernel-log thread ----------------------------------------------------------------------
    def _kmsg_loop(self) -> None:
        path = self.config.kmsg_path
        assert path
        stop = self._threads_stop
        while not stop.is_set():
            reader = KmsgReader(path, follow=True, from_start=False, idle_ticks=True, stop_event=stop)
            self._kmsg_reader = reader
            try:
                self._read_kmsg(reader)
            except OSError as exc:
                log.error(
                    "kernel log unreadable; XIDs come from NVML events only until it is (retry in %ds): %s",
                    KMSG_RETRY_S,
                    exc,
                )
            else:
                if path == "-":
                    return  # stdin ended
            if stop.wait(KMSG_RETRY_S):
                return

    def _read_kmsg(self, reader: KmsgReader) -> None:
        parser = KmsgParser()
        feed, put, ready = parser.feed, self._events.put, self.kmsg_ready
        for line in reader:
            if not ready.is_set():
                ready.set()
            events = feed(line)
            if "Xid (" in line and parse_line(line) is None:
                self.kmsg_malformed += 1
                log.debug("kernel-log line looks like an Xid report but does not parse: %r", line[:300])
            if events:
                at, seen_ms = time.monotonic(), int(time.time() * 1000)
                for ev in events:
                    put(("kmsg", at, seen_ms, ev))
        for ev in parser.flush():
            put(("kmsg", time.monotonic(), int(time.time() * 1000), ev))
