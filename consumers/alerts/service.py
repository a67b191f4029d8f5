"""The alerts service as the runner builds it: options in, the consume loop, Alertmanager, cordoner and
leader election wired around one :class:`~gpupipe_consumers.alerts.handler.AlertsHandler`.

:class:`AlertsService` restores open alerts before consuming (at start, or on winning leadership),
serves ``/metrics`` and the open-alerts page, and on stop flushes what is pending unless fenced.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gpupipe.clients import kube
from gpupipe.clients.alertmanager import AlertmanagerFanout, AlertmanagerMetrics, AlertmanagerSender
from gpupipe.common.errors import ConfigError, GpupipeError
from gpupipe.common.logs import fields
from gpupipe.domain import node_check
from gpupipe.kafka import ready, topics
from gpupipe.lifecycle.runner import Lifecycle
from gpupipe.lifecycle.startup import process_start_ms
from gpupipe.web.server import Route, registry_route
from gpupipe_consumers.alerts.admission import DeviceAdmission
from gpupipe_consumers.alerts.alerts_page import AlertsPage
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from gpupipe_consumers.alerts.cordon import HOUR_MS, Cordoner, KubeNodeApi
from gpupipe_consumers.alerts.engine.config import EngineConfig
from gpupipe_consumers.alerts.engine.health_signals import HealthConfig
from gpupipe_consumers.alerts.handler import AlertsHandler, kafka_alert_sink, restore_from_topic
from gpupipe_consumers.alerts.leader import LeaderElector, ha_members
from gpupipe_consumers.alerts.sample_decode import AlertsDecoder
from gpupipe_consumers.plumbing.consume_loop import ConsumeLoop
from gpupipe_schemas.codec import codec_from_url

__all__ = ["AlertsOptions", "AlertsService"]

log = logging.getLogger("gpupipe.alerts")


@dataclass(frozen=True)
class AlertsOptions:
    """What the alerts service is run with, typed: the flags end at :func:`options_from_args`.

    No defaults here: the flags hold them (and `--help` shows them), the builder passes every field.
    """

    engine: EngineConfig
    health: HealthConfig
    bootstrap: str
    topic_prefix: str
    group_id: str
    instance: str
    schema_registry_url: str | None
    extra: dict[str, str]  # librdkafka settings
    from_beginning: bool
    create_topics: bool
    health_signals: bool
    restore_lookback_ms: int
    startup_timeout_ms: int
    ha: bool
    ha_session_timeout_ms: int
    ha_guard_interval_ms: int
    alertmanager_urls: tuple[str, ...]
    resend_interval_ms: int
    alertmanager_timeout_ms: int
    alertmanager_max_alerts: int
    max_nodes: int
    max_devices: int
    max_devices_per_node: int
    cordon: bool
    dry_run: bool
    cordon_max_per_hour: int
    cordon_max_share: float
    uncordon: bool
    cluster: kube.KubeConfig | None  # the API server to cordon through (--cordon without --dry-run)
    node_identity: node_check.NodeIdentity | None  # None: a record's hostname is taken as written


class AlertsService:
    """The alerts service wired from its options: what the runner builds and runs (and the storm bench)."""

    def __init__(self, opts: AlertsOptions, life: Lifecycle | None = None) -> None:
        self.opts = opts
        self.instance = opts.instance
        node_api = None
        if opts.cluster is not None:
            node_api = KubeNodeApi(kube.KubeClient(opts.cluster))
        extra = opts.extra
        t_xid = topics.with_prefix(opts.topic_prefix, topics.XID)
        t_samples = topics.with_prefix(opts.topic_prefix, topics.SAMPLES)
        self.alerts_topic = topics.with_prefix(opts.topic_prefix, topics.ALERTS)
        # gpu.alerts.v1 is read for operators' acks (gpupipe alerts --ack); the rest of it is skipped
        self.inputs = (
            [t_xid, t_samples, self.alerts_topic] if opts.health_signals else [t_xid, self.alerts_topic]
        )
        codec = codec_from_url(opts.schema_registry_url)
        self.registry = CollectorRegistry()
        self.alertmanager = None
        if opts.alertmanager_urls:
            am_metrics = AlertmanagerMetrics(self.registry)
            self.alertmanager = AlertmanagerFanout(
                [
                    AlertmanagerSender(
                        url,
                        shape=gpu_alert_shape,
                        resend_interval_ms=opts.resend_interval_ms,
                        timeout_s=opts.alertmanager_timeout_ms / 1000,
                        max_alerts=opts.alertmanager_max_alerts,
                        metrics=am_metrics,
                    )
                    for url in opts.alertmanager_urls
                ]
            )
        self.cordoner = None
        if opts.cordon or opts.dry_run:
            self.cordoner = Cordoner(
                node_api,
                dry_run=opts.dry_run,
                max_per_hour=opts.cordon_max_per_hour,
                on_result=lambda result: self.handler.on_cordon_result(result),
                instance=self.instance,
                max_share=opts.cordon_max_share,
                uncordon=opts.uncordon,
            )
        sink = kafka_alert_sink(opts.bootstrap, self.alerts_topic, codec, extra)
        identity = None
        if opts.node_identity is not None:
            identity = opts.node_identity.check("alerts", ("XidEvent", "GpuSample"))
        self.handler = AlertsHandler(
            sink=sink,
            engine_config=opts.engine,
            health_config=opts.health,
            registry=self.registry,
            alertmanager=self.alertmanager,
            cordoner=self.cordoner,
            instance=self.instance,
            admission=DeviceAdmission(
                max_nodes=opts.max_nodes,
                max_devices=opts.max_devices,
                max_devices_per_node=opts.max_devices_per_node,
            ),
            node_check=identity,
        )
        self.page = AlertsPage(self.handler.open_alerts_snapshot, instance=self.instance, role=self.role)
        self._codec, self._extra = codec, extra
        self._state = life.state if life is not None else None
        self._stop = life.stop if life is not None else None
        self.loop: ConsumeLoop | None = None
        self.elector: LeaderElector | None = None
        self.guard_error: str | None = None  # set when --ha instances joined this plain one's group
        if opts.ha:
            self.elector = LeaderElector(
                opts.bootstrap,
                prefix=opts.topic_prefix,
                group_id=opts.group_id,
                instance=self.instance,
                session_timeout_ms=opts.ha_session_timeout_ms,
                extra=extra,
                create_topic=opts.create_topics,
            )
            sink.fence = self.elector.fenced  # checked per record: a fenced leader publishes nothing
        else:
            self._refuse_a_group_of_ha_instances()
            self.activate()

    def _refuse_a_group_of_ha_instances(self) -> None:
        """A plain instance must not join the input group of ``--ha`` instances: it would take part of the
        leader's partitions (each XID seen by one of two engines, two publishers, two cordoners) and
        nothing fences it. Live HA instances are the members of the leader group (see :func:`ha_members`)."""
        line = self._ha_conflict()
        if line:
            raise ConfigError(line)

    def _ha_conflict(self) -> str | None:
        opts = self.opts
        members = ha_members(opts.bootstrap, opts.group_id, extra=opts.extra)
        if not members:
            return None
        return (
            f"--group-id {opts.group_id} is used by --ha instances ({', '.join(members)}): a plain "
            "instance would split their input and publish beside their leader; run it with --ha (it "
            "stands by), or give it a --group-id of its own"
        )

    def _guard(self, stop: threading.Event) -> None:
        """The same check while running: --ha instances started after this plain one stop it (it cannot
        be fenced, so it fences itself); the command then exits with the line (``guard_error``)."""
        while not stop.wait(self.opts.ha_guard_interval_ms / 1000):
            line = self._ha_conflict()
            if line:
                self.guard_error = line
                log.error("stopping: " + line)
                stop.set()
                return

    def activate(self) -> None:
        """Restore state and build the consume loop: at start, or when this instance becomes the leader."""
        opts, codec, extra = self.opts, self._codec, self._extra
        # The cordon ledger always needs the rate-limit window, however short --restore-lookback is.
        lookback = max(opts.restore_lookback_ms, HOUR_MS if self.cordoner is not None else 0)
        if lookback:
            records = ready.retry(  # a fresh topic's leaders may still be moving: wait, do not crash
                lambda: restore_from_topic(opts.bootstrap, self.alerts_topic, codec, lookback, extra),
                what=f"restore of open alerts from {self.alerts_topic}",
                transient=(GpupipeError,),
                timeout_s=opts.startup_timeout_ms / 1000,
                state=self._state,
                stop=self._stop,
            )
            since = self.handler.now_ms() - opts.restore_lookback_ms
            alerts = [r for r in records if opts.restore_lookback_ms and r["emitted_at_ms"] >= since]
            self.handler.restore(alerts, ledger=records)
        if opts.ha:  # the input group moves to the standby as fast as the leader group does
            timeout = opts.ha_session_timeout_ms
            extra = {
                "session.timeout.ms": str(timeout),
                "heartbeat.interval.ms": str(max(500, timeout // 5)),
                **(extra or {}),
            }
        self.loop = ConsumeLoop(
            bootstrap=opts.bootstrap,
            group_id=opts.group_id,
            topics=self.inputs,
            handler=self.handler,
            # samples: only the fields alerts and the contract check read; the rest the codec's
            codec=AlertsDecoder(codec),  # type: ignore[arg-type]
            deadletter_topic=topics.with_prefix(opts.topic_prefix, topics.DEADLETTER),
            service="alerts",
            registry=self.registry,
            extra=extra,
            from_beginning=opts.from_beginning,
            topic_prefix=opts.topic_prefix,
            # An input partition no leader has committed starts where the group's first leader did,
            # at most --restore-lookback back (what the restore can tell already alerted).
            start_ms=None
            if self.elector is None
            else max(self.elector.since_ms, process_start_ms() - opts.restore_lookback_ms),
        )

    def routes(self) -> dict[str, Route]:
        """``/metrics``, and the open alerts as a page and as JSON (behind the same TLS and auth)."""
        return {"/metrics": registry_route(self.registry), **self.page.routes()}

    def role(self) -> str:
        if self.elector is None:
            return "single"
        return "leader" if self.elector.is_leader else "standby"

    def health(self) -> tuple[bool, dict[str, object]]:
        detail: dict[str, object] = {
            "open_alerts": self.handler.open_alerts,
            "instance": self.instance,
            "role": self.role(),
        }
        if self.elector is not None and self.elector.fenced():
            detail["fenced"] = True  # leadership lost: the service is stopping (restarts as a standby)
            return False, detail
        if self.loop is None:  # a standby is healthy while it waits to lead
            return self.elector is not None, detail
        return self.loop.healthy, {**detail, **self.loop.health_detail()}

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set (or the consume loop fails, or leadership is lost), then shut down."""
        opts = self.opts
        if self.elector is not None:
            self.elector.start()
            log.info("standing by for leadership", extra=fields(instance=self.instance))
            while not stop.is_set() and not self.elector.acquired.wait(0.2):
                pass
            if stop.is_set():
                self.elector.stop()
                return
            threading.Thread(
                target=_fence, args=(self.elector, stop), name="alerts-fence", daemon=True
            ).start()
            self.activate()
        else:
            threading.Thread(target=self._guard, args=(stop,), name="alerts-ha-guard", daemon=True).start()
        assert self.loop is not None
        if self.alertmanager is not None:
            self.alertmanager.start()
        if self.cordoner is not None:
            self.cordoner.start()
        ticker = threading.Thread(
            target=_tick_loop, args=(self.handler, stop), name="alerts-tick", daemon=True
        )
        ticker.start()
        log.info(
            "alerts service started",
            extra=fields(
                input=self.inputs,
                output=self.alerts_topic,
                instance=self.instance,
                alertmanager=opts.alertmanager_urls,
                cordon="dry-run" if opts.dry_run else ("on" if opts.cordon else "off"),
                dedupe_window_ms=opts.engine.dedupe_window_ms,
                resolve_after_ms=opts.engine.resolve_after_ms,
            ),
        )
        try:
            self.loop.run(stop)
        finally:
            stop.set()
            ticker.join(10)
            if self.cordoner is not None:
                self.cordoner.stop()
            try:
                if self.elector is not None and self.elector.fenced():
                    # fenced: the new leader owns the alerts now; publishing here would contradict it
                    log.warning("leadership lost: pending revisions left to the new leader")
                else:
                    self.handler.flush()
            finally:
                if self.alertmanager is not None:
                    self.alertmanager.stop()
                if self.elector is not None:
                    self.elector.stop()
        log.info("alerts service stopped", extra=fields(records=self.handler.records_out))


def _fence(elector: LeaderElector, stop: threading.Event) -> None:
    """Stop the service as soon as leadership is lost: never two publishers (see leader module)."""
    while not stop.is_set():
        if elector.lost.wait(0.2) or elector.fenced():
            stop.set()
            return


def _tick_loop(handler: AlertsHandler, stop: threading.Event, interval_s: float = 1.0) -> None:
    while not stop.wait(interval_s):
        try:
            handler.tick()
        except Exception:
            log.exception("alerts tick failed")
            stop.set()
