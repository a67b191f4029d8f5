"""Publish GpuSample records (one per GPU per interval) and XidEvent records to Kafka.

Sources: `nvml` (this node's GPUs, the default) and `simulated` (a deterministic virtual fleet).
The simulated fleet must be asked for by name: run by hand on a GPU node, `gpupipe produce` has to
publish that node's readings, never made-up GPUs into the real topics.
With `--speed max` simulated time runs as fast as the pipeline allows: event
timestamps advance by the interval, not by the wall clock, so a backfill of two
simulated hours yields exactly nodes x gpus x 7200/interval samples.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

from gpupipe import service_flags, startup, topics
from gpupipe.argtypes import field_default, iso_time_ms, positive_duration_ms
from gpupipe.durations import format_duration_ms
from gpupipe.errors import ConfigError, GpupipeError
from gpupipe.kafka_admin import parse_kafka_overrides, parse_topic_overrides
from gpupipe.kafka_auth import KafkaAuthError, principal_of, runtime_write_denial
from gpupipe.logs import fields
from gpupipe.runner import Lifecycle, ServiceSpec, run_service
from gpupipe_producer.podmeta.extras import add_arguments as podmeta_arguments
from gpupipe_producer.publish import DENIED, Publisher, producer_config
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_producer.spool import DEFAULT_MAX_BYTES as DEFAULT_SPOOL_MAX_BYTES
from gpupipe_schemas.codec import CONFLUENT, FRAMINGS, RAW, codec_from_url
from gpupipe_schemas.meaning import xid_kafka_key

#: The kubelet's rotating client certificate and key in one file (CN system:node:<node>): the
#: identity the chart has a producer sign its XIDs with (``--node-cert``).
KUBELET_CLIENT_CERT = "/var/lib/kubelet/pki/kubelet-client-current.pem"

log = logging.getLogger("gpupipe.produce")

#: --startup-timeout of a finite run (--duration) when none is given: a job fails fast, a service waits.
JOB_STARTUP_TIMEOUT_MS = 10_000


def _speed(text: str) -> float:
    if text.strip().lower() == "max":
        return 0.0
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad speed {text!r}: use 1, 60 or max") from None
    if v <= 0:
        raise argparse.ArgumentTypeError("speed must be > 0 or 'max'")
    return v


def _node_indexes(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3): node indexes of the simulated fleet."""
    try:
        out = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad node list {text!r}: use node indexes such as 0,3") from None
    if any(n < 0 for n in out):
        raise argparse.ArgumentTypeError(f"bad node list {text!r}: indexes start at 0")
    return out


