"""The producer process that ``gpupipe produce`` runs: Kafka preparation, the publisher, one source.

:class:`ProducerService` is what :func:`gpupipe.lifecycle.runner.run_service` builds, serves, runs and closes;
the nvml source runs the node agent, the simulated source :func:`run_simulated`.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

from gpupipe.common.errors import GpupipeError
from gpupipe.common.logs import fields
from gpupipe.kafka import ready as kafka_ready
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides, parse_topic_overrides
from gpupipe.kafka.auth import KafkaAuthError, principal_of, runtime_write_denial
from gpupipe.lifecycle.runner import Lifecycle
from gpupipe_producer.framings import parse_framings
from gpupipe_producer.publish import DENIED, Publisher, producer_config
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import RAW, codec_from_url
from gpupipe_schemas.meaning import xid_kafka_key

log = logging.getLogger("gpupipe.produce")


class ProducerService:
    """One producer process: Kafka preparation, the publisher, and the simulated or NVML loop."""

    def __init__(
        self, args: argparse.Namespace, agent_config: Any = None, fleet: FleetConfig | None = None
    ) -> None:
        self.args = args
        self._fleet = fleet  # the simulated source's fleet, built from args
        self.extra = parse_kafka_overrides(args.kafka_config)
        self.specs = parse_topic_overrides(args.topic_partitions, args.topic_retention)
        self.metrics = ProducerMetrics()
        self.registry = self.metrics.registry
        self.refused: list[str] = []  # the one line for a delivery the broker will never take
        self.publisher: Publisher | None = None
        self._checks: list[Any] = [lambda: (True, {})] * 2
        self._life: Lifecycle | None = None
        self._left = 0
        self._dropped: dict[str, int] = {}
        #: The nvml source: set once the broker answers and the topics exist (the agent runs and
        #: spools XIDs before; it hands nothing to librdkafka until then). None: simulated.
        self.serve_after: threading.Event | None = None
        self._agent: Any = None
        self._agent_config = agent_config  # the nvml source's AgentConfig, built from args
        self._start_error: GpupipeError | None = None
        self._xids_kept = 0
        self._samples_left = 0
        self.t_samples = topics.with_prefix(args.topic_prefix, topics.SAMPLES)
        self.t_xid = topics.with_prefix(args.topic_prefix, topics.XID)
        self.t_topology = topics.with_prefix(args.topic_prefix, topics.TOPOLOGY)
        framed = parse_framings(args.framing, registry=bool(args.schema_registry_url))
        self.framings = {topics.with_prefix(args.topic_prefix, t): f for t, f in framed.items()}

    # -- start ---------------------------------------------------------------------------------
    def build(self, life: Lifecycle) -> ProducerService:
        args, extra = self.args, self.extra
        self._life = life
        if args.source == "nvml":
            # A node agent must start (and spool XIDs) while Kafka is down or its topics are still
            # missing: it waits for them in a thread, 503 "starting" meanwhile, and hands nothing to
            # librdkafka until then (records to a missing topic only fail, "Unknown topic").
            self.serve_after = threading.Event()
            threading.Thread(
                target=self._wait_for_kafka, args=(life,), name="kafka-wait", daemon=True
            ).start()
        else:
            kafka_ready.prepare_kafka(
                args.bootstrap_servers,
                topics.to_prepare([topics.SAMPLES, topics.XID], create=args.create_topics),
                prefix=args.topic_prefix,
                create=args.create_topics,
                specs=self.specs,
                extra=extra,
                timeout_s=life.startup_timeout_s,
                state=life.state,
                stop=life.stop,
            )
        metrics = self.metrics

        def on_delivery(err: Any, msg: Any) -> None:
            # Successes are counted by the Publisher (cheap ints, synced at scrape); failures are rare.
            if err is not None:
                metrics.records_failed.labels(msg.topic(), err.name()).inc()

        def on_fatal(err: Any, topic: str | None) -> None:  # a delivery callback: Kafka's thread
            if err.code() in DENIED:
                line = runtime_write_denial(principal_of(extra), err.name(), topic)
            else:
                line = f"the Kafka producer failed fatally ({err.name()}: {err.str()})"
            self.refused.append(line)
            log.error("stopping: " + line)
            life.stop.set()  # the node agent's XIDs stay in its spool for the next start

        publisher = Publisher(
            producer_config(args.bootstrap_servers, extra, args.compression, args.linger_ms),
            on_delivery,
            on_fatal=on_fatal,
            stop=life.stop,
        )
        metrics.watch_publisher(publisher)
        self.publisher = publisher
        # The node agent replaces these with its own checks (stalled loops, no GPU) once it exists.
        self._checks = [lambda: (True, {"sent": publisher.sent, "failed": publisher.failed})] * 2
        return self

    def _wait_for_kafka(self, life: Lifecycle) -> None:
        """The nvml source's start-up wait (its own thread): the broker, then the topics (created
        with --create-topics), with leaders. A wait that times out or is refused stops the agent."""
        args = self.args
        assert self.serve_after is not None
        try:
            kafka_ready.prepare_kafka(
                args.bootstrap_servers,
                topics.to_prepare([topics.SAMPLES, topics.XID, topics.TOPOLOGY], create=args.create_topics),
                prefix=args.topic_prefix,
                create=args.create_topics,
                specs=self.specs,
                extra=self.extra,
                timeout_s=life.startup_timeout_s,
                state=life.state,
                stop=life.stop,
            )
        except kafka_ready.StartupCancelled:
            return
        except GpupipeError as exc:
            self._start_error = exc
            log.error("stopping: %s", exc)
            life.stop.set()
            return
        log.info("Kafka and its topics are ready: delivering", extra=fields(bootstrap=args.bootstrap_servers))
        self.serve_after.set()

    # -- serve ---------------------------------------------------------------------------------
    def _checked(self, which: int) -> tuple[bool, dict[str, Any]]:
        if self.refused:  # says so before the process has gone
            return False, {"error": self.refused[0]}
        return self._checks[which]()

    def health(self) -> tuple[bool, dict[str, Any]]:
        return self._checked(0)

    def ready(self) -> tuple[bool, dict[str, Any]]:
        return self._checked(1)

    def _on_agent(self, agent: Any) -> None:
        self._agent = agent
        self._checks = [agent.health, agent.ready]

    def run(self, stop: threading.Event) -> None:
        args, publisher = self.args, self.publisher
        codec = codec_from_url(args.schema_registry_url, framings=self.framings)
        assert publisher is not None
        if self.framings.get(self.t_samples) == RAW:
            publisher.topic_headers[self.t_samples] = codec.encoder("GpuSample", self.t_samples).headers or []
        if self.framings.get(self.t_xid) == RAW:
            publisher.topic_headers[self.t_xid] = codec.encoder("XidEvent", self.t_xid).headers or []
        if self.framings.get(self.t_topology) == RAW:
            publisher.topic_headers[self.t_topology] = (
                codec.encoder("GpuTopology", self.t_topology).headers or []
            )
        if args.source == "simulated":
            enc_s = codec.encoder("GpuSample", self.t_samples).encode
            enc_x = codec.encoder("XidEvent", self.t_xid).encode
            assert self._fleet is not None  # built from the flags before Kafka was touched
            run_simulated(
                args, self._fleet, publisher, self.metrics, stop, self.t_samples, self.t_xid, enc_s, enc_x
            )
        else:
            from gpupipe_producer.agent.node_agent import run_nvml  # needs NVML; imported only when asked for

            assert self._agent_config is not None  # built from the flags before Kafka was touched
            run_nvml(
                self._agent_config,
                publisher,
                self.metrics,
                stop,
                codec,
                self.t_samples,
                self.t_xid,
                on_agent=self._on_agent,
                kafka_ready=self.serve_after,
                t_topology=self.t_topology,
            )

    # -- stop ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Within the shutdown budget, broker up or down: what is still undelivered then is purged,
        counted per topic, and said in one line (the nvml source's XIDs stay in its spool)."""
        publisher = self.publisher
        if publisher is None:
            return
        assert self._life is not None
        self._left = publisher.flush(self._life.deadline.remaining(default_s=30.0))
        self._dropped = publisher.drop_pending() if self._left else {}
        agent = self._agent
        if agent is not None and agent.sender is not None:
            # After the purge: what the next start replays is what the spool holds now, whether
            # it was purged here, never handed over (topics missing) or failed.
            agent.sender.spool.close()
            self._xids_kept = agent.sender.depth
            self._samples_left = len(agent.samples)
        log.info(
            "producer stopped",
            extra=fields(sent=publisher.sent, failed=publisher.failed, undelivered=self._left),
        )

    def raise_outcome(self) -> None:
        publisher = self.publisher
        if self.refused:
            raise KafkaAuthError(self.refused[0])
        if self._start_error is not None:
            raise self._start_error
        if publisher is None:
            return
        dropped = dict(self._dropped)
        if self._agent is not None:
            # Samples still queued were never handed over; XIDs are counted where they are.
            dropped[self.t_samples] = dropped.get(self.t_samples, 0) + self._samples_left
            dropped[self.t_xid] = self._xids_kept
            dropped = {t: n for t, n in dropped.items() if n}
        if dropped:
            raise GpupipeError(
                _dropped_line(dropped, self.t_samples, self.t_xid, spooled=self.args.source == "nvml")
            )
        if self._left or publisher.failed:
            raise GpupipeError(
                f"{publisher.failed} records failed and {self._left} were not delivered (see logs)"
            )


