"""The Kafka side of the metrics consumer: feeds the :class:`SeriesStore` and serves ``/metrics``.

Instances of one consumer group split ``gpu.samples.v1``; each serves the GPUs of the partitions it
holds and drops a revoked partition's series at once. Every instance reads all of ``gpu.xid.v1`` and
keeps only the XIDs of GPUs it owns. Records that are not our Avro, of the wrong type, unsigned (with
``--node-ca-file``) or unusable are dead-lettered; samples older than ``max_sample_age_s`` are not shown.
More (sharding, XIDs, own metrics): docs/inside-metrics.md, "service.py".
"""

from __future__ import annotations

import logging
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpupipe.common.logs import fields
from gpupipe.domain.node_check import DEADLETTER_REASON as NODE_IDENTITY
from gpupipe.domain.node_check import NodeCheck, NodeCheckCollector, NodeIdentity
from gpupipe.kafka import topics
from gpupipe.kafka.acls import DEFAULT_GROUPS
from gpupipe.kafka.admin import client_config, ensure_topics, wait_for_broker
from gpupipe.kafka.group_start import start_offsets
from gpupipe.kafka.lag import lags
from gpupipe.kafka.partitioner import key_partition
from gpupipe.lifecycle.startup import process_start_ms
from gpupipe.web.server import HttpServer
from gpupipe_consumers.metrics.collectors_csv import CounterSet
from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.gcpolicy import GC_THRESHOLDS, after_scrape, tune_gc  # noqa: F401 (re-exported)
from gpupipe_consumers.metrics.http import MetricsEndpoint, MetricsServer
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import DEFAULT_MAX_GPUS, SeriesStore, UnusableSample
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop, InRecord, Rejected
from gpupipe_schemas.codec import AvroCodec, codec_from_url
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.validate import violation

log = logging.getLogger("gpupipe.metrics")

#: A replica that dies (SIGKILL, OOM, a lost node) holds its partitions until its session times out,
#: and its GPUs go unserved meanwhile: Kafka's default of 45 s is three missed scrapes at 15 s. 20 s
#: bounds that gap to about one, and outlasts a group coordinator paused for 10-15 s (librdkafka
#: gives the partitions up after a session without an answer; the replica then rejoins and re-reads
#: since its last auto-commit, which only sets gauges again). --kafka-config overrides either key.
GROUP_TIMEOUTS = {"session.timeout.ms": "20000", "heartbeat.interval.ms": "3000"}

SERVICE = "metrics"


# -- the service's own metrics -------------------------------------------------------------------
class ServiceMetrics:
    RENDER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
    DELAY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)

    def __init__(self, registry: CollectorRegistry) -> None:
        self.render_seconds = Histogram(
            "gpupipe_metrics_render_seconds",
            "Time to produce one /metrics answer: render (join the GPU lines) and gzip.",
            ["stage"],
            buckets=self.RENDER_BUCKETS,
            registry=registry,
        )
        self.revoked_gpus = Counter(
            "gpupipe_metrics_revoked_gpus",
            "GPUs whose series were dropped because their partition was revoked.",
            registry=registry,
        )
        self.ingest_delay = Histogram(
            "gpupipe_metrics_ingest_delay_seconds",
            "Freshness: time from the oldest sample of a consumed batch's publication (its Kafka "
            "timestamp) until it is in the store, where the next scrape shows it.",
            buckets=self.DELAY_BUCKETS,
            registry=registry,
        )
        self.skipped = Counter(
            "gpupipe_metrics_samples_skipped",
            "Samples not shown: older than --max-sample-age (replays, backfills).",
            ["reason"],
            registry=registry,
        )


class _ServiceCollector(Collector):
    """Values read from the handler and the XID reader at scrape time."""

    def __init__(self, service: MetricsService) -> None:
        self._svc = service

    def collect(self) -> Iterator[Any]:
        h = self._svc.handler
        fam = GaugeMetricFamily(
            "gpupipe_metrics_assigned_partitions",
            "Partitions of gpu.samples.v1 this instance holds (and serves the GPUs of).",
            labels=["topic"],
        )
        fam.add_metric([h.samples_topic], len(h.assigned))
        yield fam
        xc = CounterMetricFamily(
            "gpupipe_metrics_xid_records",
            "gpu.xid.v1 records read by this instance, by outcome (other_owner: another instance "
            "holds the GPU).",
            labels=["result"],
        )
        for result, n in sorted(h.xid_results.items()):
            xc.add_metric([result], n)
        yield xc
        reader = self._svc.xid_reader
        if reader is not None:
            lag = GaugeMetricFamily(
                "gpupipe_metrics_xid_reader_lag_records",
                "High watermark minus next offset of the gpu.xid.v1 reader, per partition.",
                labels=["partition"],
            )
            for part, n in sorted(reader.lag().items()):
                lag.add_metric([str(part)], n)
            yield lag


