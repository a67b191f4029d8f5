"""The node agent behind ``gpupipe produce --source nvml``: it owns the threads, the kubelet map and health.

Construct :class:`NodeAgent`, then ``run(stop)``: it builds the NVML source, the XID path and the
inputs, runs the main loop until ``stop`` is set and shuts down within the budget. The NVML module is
injected (``nvml=`` or :data:`nvml_factory`). Threads, health and shutdown: docs/producer.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpupipe.common.logs import fields
from gpupipe_producer.agent.dra_slices import ResourceSliceIndex
from gpupipe_producer.agent.metrics import AgentCollector
from gpupipe_producer.agent.nvml_control import NvmlControl
from gpupipe_producer.agent.topology_publisher import TopologyPublisher
from gpupipe_producer.agent_config import (
    DEFAULT_IN_FLIGHT_LIMIT,
    DEFAULT_SAMPLE_QUEUE_MAX,
    DEFAULT_SPOOL_DIR,
    DEFAULT_SPOOL_MAX_BYTES,
    KMSG_RETRY_S,
    SHUTDOWN_BUDGET_S,
    SHUTDOWN_FLUSH_S,
    AgentConfig,
    config_from_args,
    default_hostname,
)
from gpupipe_producer.kubelet.client import AllocationRefresher
from gpupipe_producer.kubelet.mapping import DEFAULT_DRA_DRIVERS, AllocationMap, AllocationMapper
from gpupipe_producer.nvml.errors import NvmlSourceError
from gpupipe_producer.nvml.events import XidEventWatcher
from gpupipe_producer.nvml.operational import OperationalEventWatcher
from gpupipe_producer.nvml.records import GpuRef, LostGpu
from gpupipe_producer.nvml.source import NvmlSource, SourceHooks, default_nvml_module
from gpupipe_producer.nvml.watchers import WatcherPair
from gpupipe_producer.publish import Publisher
from gpupipe_producer.samples.dcgm_profiling import fill_samples
from gpupipe_producer.samples.dcgm_scraper import DcgmExporterScraper
from gpupipe_producer.samples.enrich import PidResolver, enrich_sample
from gpupipe_producer.samples.pid_pods import PidPodResolver
from gpupipe_producer.samples.queue import SampleQueue
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.xid.kmsg_cursor import KmsgCursorStore, read_boot_id
from gpupipe_producer.xid.kmsg_input import KmsgInput
from gpupipe_producer.xid.pipeline import XidInbox, XidPath
from gpupipe_producer.xid.sender import SPOOL_FRAMING, PublisherXids, XidSender, reframer
from gpupipe_producer.xid.spool import XidSpool
from gpupipe_producer.xid.wake import WakeEvent
from gpupipe_producer.xid.xid_merge import XidMerger
from gpupipe_schemas.errors import EncodeError
from gpupipe_schemas.meaning import sample_kafka_key

if TYPE_CHECKING:  # cryptography is loaded only by a producer that signs
    from gpupipe.domain.node_identity import NodeSigner

log = logging.getLogger("gpupipe.agent")

#: Returns the NVML module to use. Tests replace it; the default imports ``pynvml``.
nvml_factory: Callable[[], Any] = default_nvml_module

_WAKE_S = 0.25  # longest wait between main-loop passes (stop is noticed within this)
#: DRA drivers whose claims are mapped: GPUs (resolved to UUIDs through NVML) and ComputeDomain
#: IMEX channels (listed in the map's ``dra`` part: a ComputeDomain pod's GPUs come from its
#: gpu.nvidia.com claim).
DRA_DRIVERS = (*DEFAULT_DRA_DRIVERS, "compute-domain.nvidia.com")

__all__ = [
    "DEFAULT_IN_FLIGHT_LIMIT",
    "DEFAULT_SAMPLE_QUEUE_MAX",
    "DEFAULT_SPOOL_DIR",
    "DEFAULT_SPOOL_MAX_BYTES",
    "KMSG_RETRY_S",
    "AgentConfig",
    "NodeAgent",
    "config_from_args",
    "default_hostname",
    "nvml_factory",
    "run_nvml",
]


def run_nvml(
    config: AgentConfig,
    publisher: Publisher,
    metrics: ProducerMetrics,
    stop: threading.Event,
    codec: Any,
    t_samples: str,
    t_xid: str,
    *,
    nvml: Any = None,
    on_agent: Callable[[NodeAgent], None] | None = None,
    kafka_ready: threading.Event | None = None,
    t_topology: str | None = None,
) -> int:
    """``gpupipe produce --source nvml``: run the agent until ``stop`` is set; returns the ticks run.

    ``on_agent`` receives the agent before it starts (the command wires ``/healthz`` to it).
    ``kafka_ready``: see :class:`NodeAgent`.

    Raises :class:`gpupipe_producer.nvml.errors.NvmlInitError` (a GpupipeError: one line, non-zero exit)
    when NVML cannot be initialised.
    """
    agent = NodeAgent(
        config,
        publisher,
        metrics,
        codec,
        t_samples,
        t_xid,
        nvml=nvml,
        kafka_ready=kafka_ready,
        t_topology=t_topology,
    )
    if on_agent is not None:
        on_agent(agent)
    return agent.run(stop)


def _signed(produce: Callable[..., None], signer: NodeSigner | None) -> Callable[..., None]:
    """``produce(topic, key, value)``, signing each value at hand-over when the node has a signer."""
    if signer is None:
        return produce

    def signed(topic: str, key: bytes, value: bytes) -> None:
        produce(topic, key, value, signer.headers(value))

    return signed


class _Hooks(SourceHooks):
    """The source's telemetry as the agent's metrics; a lost GPU goes to the XID inbox."""

    def __init__(self, metrics: ProducerMetrics, inbox: XidInbox) -> None:
        self._metrics = metrics
        self._inbox = inbox

    def collect_duration(self, group: str, seconds: float) -> None:
        self._metrics.collect_seconds.labels(group).observe(seconds)

    def nvml_error(self, kind: str) -> None:
        self._metrics.nvml_errors.labels(kind).inc()

    def garbage(self, field: str) -> None:
        self._metrics.nvml_errors.labels("garbage").inc()

    def collector_failure(self, group: str, exc: BaseException) -> None:
        self._metrics.nvml_errors.labels("collector_failure").inc()

    def gpu_lost(self, lost: LostGpu) -> None:
        self._inbox.gpu_lost(lost)

    def gpu_recovered(self, gpu: GpuRef) -> None:
        log.info("GPU answers NVML again", extra=fields(gpu=gpu.gpu_index, uuid=gpu.uuid))

    def unsupported(self, call: str, reason: str) -> None:
        self._metrics.nvml_unsupported.labels(call, reason).inc()


class NodeAgent:
    """One node's producer. Construct, then ``run(stop_event)`` on the thread that should poll.

    A thin owner: the threads, the kubelet map and health are here; the NVML source, the XID path
    (:class:`~gpupipe_producer.xid.pipeline.XidPath`), the sample queue and the inputs are collaborators it
    builds at start. Constructing it starts nothing and opens no device.

    ``kafka_ready`` (None: at once): nothing is handed to librdkafka before it is set (the topics
    exist). Meanwhile XIDs are spooled and samples wait in their bounded queue (oldest dropped,
    counted), instead of failing one by one on a missing topic.

    ``t_topology`` (None: not published): the compacted topic of the node's GPU topology.
    """

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
        kafka_ready: threading.Event | None = None,
        t_topology: str | None = None,
    ) -> None:
        self.config = config
        self._kafka_ready = kafka_ready.is_set if kafka_ready is not None else None
        self.publisher = publisher
        self.metrics = metrics
        self.t_samples = t_samples
        self.t_xid = t_xid
        self._nvml = nvml
        self._enc_sample = codec.encoder("GpuSample", t_samples).encode
        self._enc_xid = codec.encoder("XidEvent", framing=SPOOL_FRAMING).encode
        self._frame_xid = reframer(codec, codec.encoder("XidEvent", t_xid))
        c = config
        #: Reads and publishes the GPU topology on the polling thread (None: not published).
        self.topology: TopologyPublisher | None = None
        if t_topology is not None:
            self.topology = TopologyPublisher(
                c.hostname,
                t_topology,
                codec.encoder("GpuTopology", t_topology).encode,
                _signed(publisher.produce, c.signer),
                lambda topic: publisher.sent_by_topic.get(topic, 0),
                ready=self._kafka_ready,
                on_error=lambda kind: metrics.nvml_errors.labels(kind).inc(),
            )
        self.source: NvmlSource | None = None
        self.watcher: XidEventWatcher | WatcherPair | None = None
        self.refresher: AllocationRefresher | None = None
        #: This node's ResourceSlices (``--dra-resource-slices api``): DRA devices to UUIDs.
        self.dra_slices: ResourceSliceIndex | None = None
        self._dra_uuid: Callable[[str, str, str], str | None] = lambda _d, _p, _n: None
        self.control: NvmlControl | None = None
        self.sender: XidSender | None = None
        self.xids: XidPath | None = None
        self.samples = SampleQueue(
            _signed(publisher.produce, c.signer),
            lambda: len(publisher),
            c.sample_queue_max,
            c.in_flight_limit,
            ready=self._kafka_ready,
        )
        #: The node's dcgm-exporter, read on its own thread (None: ``--dcgm-exporter-url`` off).
        self.dcgm: DcgmExporterScraper | None = None
        if c.dcgm_exporter_url:
            self.dcgm = DcgmExporterScraper(
                c.dcgm_exporter_url,
                interval_s=c.profiling_interval_s,
                on_error=lambda kind: metrics.dcgm_scrape_errors.labels(kind).inc(),
            )
        self.pid_resolver: PidResolver | None = None
        if c.pid_resolver is not None:
            self.pid_resolver = c.pid_resolver
        elif c.resolve_pids:
            self.pid_resolver = PidPodResolver(c.proc_root, c.pod_logs_dir)
        # Fed by the threads (and by the source while it opens the GPUs), drained by the XID path.
        self.inbox = XidInbox()
        self._amap_state: tuple[AllocationMap, float] = (AllocationMap.empty(), float("-inf"))  # map, when
        # A WakeEvent: the kernel-log reader blocks on it and its input together, without a timeout.
        self._threads_stop = WakeEvent()
        self._threads: list[threading.Thread] = []
        self.kmsg_input: KmsgInput | None = None
        self.cursor: KmsgCursorStore | None = None
        self._kmsg_thread: threading.Thread | None = None
        self._poll_thread: threading.Thread | None = None
        self.started = threading.Event()
        # Progress marks (monotonic) for /healthz.
        self._main_beat = time.monotonic()
        self._poll_beat = time.monotonic()
        # Counters (main loop or the one thread that owns them).
        self.ticks = 0
        self.kmsg_malformed = 0
        self._sample_encode_errors = 0
        self._dropped_seen = 0
        self.boot_id = read_boot_id(c.boot_id_path)
        self._collector = AgentCollector(self)
        metrics.registry.register(self._collector)

    # -- public state ---------------------------------------------------------------------------
    @property
    def merger(self) -> XidMerger | None:
        """The XID path's merger (None before the start)."""
        return self.xids.merger if self.xids is not None else None

    @property
    def xids_sent(self) -> int:
        return self.xids.sent if self.xids is not None else 0

    @property
    def xid_merged(self) -> int:
        """XIDs seen by both NVML and the kernel log and sent as one event."""
        return self.xids.xid_merged if self.xids is not None else 0

    @property
    def encode_errors(self) -> int:
        """Samples and XID events that did not match their schema."""
        return self._sample_encode_errors + (self.xids.encode_errors if self.xids is not None else 0)

    @property
    def allocations(self) -> AllocationMap:
        """The newest good kubelet map; after failed Lists the last good one for up to
        ``--kubelet-grace`` (flagged: ``kubelet_map_stale``), then empty."""
        amap, at = self._amap_state
        if time.monotonic() - at > self._stale_after:
            return AllocationMap.empty()
        return amap

    @property
    def kubelet_map_stale(self) -> bool:
        """True while the map in use predates a failed List (the grace period)."""
        r = self.refresher
        return r is not None and not r.healthy and bool(self.allocations)

    def dra_unresolved(self, amap: AllocationMap) -> int:
        if self.source is None:
            return 0
        resolve, nvidia = self._dra_uuid, DEFAULT_DRA_DRIVERS[0]
        return sum(1 for k in amap.dra if k.driver == nvidia and resolve(k.driver, k.pool, k.device) is None)

    @property
    def allocations_known(self) -> bool:
        """False while kubelet enrichment is on but no attribution is known (chargeback then bills
        ``__unattributed__``, not ``__unallocated__``): no map yet, or the List failed past the grace
        period. Within the grace period the last good map is kept (flagged ``allocations_stale``),
        so tenants stay billed to their pods."""
        if not self.config.kubelet_socket:
            return True
        r = self.refresher
        if r is None:
            return False
        if r.healthy:
            return time.monotonic() - self._amap_state[1] <= self._stale_after
        return self.kubelet_map_stale

    @property
    def _stale_after(self) -> float:
        c = self.config
        return max(2 * c.interval_s + c.kubelet_timeout_s, c.kubelet_grace_s)

    @property
    def kmsg_ready(self) -> threading.Event:
        """Set once the kernel-log reader is positioned (tests wait on it)."""
        return self.kmsg_input.ready if self.kmsg_input is not None else self._no_kmsg

    _no_kmsg = threading.Event()

    def kmsg_stats(self) -> dict[str, int]:
        r = self.kmsg_input.reader if self.kmsg_input is not None else None
        if r is None:
            return {}
        s = r.stats
        return {"lines": s.lines, "malformed": s.malformed, "overrun": s.overrun, "skipped": s.skipped}

    def stalled_gpus(self) -> int:
        return self.source.stalled_count() if self.source is not None else 0

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details) for /healthz: False when a loop stalls or NVML sees no GPU."""
        c = self.config
        stall = c.stall_after_s or max(3 * c.interval_s, 2 * c.nvml_timeout_s + c.interval_s, 10.0)
        now = time.monotonic()
        problems: list[str] = []
        if not self.started.is_set():
            return False, {"problems": ["starting"]}
        if self.source is not None and not self.source.gpus():
            problems.append("nvml_sees_no_gpu")
        if self.control is not None and self.control.needs_restart:
            problems.append("nvml_library_mismatch")  # only a restart loads the new driver's library
        if now - self._poll_beat > stall:
            problems.append("nvml_polling_stalled")
        if now - self._main_beat > stall:
            problems.append("xid_loop_stalled")
        kin = self.kmsg_input
        kmsg_stall = max(stall, c.kmsg_retry_s + stall)
        if kin is not None and self.kmsg_alive() and kin.stalled_for(now) > kmsg_stall:
            problems.append("kmsg_reader_stalled")
        elif kin is not None and self._kmsg_thread is not None and not self.kmsg_alive():
            problems.append("kmsg_reader_died")  # a bug: only a restart reads the kernel log again
        w = self.watcher
        if w is not None and w.dead:
            problems.append("nvml_event_thread_died")  # a bug: a restart watches that GPU again
        detail: dict[str, Any] = {
            "ticks": self.ticks,
            "xids_sent": self.xids_sent,
            "stalled_gpus": self.stalled_gpus(),
            "spool_on_disk": bool(self.sender and self.sender.spool.on_disk),
        }
        if w is not None and (w.stuck or w.dead):
            # A wait stuck in NVML (a hung GPU) is said, not failed on: a restart would not help.
            detail["nvml_event_threads"] = {"stuck": w.stuck, "dead": w.dead}
        if problems:
            detail["problems"] = problems
        return not problems, detail

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """(ready, details) for /readyz: healthy and holding NVML (not released on request or
        because NVML cannot be initialised again; see :mod:`gpupipe_producer.agent.nvml_control`). A release
        that is requested but postponed is said in ``nvml_release_pending`` (still ready)."""
        ok, detail = self.health()
        released = self.control.released if self.control is not None else None
        if released is not None:
            detail = {**detail, "nvml_released": released}
            detail["problems"] = [*detail.get("problems", []), "nvml_released"]
            ok = False
        pending = self.control.release_pending if self.control is not None else None
        if pending is not None:
            # The release file is there but NVML is still held (why: the value). Still ready, on
            # purpose: whoever waits for 503 before `nvidia-smi -r` must not go ahead yet.
            detail = {**detail, "nvml_release_pending": pending}
        return ok, detail

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
        self._nvml = nvml  # the topology is read through the same module
        self.source = NvmlSource(
            nvml,
            c.hostname,
            {
                "fast": c.interval_s,
                "slow": c.slow_interval_s,
                "profiling": c.profiling_interval_s,
                "processes": c.processes_interval_s,
                "lost_reinit": c.nvml_reinit_after_s,
            },
            hooks=_Hooks(self.metrics, self.inbox),
        )
        self.source.start()  # NvmlInitError: the caller exits with NVML's message
        self.source.call_timeout_s = c.nvml_timeout_s
        if not self.source.gpus():
            log.error("NVML sees no GPU on this node: nothing to report; /healthz is unhealthy")
        # Never raises: an unusable directory (root-owned hostPath, full disk) keeps XIDs in
        # memory, logged once and counted, instead of a crash loop.
        spool = XidSpool(c.spool_dir, c.spool_max_bytes)
        self.sender = XidSender(
            PublisherXids(self.publisher, self.metrics, c.signer, self._frame_xid),
            self.t_xid,
            spool,
            retry_after_s=c.xid_retry_after_s,
            ready=self._kafka_ready,
        )
        cursor = self.cursor = KmsgCursorStore(c.spool_dir, self.boot_id) if c.kmsg_path else None
        self.xids = XidPath(
            c,
            self.metrics,
            self.inbox,
            self.source,
            self.sender,
            self._enc_xid,
            cursor=cursor,
            allocations=lambda: self.allocations,
            boot_id=self.boot_id,
        )
        if c.nvml_events:
            legacy = XidEventWatcher(
                nvml,
                self.inbox.nvml_event,
                timeout_ms=c.nvml_event_timeout_ms,
                on_error=lambda kind: self.metrics.nvml_errors.labels(kind).inc(),
                on_delivery=lambda how: self.metrics.nvml_event_delivery.labels(how).inc(),
                mig_uuid_lookup=self.source.mig_uuid_for,
                # A GPU whose set-up or wait takes longer than an NVML call may is hung: neither
                # the start nor a stop waits longer for it (see producer/nvml/events.py).
                setup_timeout_s=c.nvml_timeout_s,
                stop_timeout_s=c.nvml_event_timeout_ms / 1000.0 + c.nvml_timeout_s,
            )
            # GPU Operational Events where the driver has them (R615+); older ones say so once.
            goe = OperationalEventWatcher(
                nvml,
                self.inbox.nvml_event,
                timeout_ms=c.nvml_event_timeout_ms,
                on_error=lambda kind: self.metrics.nvml_errors.labels(f"operational_{kind}").inc(),
                on_support=self.metrics.operational_support,
                setup_timeout_s=c.nvml_timeout_s,
                stop_timeout_s=c.nvml_event_timeout_ms / 1000.0 + c.nvml_timeout_s,
            )
            self.xids.goe.capable = goe.registered_bus
            self.watcher = WatcherPair(legacy, goe)
            try:
                self.watcher.start()
            except NvmlSourceError as exc:  # NvmlInitError included: kmsg still reports XIDs
                log.warning("NVML XID events unavailable; the kernel log still reports XIDs: %s", exc)
                self.metrics.nvml_errors.labels("event_set").inc()
                self.watcher = None
        self.control = NvmlControl(
            self.source,
            self.watcher,
            c.nvml_release_file,
            on_watcher_error=lambda kind: self.metrics.nvml_errors.labels(kind).inc(),
        )
        self._dra_uuid = self.source.dra_device_uuid
        if c.dra_api is not None:
            self.dra_slices = ResourceSliceIndex(
                c.dra_api,
                c.hostname,
                DRA_DRIVERS,
                fallback=self.source.dra_device_uuid,
                on_error=lambda kind: self.metrics.kubelet_errors.labels(f"resource_slices_{kind}").inc(),
            )
            self._dra_uuid = self.dra_slices.uuid
        if c.kubelet_socket:
            self.refresher = AllocationRefresher(
                socket_path=c.kubelet_socket,
                timeout_s=c.kubelet_timeout_s,
                mapper=AllocationMapper(
                    c.extra_resource_names,
                    DRA_DRIVERS,
                    dra_device_resolver=self._dra_uuid,
                ),
                on_error=lambda kind: self.metrics.kubelet_errors.labels(kind).inc(),
            )
            self._spawn("kubelet-refresh", self._kubelet_loop)
        if c.kmsg_path and cursor is not None:
            self.kmsg_input = KmsgInput(
                c.kmsg_path,
                self.inbox.put,
                self._threads_stop,
                after_seq=cursor.start_after(),
                retry_s=c.kmsg_retry_s,
            )
            self._kmsg_thread = self._spawn("kmsg-reader", self.kmsg_input.run)
        if c.extras is not None:
            c.extras.start(self.metrics.registry)
        if self.dcgm is not None:
            dcgm = self.dcgm
            self._spawn("dcgm-scrape", lambda: dcgm.run(self._threads_stop))
        self._poll_beat = time.monotonic()
        self._poll_thread = self._spawn("nvml-poll", self._poll_loop)
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
                spool_on_disk=spool.on_disk,
                kmsg_after_seq=self.kmsg_input._after_seq if self.kmsg_input else None,
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
        if self.config.extras is not None:
            self.config.extras.stop()
        xids = self.xids
        if xids is None:  # failed before anything was spooled
            for t in self._threads:
                t.join(self.config.kubelet_timeout_s + 2.0)
            if self.watcher is not None:
                self.watcher.stop()
            if self.source is not None:
                self.source.shutdown()
            return
        began = time.monotonic()
        joined_by = began + self.config.kubelet_timeout_s + 2.0  # one bound for all, not one each
        for t in self._threads:  # the polling thread first: it may be restarting the watcher
            t.join(max(0.0, joined_by - time.monotonic()))
            if t.is_alive():
                log.warning("thread %s did not stop in time", t.name)
        if self.watcher is not None:
            self.watcher.stop()  # bounded (a wait stuck in NVML is left); drains into the queue
        xids.drain(0.0)
        xids.flush_held()
        if self.refresher is not None:
            self.refresher.close()
        if self.source is not None:
            self.source.shutdown()
        # Whatever hung above, the flush ends within the budget (the spool keeps what is not sent).
        deadline = min(time.monotonic() + SHUTDOWN_FLUSH_S, began + SHUTDOWN_BUDGET_S)
        sender = xids.sender
        while time.monotonic() < deadline:
            if self._kafka_ready is not None and not self._kafka_ready():
                break  # the topics never became ready: nothing can go over; the spool keeps the XIDs
            # XIDs go over in bounded chunks (pump hands over more as deliveries are reported).
            moved = sender.pump() + self.samples.pump()
            if not moved and not len(self.samples) and not sender.in_flight:
                break
            self.publisher.poll(0.05)
        left = self.publisher.flush(max(0.0, deadline - time.monotonic()))
        self._sync_metrics()
        xids.sender.spool.sync_acked()
        if not left:
            xids.sender.spool.close()  # else late delivery reports may still ack into it
        log.info(
            "node agent stopped",
            extra=fields(
                ticks=self.ticks,
                xids_sent=self.xids_sent,
                xid_spool_depth=xids.sender.depth,
                samples_dropped=self.samples.dropped,
                undelivered=left,
            ),
        )

    # -- main loop ------------------------------------------------------------------------------
    def _loop(self, stop: threading.Event) -> None:
        """XIDs and delivery only: never NVML (see the module docstring)."""
        xids = self.xids
        assert xids is not None
        while not stop.is_set():
            self._main_beat = time.monotonic()
            xids.drain(0.05 if xids.holding() else _WAKE_S)
            self._service()
            if self._poll_thread is not None and not self._poll_thread.is_alive():
                log.error("the NVML polling thread died; stopping the agent")
                break

    def _poll_loop(self) -> None:
        interval = self.config.interval_s
        stop = self._threads_stop
        next_tick = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_tick:
                try:
                    if self.control is None or self.control.step(now):
                        self._tick()
                except Exception:
                    log.exception("NVML poll failed; the next tick tries again")
                self._poll_beat = time.monotonic()
                next_tick += interval
                now = time.monotonic()
                if next_tick <= now:  # fell behind (a slow tick): skip, never burst
                    next_tick = now + interval - (now - next_tick) % interval
            stop.wait(max(0.0, next_tick - now))

    def _tick(self) -> None:
        src, xids = self.source, self.xids
        assert src is not None and xids is not None
        began = time.perf_counter()
        amap = self.allocations
        known = self.allocations_known
        xids.poll_began(amap)
        resolve = self.pid_resolver
        samples = src.poll()  # may call _on_gpu_lost (hooks) on this thread
        if self.dcgm is not None:  # the last scrape, already in memory: never waits on the network
            fill_samples(samples, self.dcgm.readings())
        ids = src.device_ids()
        stale = self.kubelet_map_stale
        configured: dict[str, float] = {}  # per MIG-mode GPU: the fractions its slices cover
        parent_energy: dict[str, int] = {}  # per MIG-mode GPU: its energy counter, for its slices
        for s in samples:
            if s["mig"]:
                configured[s["uuid"]] = configured.get(s["uuid"], 0.0) + (s["mig"]["slice_fraction"] or 0.0)
            elif s.get("mig_enabled") and s.get("total_energy_mj") is not None:
                parent_energy[s["uuid"]] = s["total_energy_mj"]
        slices: dict[str, list[str]] = {}
        put, enc, topic = self.samples.put, self._enc_sample, self.t_samples
        ts = 0
        extras = self.config.extras
        for s in samples:
            enrich_sample(s, amap, resolve, ids)
            if extras is not None:
                extras.decorate(s)
            if stale:
                s["allocations_stale"] = True
            s["allocations_known"] = known
            mig = s["mig"]
            if not mig and s.get("mig_enabled"):
                s["mig_configured_fraction"] = configured.get(s["uuid"], 0.0)
                # Each slice carries the GPU's counter, read in this same poll, and bills its
                # fraction of the delta.
                s["mig_energy_by_slice"] = s["uuid"] in parent_energy and s["uuid"] in configured
            if mig:
                slices.setdefault(s["uuid"], []).append(mig["mig_uuid"])
                if s.get("total_energy_mj") is None:
                    s["mig_parent_energy_mj"] = parent_energy.get(s["uuid"])
            try:
                value = enc(s)
            except EncodeError as exc:
                self._sample_encode_errors += 1
                log.error("sample dropped: %s", exc, extra=fields(gpu=s.get("gpu_index")))
                continue
            put(topic, sample_kafka_key(s), value)
            ts = s["timestamp_ms"]
        xids.poll_ended(slices)
        if self.topology is not None:
            self.topology.tick(src, self._nvml)  # reads only when the GPU set changed
        self.samples.pump()
        self.ticks += 1
        m = self.metrics
        m.samples_built.inc(len(samples))
        m.tick_seconds.observe(time.perf_counter() - began)
        if ts:
            m.last_tick.set(ts / 1000)
        m.gpus_lost.set(len(src.lost_gpus))

    def _service(self) -> None:
        xids = self.xids
        assert xids is not None
        xids.expire()
        self.publisher.poll(0)  # delivery reports: acknowledgements applied in memory
        xids.sender.pump()  # one acknowledged-mark write for all of them, retries, the next chunk
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

    # -- kubelet thread -------------------------------------------------------------------------
    def _kubelet_loop(self) -> None:
        refresher = self.refresher
        assert refresher is not None
        interval = self.config.interval_s
        was_ok = True
        while not self._threads_stop.is_set():
            began = time.monotonic()
            amap = refresher.refresh()  # never raises; empty on failure
            if refresher.healthy:
                self._amap_state = (amap, time.monotonic())  # one assignment: a consistent pair
                was_ok = True
            elif was_ok:
                was_ok = False
                if self._amap_state[0]:
                    # One failed List must not blank every GPU: keep the last good map, flagged,
                    # until it is older than --kubelet-grace.
                    log.warning(
                        "kubelet List failed; keeping the last attribution for up to %.0fs (flagged)",
                        self._stale_after,
                    )
            self._threads_stop.wait(max(0.0, interval - (time.monotonic() - began)))