def _dropped_line(dropped: dict[str, int], t_samples: str, t_xid: str, spooled: bool) -> str:
    """One line: what a stop with the broker unreachable left undelivered, and where XIDs went."""
    xids = dropped.get(t_xid, 0)
    samples = dropped.get(t_samples, 0)
    other = sum(dropped.values()) - xids - samples
    where = "kept in the spool for the next start" if spooled else "dropped"
    text = f"stopped with records undelivered: {samples} samples dropped, {xids} XIDs {where}"
    return text + (f", {other} other records dropped" if other else "")


def run_simulated(
    args: argparse.Namespace,
    fleet_config: FleetConfig,
    publisher: Publisher,
    metrics: ProducerMetrics,
    stop: threading.Event,
    t_samples: str,
    t_xid: str,
    enc_sample: Any,
    enc_xid: Any,
) -> int:
    """The simulated loop; returns the number of ticks run."""
    interval = args.interval
    fleet = SimulatedFleet(fleet_config)
    start_ms = (
        args.start_time if args.start_time is not None else int(time.time() * 1000) // interval * interval
    )
    ticks = None if args.duration is None else args.duration // interval
    speed = args.speed
    keys = [s.key.encode() for s in fleet.slots]
    log.info(
        "simulated fleet started",
        extra=fields(
            gpus=fleet.gpu_count,
            nodes=args.nodes,
            interval_ms=interval,
            speed=speed or "max",
            ticks=ticks,
            topic=t_samples,
        ),
    )
    produce = publisher.produce
    t0 = time.monotonic()
    k = 0
    while (ticks is None or k < ticks) and not stop.is_set():
        if speed:
            wait = t0 + k * interval / 1000.0 / speed - time.monotonic()
            if wait > 0 and stop.wait(wait):
                break
        began = time.perf_counter()
        ts = start_ms + k * interval
        samples, xids = fleet.tick(ts)
        for key, rec in zip(keys, samples, strict=True):
            produce(t_samples, key, enc_sample(rec))
        for x in xids:
            produce(t_xid, xid_kafka_key(x), enc_xid(x))
            metrics.xid_events.labels(x["kind"]).inc()
        publisher.poll(0)
        metrics.samples_built.inc(len(samples))
        metrics.tick_seconds.observe(time.perf_counter() - began)
        metrics.last_tick.set(ts / 1000)
        k += 1
    return k