#: One line for `gpupipe --help`.
HELP = "run the node producer (simulated fleet or NVML) publishing to Kafka"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        choices=["nvml", "simulated"],
        default="nvml",
        help="nvml: this node's GPUs; simulated: a made-up fleet for demos, tests and backfills",
    )
    p.add_argument(
        "--interval",
        type=positive_duration_ms,
        default=field_default(FleetConfig, "interval_ms"),
        help="sample interval, e.g. 1s, 500ms",
    )
    service_flags.add_listen(p, serves="the producer's own /metrics")
    service_flags.add_create_topics(p)
    p.add_argument(
        "--topic-partitions",
        action="append",
        default=[],
        metavar="NAME=N",
        help="partitions for a topic created here, e.g. samples=24 (repeatable)",
    )
    p.add_argument(
        "--topic-retention",
        action="append",
        default=[],
        metavar="NAME=DURATION",
        help="retention for a topic created here, e.g. xid=90d (repeatable)",
    )
    p.add_argument(
        "--framing",
        action="append",
        default=[],
        metavar="[NAME=]FRAMING",
        help=f"how values are framed, per topic (samples=raw) or for both: one of {', '.join(FRAMINGS)} "
        "(default: confluent with --schema-registry-url, else single-object; docs/schemas.md)",
    )
    p.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "snappy", "gzip", "none"])
    p.add_argument("--linger-ms", type=int, default=50, help="librdkafka linger for batching")
    sim = p.add_argument_group("simulated source")
    sim.add_argument("--nodes", type=int, default=field_default(FleetConfig, "nodes"))
    sim.add_argument("--gpus-per-node", type=int, default=field_default(FleetConfig, "gpus_per_node"))
    sim.add_argument(
        "--duration", type=positive_duration_ms, default=None, help="simulated time to cover, then exit"
    )
    sim.add_argument(
        "--start-time", type=iso_time_ms, default=None, help="ISO time of the first sample (default: now)"
    )
    sim.add_argument(
        "--speed", type=_speed, default=1.0, help="1 (real time), 60 (a minute per second) or max"
    )
    sim.add_argument("--seed", type=int, default=field_default(FleetConfig, "seed"))
    sim.add_argument(
        "--xid-rate",
        type=float,
        default=field_default(FleetConfig, "xid_rate_per_gpu_hour"),
        metavar="PER_GPU_HOUR",
        help="mean XIDs per GPU-hour of simulated time",
    )
    sim.add_argument("--hostname-prefix", default=field_default(FleetConfig, "hostname_prefix"))
    sim.add_argument(
        "--mig-nodes",
        type=_node_indexes,
        default=(),
        metavar="INDEXES",
        help="nodes (0-based, comma-separated) that always have a MIG GPU, whatever the seed draws",
    )
    sim.add_argument(
        "--shared-nodes",
        type=_node_indexes,
        default=(),
        metavar="INDEXES",
        help="nodes (0-based, comma-separated) that always have time-sliced GPUs, whatever the seed draws",
    )
    sim.add_argument(
        "--hpc-nodes",
        type=int,
        default=field_default(FleetConfig, "hpc_nodes"),
        help="extra Slurm-style nodes whose GPUs are held by HPC jobs (hpc_job allocations)",
    )
    nv = p.add_argument_group("nvml source")
    nv.add_argument(
        "--hostname", default=None, help="node name on the records (default: $NODE_NAME, else the host name)"
    )
    nv.add_argument(
        "--kubelet-socket",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="kubelet PodResources socket; '' turns pod attribution off",
    )
    nv.add_argument(
        "--kubelet-timeout",
        type=positive_duration_ms,
        default=1000,
        help="deadline of one kubelet List",
    )
    nv.add_argument(
        "--kubelet-grace",
        type=positive_duration_ms,
        default=10_000,
        help="keep the last good pod attribution this long after failed kubelet Lists, flagged",
    )
    nv.add_argument(
        "--extra-resource-names",
        default="",
        metavar="NAMES",
        help="more GPU resource names to map, comma-separated ('example.com/gpu,vendor.io/*')",
    )
    nv.add_argument(
        "--kmsg-path",
        default="/dev/kmsg",
        help="kernel log to read XIDs from: /dev/kmsg, a gpupipe-kmsg-relay socket, a file, or - (stdin)",
    )
    nv.add_argument("--no-kmsg", action="store_true", help="do not read the kernel log")
    nv.add_argument("--no-nvml-events", action="store_true", help="do not watch NVML XID events")
    nv.add_argument(
        "--xid-merge-window",
        type=positive_duration_ms,
        default=500,
        help="an XID seen by NVML and the kernel log within this window is one event",
    )
    nv.add_argument("--spool-dir", default="/var/lib/gpupipe/spool", help="XID spool directory (on disk)")
    nv.add_argument(
        "--spool-max-bytes",
        type=int,
        default=DEFAULT_SPOOL_MAX_BYTES,
        help="XID spool bound in bytes (memory holds about 1.6 times it); oldest dropped over it",
    )
    nv.add_argument(
        "--sample-queue-max",
        type=int,
        default=10_000,
        help="samples held in memory while Kafka is unreachable; oldest dropped over it",
    )
    nv.add_argument(
        "--slow-interval",
        type=positive_duration_ms,
        default=30_000,
        help="ECC / remapped rows / retired pages",
    )
    nv.add_argument(
        "--profiling-interval",
        type=positive_duration_ms,
        default=1000,
        help="GPM profiling metrics",
    )
    nv.add_argument(
        "--processes-interval",
        type=positive_duration_ms,
        default=5000,
        help="per-process memory/utilisation",
    )
    nv.add_argument(
        "--nvml-timeout",
        type=positive_duration_ms,
        default=2000,
        help="longest wait for one GPU's NVML calls in a poll; a GPU over it is left out and reported",
    )
    nv.add_argument(
        "--nvml-release-file",
        default=None,
        metavar="PATH",
        help="while this file exists the agent holds no NVML session (for nvidia-smi -r or a driver "
        "upgrade; /readyz answers 503 meanwhile); '' for none (default: <spool-dir>/nvml-release)",
    )
    nv.add_argument(
        "--nvml-reinit-after",
        type=positive_duration_ms,
        default=60_000,
        help="with a GPU lost, re-initialise NVML after this long (then doubling up to 1h), so a "
        "reset GPU is seen again without a restart",
    )
    nv.add_argument(
        "--node-cert",
        default=None,
        metavar="PATH",
        help="sign XID and sample records as this node with this certificate (PEM; it must name the "
        "node in CN "
        f"system:node:NAME or a DNS SAN), e.g. the kubelet's {KUBELET_CLIENT_CERT}; the alerts "
        "service's --node-ca-file checks it (default: unsigned)",
    )
    nv.add_argument(
        "--node-key",
        default=None,
        metavar="PATH",
        help="private key of --node-cert, PEM (default: the --node-cert file, as the kubelet keeps both)",
    )
    nv.add_argument("--proc-root", default="/proc", help="procfs of the host (pid -> pod via cgroups)")
    nv.add_argument(
        "--pod-logs-dir",
        default="/var/log/pods",
        help="kubelet pod log directory (pod UID -> namespace/name)",
    )
    podmeta_arguments(p.add_argument_group("pod metadata and HPC jobs (nvml source)"))
    startup.add_arguments(
        p,
        startup_default=None,
        unset_means=f"{format_duration_ms(JOB_STARTUP_TIMEOUT_MS)} with --duration, else 0",
    )