class _TimedStore(SeriesStore):
    """A SeriesStore whose scrapes are timed into ``gpupipe_metrics_render_seconds{stage="render"}``."""

    metrics: ServiceMetrics | None = None

    def render_parts(self, now_s: float | None = None) -> list[bytes]:
        t = time.perf_counter()
        parts = super().render_parts(now_s)
        if self.metrics is not None:
            self.metrics.render_seconds.labels("render").observe(time.perf_counter() - t)
        after_scrape()  # freeze the line lists it left (gcpolicy): no 200 ms young collections
        return parts


class _TimedGzip:
    """Wraps the server's GzipCache to time compression."""

    def __init__(self, inner: Any, hist: Any) -> None:
        self._inner = inner
        self._hist = hist

    def compress(self, parts: list[bytes]) -> list[bytes]:
        t = time.perf_counter()
        out = self._inner.compress(parts)
        self._hist.observe(time.perf_counter() - t)
        return out


# -- the consume-loop handler ----------------------------------------------------------------------
class MetricsHandler:
    """Samples -> store (through the group), XIDs -> store for GPUs this instance owns.

    Thread use: the consume loop calls ``on_assign``/``on_revoke``/``handle``; the XID reader
    calls ``handle_xids`` from its own thread. ``_own_lock`` makes "is this GPU mine, then store
    the event" atomic with "revoke, then drop", so an XID never resurrects a revoked GPU.
    """

    def __init__(
        self,
        store: SeriesStore,
        *,
        samples_topic: str,
        xid_topic: str,
        metrics: ServiceMetrics | None = None,
        max_sample_age_s: float | None = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.samples_topic = samples_topic
        self.xid_topic = xid_topic
        self.metrics = metrics
        self.max_sample_age_s = max_sample_age_s or None
        self.clock = clock
        self.assigned: frozenset[int] = frozenset()  # samples partitions held
        # The group assigned this instance its share at least once (perhaps none of it): until
        # then it cannot tell its own XIDs from another owner's.
        self.assigned_once = False
        self.samples_partitions = 0  # partition count of the samples topic (0: not known yet)
        self.murmur_ok = True  # record keys follow the murmur2 partitioner (checked on new keys)
        self.xid_results: dict[str, int] = dict.fromkeys(("applied", "other_owner", "rejected"), 0)
        self.skipped_old = 0
        self._checked_keys: set[bytes] = set()
        self._own_lock = threading.Lock()

    # -- rebalance -------------------------------------------------------------------------------
    def on_assign(self, partitions: Sequence[tuple[str, int]]) -> None:
        mine = {p for t, p in partitions if t == self.samples_topic}
        with self._own_lock:
            self.assigned = self.assigned | mine
            self.assigned_once = True

    def on_revoke(self, partitions: Sequence[tuple[str, int]]) -> None:
        tps = [(t, p) for t, p in partitions if t == self.samples_topic]
        with self._own_lock:
            self.assigned = self.assigned - {p for _, p in tps}
            removed = self.store.drop_partitions(tps)
        if self.metrics is not None and removed:
            self.metrics.revoked_gpus.inc(removed)
        log.info("series of revoked partitions dropped", extra=fields(partitions=len(tps), gpus=removed))

    # -- samples ---------------------------------------------------------------------------------
    def handle(self, records: Sequence[InRecord]) -> list[Rejected]:
        now = self.clock()
        cutoff_ms = None if self.max_sample_age_s is None else (now - self.max_sample_age_s) * 1000.0
        rejected: list[Rejected] = []
        samples_topic = self.samples_topic
        old = 0
        taken: list[InRecord] = []
        for rec in records:
            if rec.topic != samples_topic:  # XIDs come through handle_xids, not the group
                rejected.append((rec, "unexpected-topic", f"{rec.name} on {rec.topic}"))
                continue
            if rec.name != "GpuSample":
                rejected.append((rec, "unexpected-record-type", f"{rec.name} on {rec.topic}"))
                continue
            if cutoff_ms is not None:
                ts = rec.value.get("timestamp_ms")
                if isinstance(ts, int) and ts < cutoff_ms:
                    old += 1
                    continue
            taken.append(rec)
        # the whole batch in one hold of the store's lock (see SeriesStore.apply_samples)
        failed = self.store.apply_samples([(r.value, (samples_topic, r.partition)) for r in taken], now)
        bad: set[int] = set()
        for i, exc in failed:
            rec = taken[i]
            bad.add(i)
            if isinstance(exc, UnusableSample):
                rejected.append((rec, "invalid-record", str(exc)))
            else:  # a poison record must not stop the service
                log.error(
                    "sample could not be applied",
                    exc_info=exc,
                    extra=fields(offset=rec.offset),
                )
                rejected.append((rec, "apply-failed", f"{type(exc).__name__}: {exc}"))
        oldest_ms = None
        checked = self._checked_keys
        for i, rec in enumerate(taken):
            if bad and i in bad:
                continue
            key = rec.key
            if key is not None and key not in checked:
                self._check_key(key, rec.partition)
            if rec.kafka_ts_ms > 0 and (oldest_ms is None or rec.kafka_ts_ms < oldest_ms):
                oldest_ms = rec.kafka_ts_ms
        if oldest_ms is not None and self.metrics is not None:
            self.metrics.ingest_delay.observe(max(0.0, self.clock() - oldest_ms / 1000.0))
        if old:
            self.skipped_old += old
            if self.metrics is not None:
                self.metrics.skipped.labels("too_old").inc(old)
        return rejected

    def _check_key(self, key: bytes, partition: int) -> None:
        """Once per GPU key: does murmur2 put it where it is? If not, stop trusting the hash."""
        n = self.samples_partitions
        if not n:  # partition count not known yet: check this key on a later sample
            return
        if len(self._checked_keys) > 1_000_000:
            self._checked_keys.clear()
        self._checked_keys.add(key)
        if self.murmur_ok and key_partition(key, n) != partition:
            self.murmur_ok = False
            log.warning(
                "gpu.samples.v1 keys are not murmur2-partitioned: XID events are kept only for GPUs "
                "already seen in samples (use the producer's default partitioner)",
                extra=fields(key=key.decode("utf-8", "replace"), partition=partition, partitions=n),
            )

    # -- XIDs ------------------------------------------------------------------------------------
    def owns_key(self, key: bytes | None, xid_partition: int) -> int | None:
        """The samples partition this instance holds for a record key, else None."""
        n = self.samples_partitions
        if not n or not self.murmur_ok:
            return None
        p = key_partition(key, n) if key else xid_partition % n
        return p if p in self.assigned else None

    def rejects(self, key: bytes | None, xid_partition: int) -> bool:
        """Whether this instance dead-letters a bad gpu.xid.v1 record: exactly one instance of
        the group does (the holder of the key's murmur2 partition, whatever the producer's
        partitioner), or every one while the samples topic's partition count is unknown."""
        n = self.samples_partitions
        if not n:
            return True
        return (key_partition(key, n) if key else xid_partition % n) in self.assigned

    def _xid_partition(self, rec: InRecord) -> tuple[str, int] | None:
        ev = rec.value
        part_of = self.store.partition_of
        for k in (ev.get("mig_uuid"), ev.get("uuid")):
            if k:
                p = part_of(k)
                if p is not None:
                    return p
        p = self.owns_key(rec.key, rec.partition)
        return None if p is None else (self.samples_topic, p)

    def handle_xids(self, records: Sequence[InRecord]) -> list[Rejected]:
        now = self.clock()
        rejected: list[Rejected] = []
        for rec in records:
            with self._own_lock:
                if rec.name != "XidEvent":
                    if self.rejects(rec.key, rec.partition):
                        rejected.append((rec, "unexpected-record-type", f"{rec.name} on {rec.topic}"))
                        self.xid_results["rejected"] += 1
                    else:
                        self.xid_results["other_owner"] += 1
                    continue
                part = self._xid_partition(rec)
                if part is None:
                    self.xid_results["other_owner"] += 1
                    continue
                try:
                    self.store.apply_xid(rec.value, part, now)
                except Exception as exc:  # a poison record must not stop the service
                    log.exception("XID event could not be applied", extra=fields(offset=rec.offset))
                    rejected.append((rec, "apply-failed", f"{type(exc).__name__}: {exc}"))
                    self.xid_results["rejected"] += 1
                    continue
                self.xid_results["applied"] += 1
        return rejected


# -- the XID reader --------------------------------------------------------------------------------
#: How soon the XID reader asks for metadata again after a failed refresh.
RETRY_REFRESH_S = 1.0


class XidReader:
    """Reads every partition of gpu.xid.v1 (no group, no commits) into ``handler.handle_xids``.

    Also keeps ``handler.samples_partitions`` current (the samples topic's partition count)."""

    def __init__(
        self,
        *,
        bootstrap: str,
        topic: str,
        samples_topic: str,
        handler: MetricsHandler,
        codec: AvroCodec,
        loop: ConsumeLoop,
        extra: Mapping[str, str] | None = None,
        from_beginning: bool = False,
        metadata_refresh_s: float = 30.0,
        consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
        node_check: NodeCheck | None = None,
    ) -> None:
        self.topic = topic
        self.node_check = node_check  # with --node-ca-file: as the consume loop checks the samples
        self.samples_topic = samples_topic
        self.handler = handler
        self.codec = codec
        self.loop = loop
        self.from_beginning = from_beginning
        self.metadata_refresh_s = metadata_refresh_s
        self.consumer = consumer_factory(
            client_config(
                bootstrap,
                extra,
                **{
                    "group.id": f"gpupipe-metrics-xid-{uuidlib.uuid4()}",  # never joins, never commits
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "isolation.level": "read_committed",
                    "fetch.wait.max.ms": 200,
                },
            )
        )
        self._parts: set[int] = set()
        self._positions: dict[int, int] = {}
        self._lag: dict[int, int] = {}
        self._lock = threading.Lock()
        self.healthy = False
        self.error: BaseException | None = None

    def refresh_metadata(self) -> None:
        md = self.consumer.list_topics(timeout=10)
        st = md.topics.get(self.samples_topic)
        if st is not None and st.error is None and st.partitions:
            n = len(st.partitions)
            if n != self.handler.samples_partitions:
                log.info("samples topic partitions", extra=fields(topic=self.samples_topic, partitions=n))
            self.handler.samples_partitions = n
        xt = md.topics.get(self.topic)
        if xt is None or xt.error is not None:
            return
        new = sorted(set(xt.partitions) - self._parts)
        if new:
            start = OFFSET_BEGINNING if self.from_beginning or self._parts else OFFSET_END
            parts = [TopicPartition(self.topic, p, start) for p in new]
            if start == OFFSET_END:  # first assignment: from the service's start, not "latest now"
                parts = start_offsets(self.consumer, parts, process_start_ms()) or parts
            self.consumer.incremental_assign(parts)
            self._parts.update(new)

    def ready(self) -> bool:
        """Whether to read: the XID partitions are known and the samples group assigned this
        instance its share. Read before that, every record looked like another owner's and was
        skipped for good: a startup's XIDs went uncounted and its bad ones undead-lettered."""
        return bool(self._parts) and self.handler.assigned_once

    def run(self, stop: threading.Event) -> None:
        try:
            self._run(stop)
        except BaseException as exc:
            self.error = exc
            log.exception("XID reader failed")
            raise
        finally:
            try:
                self.consumer.close()
            except Exception:
                log.warning("XID reader close failed", exc_info=True)

    def _run(self, stop: threading.Event) -> None:
        next_refresh = next_lag = 0.0
        while not stop.is_set():
            if time.monotonic() >= next_refresh:
                try:
                    self.refresh_metadata()
                except Exception:
                    # a fresh topic's leaders may still be moving: ask again soon, not in a full
                    # refresh period, or no XID reaches /metrics meanwhile
                    log.warning("XID reader: metadata refresh failed", exc_info=True)
                    next_refresh = time.monotonic() + min(RETRY_REFRESH_S, self.metadata_refresh_s)
                else:
                    next_refresh = time.monotonic() + self.metadata_refresh_s
            if not self.ready():
                stop.wait(0.5)
                continue
            msgs = self.consumer.consume(500, 0.2)
            self.healthy = True
            if msgs:
                self.process(msgs)
            if time.monotonic() >= next_lag:
                self._refresh_lag()
                next_lag = time.monotonic() + 1.0

    def process(self, msgs: Sequence[Any]) -> None:
        """Decode and check a consumed batch, then hand it to the handler.

        The same contract check as the shared consume loop (:func:`gpupipe_schemas.validate.violation`):
        this reader decodes on its own, and without it an XID dated 2100 pinned the last XID for
        ever, codes -1 and 2**31-1 were counted, and a 200 KB hostname was copied into every
        series of a GPU. Only the owner of the record's key dead-letters it, as for undecodable
        bytes, so N instances do not write N copies."""
        records: list[InRecord] = []
        metrics = self.loop.metrics
        now_ms = int(time.time() * 1000)
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("XID reader: consume error", extra=fields(error=err.str()))
                continue
            part = msg.partition()
            with self._lock:
                self._positions[part] = msg.offset() + 1
            try:
                d = self.codec.decode(msg.value(), msg.headers())
            except DecodeError as exc:
                if self.handler.rejects(msg.key(), part):
                    self.loop.dead_letter(msg, exc.reason, exc.detail)
                else:
                    self.handler.xid_results["other_owner"] += 1
                continue
            bad = violation(d.name, d.record, msg.timestamp()[1], now_ms)
            reason = "out-of-range"
            if bad is None and self.node_check is not None and d.name == "XidEvent":
                bad = self.node_check.refuse(d.name, d.record.get("hostname"), msg, now_ms)
                reason = NODE_IDENTITY
            if bad is not None:
                if self.handler.rejects(msg.key(), part):
                    self.loop.dead_letter(msg, reason, bad)
                    self.handler.xid_results["rejected"] += 1
                else:
                    self.handler.xid_results["other_owner"] += 1
                continue
            records.append(
                InRecord(
                    msg.topic(), part, msg.offset(), msg.key(), d.name, d.record, msg.timestamp()[1], msg
                )
            )
        if records:
            metrics.consumed.labels(self.topic).inc(len(records))
            for rec, reason, detail in self.handler.handle_xids(records):
                if rec.raw is not None:
                    self.loop.dead_letter(rec.raw, reason, detail)

    def lag(self) -> dict[int, int]:
        """Lag per partition as of the reader's last refresh (computed in the reader thread: a
        consumer call from the scrape thread would starve behind back-to-back ``consume()``)."""
        with self._lock:
            return dict(self._lag)

    def _refresh_lag(self) -> None:
        with self._lock:
            positions = dict(self._positions)
        found = lags(self.consumer, {(self.topic, part): pos for part, pos in positions.items()})
        out = {part: lag for (_, part), lag in found.items()}
        with self._lock:
            self._lag = out


# -- the service -------------------------------------------------------------------------------------
@dataclass
class MetricsConfig:
    """Everything ``gpupipe metrics`` needs (the command builds it from flags and env vars)."""

    bootstrap: str
    topic_prefix: str = ""
    group_id: str = DEFAULT_GROUPS["metrics"]
    host: str = "0.0.0.0"
    port: int = 9400
    counters: CounterSet | None = None  # None: the shipped default
    host_label: str | None = "Hostname"
    split_shared: bool = True
    stale_after_s: float | None = None  # None: stale_intervals x the sample's interval
    stale_intervals: float = 3.0
    max_gpus: int = DEFAULT_MAX_GPUS
    max_sample_age_s: float | None = 300.0
    web_config: str | None = None
    gzip_level: int = 1
    from_beginning: bool = False
    create_topics: bool = True
    schema_registry_url: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    render: RenderOptions | None = None  # the full layout (dcgm-exporter modes); wins over the two above
    node_identity: NodeIdentity | None = None  # None: a record's hostname is taken as written


class MetricsService:
    """Store + consume loop + XID reader + HTTP server. ``run(stop)`` in the foreground, or
    ``start()``/``stop()`` with the consume loop in a thread (tests, benchmarks)."""

    def __init__(self, cfg: MetricsConfig, server: HttpServer | None = None) -> None:
        self.cfg = cfg
        self.samples_topic = topics.with_prefix(cfg.topic_prefix, topics.SAMPLES)
        self.xid_topic = topics.with_prefix(cfg.topic_prefix, topics.XID)
        self.deadletter_topic = topics.with_prefix(cfg.topic_prefix, topics.DEADLETTER)
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.metrics = ServiceMetrics(self.registry)
        self.store = _TimedStore(
            cfg.counters,
            options=cfg.render or RenderOptions(host_label=cfg.host_label, split_shared=cfg.split_shared),
            registry=self.registry,
            stale_after_s=cfg.stale_after_s,
            stale_intervals=cfg.stale_intervals,
            max_gpus=cfg.max_gpus,
        )
        self.store.metrics = self.metrics
        self.handler = MetricsHandler(
            self.store,
            samples_topic=self.samples_topic,
            xid_topic=self.xid_topic,
            metrics=self.metrics,
            max_sample_age_s=cfg.max_sample_age_s,
        )
        codec = codec_from_url(cfg.schema_registry_url)
        check = None
        if cfg.node_identity is not None:
            check = cfg.node_identity.check(SERVICE, ("GpuSample", "XidEvent"))
            self.registry.register(NodeCheckCollector(check, SERVICE))
        self.loop = ConsumeLoop(
            bootstrap=cfg.bootstrap,
            group_id=cfg.group_id,
            topics=[self.samples_topic],
            handler=self.handler,
            codec=MetricsDecoder(codec, self.store.renderer),  # type: ignore[arg-type]
            deadletter_topic=self.deadletter_topic,
            service=SERVICE,
            registry=self.registry,
            extra={**GROUP_TIMEOUTS, **(cfg.extra or {})},
            from_beginning=cfg.from_beginning,
            topic_prefix=cfg.topic_prefix,
            # consume() waits for a full batch or this timeout: keep it short, a sample's value
            # should reach /metrics without waiting for 2000 others
            poll_timeout_s=0.05,
            node_check=check,
        )
        self.xid_reader: XidReader | None = XidReader(
            bootstrap=cfg.bootstrap,
            topic=self.xid_topic,
            samples_topic=self.samples_topic,
            handler=self.handler,
            codec=codec,
            loop=self.loop,
            extra=cfg.extra,
            from_beginning=cfg.from_beginning,
            node_check=check,
        )
        self.registry.register(_ServiceCollector(self))
        self.endpoint = MetricsEndpoint(self.store, cfg.gzip_level)
        self.endpoint.gzip = _TimedGzip(self.endpoint.gzip, self.metrics.render_seconds.labels("gzip"))
        # Given a server (the runner's, already listening), the service only serves on it; without
        # one (tests, benchmarks) it binds its own and prepares Kafka when started.
        self._own_server = server is None
        self.server: HttpServer = server or MetricsServer(
            (cfg.host, cfg.port),
            self.store,
            health=self.health,
            web_config=cfg.web_config,
            endpoint=self.endpoint,
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop_thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        host = self.cfg.host if self.cfg.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        return f"{self.server.scheme}://{host}:{self.port}"

    def routes(self) -> dict[str, MetricsEndpoint]:
        return {"/metrics": self.endpoint}

    def prepare(self) -> None:
        """Wait for the broker and create the topics (what the runner does before building)."""
        cfg = self.cfg
        wait_for_broker(cfg.bootstrap, extra=cfg.extra)
        if cfg.create_topics:
            ensure_topics(cfg.bootstrap, topics.ALL, prefix=cfg.topic_prefix, extra=cfg.extra)

    def health(self) -> tuple[bool, dict[str, Any]]:
        loop_alive = self._loop_thread is None or self._loop_thread.is_alive()
        xid_ok = self.xid_reader is None or self.xid_reader.error is None
        ok = bool(self.loop.healthy and loop_alive and xid_ok and not self._stop.is_set())
        last = self.loop.last_batch_time
        return ok, {
            "gpus": self.store.gpu_count(),
            "partitions": sorted(self.handler.assigned),
            "samples_topic": self.samples_topic,
            "group": self.cfg.group_id,
            "last_batch_age_s": round(time.time() - last, 3) if last else None,
            **self.loop.health_detail(),
        }

    def _start_side_threads(self) -> None:
        if self._own_server:
            self.server.start()
        if self.xid_reader is not None:
            t = threading.Thread(
                target=self.xid_reader.run, args=(self._stop,), name="xid-reader", daemon=True
            )
            t.start()
            self._threads.append(t)

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` (or ``self.stop()``); the consume loop runs in this thread."""
        if stop is not None:
            threading.Thread(target=lambda: (stop.wait(), self._stop.set()), daemon=True).start()
        self._start_side_threads()
        log.info(
            "metrics service started",
            extra=fields(
                listen=f"{self.cfg.host}:{self.port}",
                scheme=self.server.scheme,
                input=[self.samples_topic, self.xid_topic],
                group=self.cfg.group_id,
                families=len(self.store.families),
                host_label=self.cfg.host_label,
            ),
        )
        try:
            self.loop.run(self._stop)
        finally:
            self._shutdown()

    def start(self) -> MetricsService:
        """Prepare Kafka, then run in background threads; returns self."""
        self.prepare()
        self._loop_thread = threading.Thread(target=self.run, name="metrics-consume", daemon=True)
        self._loop_thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout_s)

    def _shutdown(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        if self._own_server:
            self.server.close()
        log.info("metrics service stopped", extra=fields(gpus=self.store.gpu_count()))