def run(args: argparse.Namespace) -> int:
    agent_config = None
    if args.source == "simulated":
        fleet_config(args)  # a bad fleet is one line before anything starts
        if getattr(args, "node_cert", None):
            raise ConfigError("--node-cert signs one node's records: use it with --source nvml")
    else:
        from gpupipe_producer.agent_config import config_from_args  # grpc and NVML: only for this source

        agent_config = config_from_args(args)  # so is a bad agent flag or node certificate
    # A finite run (--duration) is a job: an unreachable broker is one line and exit 3 after 10s.
    # Otherwise a service: wait for ever (503 on /healthz meanwhile), whatever starts first.
    startup_ms = args.startup_timeout
    if startup_ms is None:
        startup_ms = JOB_STARTUP_TIMEOUT_MS if args.duration else 0
    producer = ProducerRun(args, agent_config)
    spec = ServiceSpec.from_args("producer", args, startup_timeout_ms=startup_ms)
    run_service(spec, producer.build)
    producer.raise_outcome()
    return 0


def parse_framings(items: list[str], registry: bool) -> dict[str, str]:
    """``--framing`` values (``raw``, ``samples=raw``) into base topic -> framing; ConfigError."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, framing = item.rpartition("=")
        bases = [topics.resolve_alias(name.strip())] if sep else [topics.SAMPLES, topics.XID]
        if bases[0] not in (topics.SAMPLES, topics.XID) or framing not in FRAMINGS:
            raise ConfigError(
                f"--framing expects [samples=|xid=]FRAMING with FRAMING one of {', '.join(FRAMINGS)}, "
                f"got {item!r}"
            )
        if framing == CONFLUENT and not registry:
            raise ConfigError("--framing confluent needs --schema-registry-url")
        out.update(dict.fromkeys(bases, framing))  # type: ignore[arg-type]
    return out


class ProducerRun:
    """One producer process: Kafka preparation, the publisher, and the simulated or NVML loop."""

    def __init__(self, args: argparse.Namespace, agent_config: Any = None) -> None:
        self.args = args
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
        framed = parse_framings(args.framing, registry=bool(args.schema_registry_url))
        self.framings = {topics.with_prefix(args.topic_prefix, t): f for t, f in framed.items()}

    # -- start ---------------------------------------------------------------------------------
    def build(self, life: Lifecycle) -> ProducerRun:
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
            startup.prepare_kafka(
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
            startup.prepare_kafka(
                args.bootstrap_servers,
                topics.to_prepare([topics.SAMPLES, topics.XID], create=args.create_topics),
                prefix=args.topic_prefix,
                create=args.create_topics,
                specs=self.specs,
                extra=self.extra,
                timeout_s=life.startup_timeout_s,
                state=life.state,
                stop=life.stop,
            )
        except startup.StartupCancelled:
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
        for topic, name in ((self.t_samples, "GpuSample"), (self.t_xid, "XidEvent")):
            if self.framings.get(topic) == RAW:
                publisher.topic_headers[topic] = codec.encoder(name, topic).headers or []
        if args.source == "simulated":
            enc_s = codec.encoder("GpuSample", self.t_samples).encode
            enc_x = codec.encoder("XidEvent", self.t_xid).encode
            run_simulated(args, publisher, self.metrics, stop, self.t_samples, self.t_xid, enc_s, enc_x)
        else:
            from gpupipe_producer.node_agent import run_nvml  # needs NVML; imported only when asked for

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


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """The simulated fleet that `produce --source simulated` flags describe; ConfigError if none can be."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus-per-node must be at least 1")
    mig, shared = tuple(getattr(args, "mig_nodes", ())), tuple(getattr(args, "shared_nodes", ()))
    for flag, picked in (("--mig-nodes", mig), ("--shared-nodes", shared)):
        if picked and picked[-1] >= args.nodes:
            raise ConfigError(f"{flag}: node {picked[-1]} is not in the fleet (nodes 0 to {args.nodes - 1})")
    if both := sorted(set(mig) & set(shared)):
        raise ConfigError(f"--mig-nodes and --shared-nodes both name node {both[0]}; pick one kind per node")
    if mig and args.gpus_per_node < 2:
        raise ConfigError("--mig-nodes needs --gpus-per-node 2 or more (a MIG GPU takes two slots)")
    return FleetConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        interval_ms=args.interval,
        seed=args.seed,
        xid_rate_per_gpu_hour=args.xid_rate,
        hostname_prefix=args.hostname_prefix,
        hpc_nodes=getattr(args, "hpc_nodes", 0),
        mig_nodes=mig,
        shared_nodes=shared,
    )


def run_simulated(
    args: argparse.Namespace,
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
    fleet = SimulatedFleet(fleet_config(args))
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
