"""The node agent's own metrics read at scrape time (plain ints on the hot paths, no locks).

Everything the agent cannot open or had to degrade is visible here, next to a log line: the
kernel log (``input_errors{input="kmsg",reason}``), the kubelet (``source_up``), the spool
(``xid_spool_on_disk``, ``xid_spool_write_errors``), a stalled collection (``nvml_stalled_gpus``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class AgentCollector(Collector):
    def __init__(self, agent: Any) -> None:
        """``agent``: the :class:`~gpupipe_producer.agent.node_agent.NodeAgent` (it imports this module)."""
        self._a = agent

    def collect(self) -> Iterator[Any]:
        a = self._a
        yield from _kernel_log(a)
        yield from _xids(a)
        yield from _gpus(a)
        yield from _nvml_events(a)
        yield from _nvml_session(a)
        yield from _kubelet(a)
        yield from _inputs_up(a)


def _kernel_log(a: Any) -> Iterator[Any]:
    """The kernel-log reader and its cursor."""
    st = a.kmsg_stats()
    kin = a.kmsg_input
    yield CounterMetricFamily(
        "gpupipe_producer_kmsg_lines", "Kernel-log lines read.", value=st.get("lines", 0)
    )
    yield CounterMetricFamily(
        "gpupipe_producer_kmsg_malformed_lines",
        "Kernel-log lines that looked like an Xid report, or kmsg records, that did not parse.",
        value=(kin.malformed if kin else 0) + st.get("malformed", 0),
    )
    yield CounterMetricFamily(
        "gpupipe_producer_kmsg_overruns",
        "Times /dev/kmsg overwrote records before the agent read them.",
        value=st.get("overrun", 0),
    )
    yield CounterMetricFamily(
        "gpupipe_producer_kmsg_skipped_records",
        "Kernel-log records skipped at start because the persisted cursor had handled them.",
        value=st.get("skipped", 0),
    )
    errs = CounterMetricFamily(
        "gpupipe_producer_input_errors",
        "Inputs the agent could not open or read, by input and reason (errno name).",
        labels=["input", "reason"],
    )
    if kin is not None:
        for reason, n in sorted(kin.errors.items()):
            errs.add_metric(["kmsg", reason], n)
    if a.cursor is not None and a.cursor.errors:
        errs.add_metric(["kmsg_cursor", "write"], a.cursor.errors)
    yield errs


def _xids(a: Any) -> Iterator[Any]:
    """The XID path: merging, the spool, records that did not encode."""
    yield CounterMetricFamily(
        "gpupipe_producer_xid_merged",
        "XIDs seen by both NVML and the kernel log and sent as one event.",
        value=a.xid_merged,
    )
    spool = a.sender.spool if a.sender is not None else None
    yield CounterMetricFamily(
        "gpupipe_producer_xid_spool_dropped",
        "XID events dropped because the spool exceeded --spool-max-bytes (oldest first).",
        value=spool.dropped if spool is not None else 0,
    )
    yield CounterMetricFamily(
        "gpupipe_producer_xid_spool_damaged",
        "Damaged spool records skipped at load (bad checksum or garbage); never replayed.",
        value=(spool.damaged + spool.torn) if spool is not None else 0,
    )
    yield CounterMetricFamily(
        "gpupipe_producer_xid_spool_write_errors",
        "Failed spool disk operations (unwritable directory, full disk); events kept in memory.",
        value=spool.write_errors if spool is not None else 0,
    )
    yield GaugeMetricFamily(
        "gpupipe_producer_xid_spool_on_disk",
        "1 when XIDs are spooled to disk, 0 while they are kept in memory only.",
        value=1 if spool is not None and spool.on_disk else 0,
    )
    yield CounterMetricFamily(
        "gpupipe_producer_encode_errors",
        "Records that did not match their schema.",
        value=a.encode_errors,
    )


def _gpus(a: Any) -> Iterator[Any]:
    """The GPUs as NVML sees them, and the calls it refused."""
    yield GaugeMetricFamily(
        "gpupipe_producer_nvml_stalled_gpus",
        "GPUs whose NVML calls did not return within --nvml-timeout (left out until they do).",
        value=a.stalled_gpus(),
    )
    gpus = GaugeMetricFamily(
        "gpupipe_producer_gpus",
        "GPUs of this node by state: ok, lost (NVML says GPU_IS_LOST), unusable (NVML could not "
        "open it at start). No GPU at all makes /healthz unhealthy.",
        labels=["state"],
    )
    src = a.source
    if src is not None:
        known, lost = len(src.gpus()), len(src.lost_gpus)
        gpus.add_metric(["ok"], known - lost)
        gpus.add_metric(["lost"], lost)
        gpus.add_metric(["unusable"], src.unusable_gpus)
    yield gpus
    learned = GaugeMetricFamily(
        "gpupipe_producer_nvml_learned",
        "NVML calls not asked now, by call and reason: device contexts (GPUs, MIG slices) where "
        "NVML refused them. NotSupported/InvalidArgument/BindingMissing are the hardware or the "
        "binding (for good); NoPermission, FunctionNotFound and the version mismatches are the "
        "agent's rights or the driver, asked again every few minutes.",
        labels=["call", "reason"],
    )
    if src is not None:
        for (call, reason), n in sorted(src.learned().items()):
            learned.add_metric([call, reason], n)
    yield learned


def _nvml_events(a: Any) -> Iterator[Any]:
    """The NVML XID event sets, per GPU state."""
    ev = GaugeMetricFamily(
        "gpupipe_producer_nvml_event_gpus",
        "GPUs by the state of their NVML XID event set: watching, failing (backing off; the "
        "others are read meanwhile), unsupported (the kernel log still reports their XIDs), "
        "stuck (a stopped watcher's wait has not returned from NVML: NVML cannot be released "
        "until it does) or dead (the thread failed: /healthz unhealthy).",
        labels=["state"],
    )
    w = a.watcher
    if w is not None:
        failing = w.failing
        ev.add_metric(["watching"], len([i for i in w.registered if i not in failing]))
        ev.add_metric(["failing"], len(failing))
        ev.add_metric(["unsupported"], len(w.unsupported))
        ev.add_metric(["stuck"], len(w.stuck))
        ev.add_metric(["dead"], len(w.dead))
    yield ev


def _nvml_session(a: Any) -> Iterator[Any]:
    """The NVML session: released, postponed, initialised again."""
    ctl = a.control
    yield GaugeMetricFamily(
        "gpupipe_producer_nvml_released",
        "1 while the agent holds no NVML session: released on request (--nvml-release-file) or "
        "NVML cannot be initialised again. No GPU telemetry meanwhile; /readyz answers 503.",
        value=1 if ctl is not None and ctl.released is not None else 0,
    )
    yield GaugeMetricFamily(
        "gpupipe_producer_nvml_release_pending",
        "1 while the release file asks for NVML to be let go but the agent cannot yet (a GPU call "
        "or an event wait has not returned; see nvml_let_go_postponed). NVML is still held.",
        value=1 if ctl is not None and ctl.release_pending is not None else 0,
    )
    postponed = CounterMetricFamily(
        "gpupipe_producer_nvml_let_go_postponed",
        "Ticks at which a release or re-initialisation of NVML was postponed, by reason: "
        "gpu_call_in_flight (a GPU's NVML call has not returned), event_wait_stuck (an NVML "
        "event wait has not returned). Retried every tick.",
        labels=["reason"],
    )
    if ctl is not None:
        for reason, n in sorted(ctl.postponed.items()):
            postponed.add_metric([reason], n)
    yield postponed
    reinits = CounterMetricFamily(
        "gpupipe_producer_nvml_reinits",
        "NVML sessions ended and begun again, by reason: gpu_lost (to see a reset GPU again), "
        "request (the release file).",
        labels=["reason"],
    )
    failures = CounterMetricFamily(
        "gpupipe_producer_nvml_reinit_failures",
        "Attempts to initialise NVML again that failed, by NVML error "
        "(NVMLError_LibRmVersionMismatch: the driver changed, a restart is needed).",
        labels=["error"],
    )
    if ctl is not None:
        for reason, n in sorted(ctl.reinits.items()):
            reinits.add_metric([reason], n)
        for err, n in sorted(ctl.resume_failures.items()):
            failures.add_metric([err], n)
    yield reinits
    yield failures


def _kubelet(a: Any) -> Iterator[Any]:
    """The kubelet attribution map."""
    amap = a.allocations
    yield GaugeMetricFamily(
        "gpupipe_producer_kubelet_map_stale",
        "1 while samples carry the last good kubelet attribution after failed Lists (grace period).",
        value=1 if a.kubelet_map_stale else 0,
    )
    yield GaugeMetricFamily(
        "gpupipe_producer_kubelet_dra_unresolved",
        "gpu.nvidia.com DRA devices in the last List that match no GPU of this node (e.g. MIG).",
        value=a.dra_unresolved(amap),
    )
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


def _inputs_up(a: Any) -> Iterator[Any]:
    """The inputs that work now."""
    kin = a.kmsg_input
    up = GaugeMetricFamily(
        "gpupipe_producer_source_up", "1 when an input of the agent works.", labels=["input"]
    )
    up.add_metric(["kubelet"], 1 if a.refresher is not None and a.refresher.healthy else 0)
    up.add_metric(["nvml_events"], 1 if a.watcher is not None and a.watcher.running else 0)
    up.add_metric(["kmsg"], 1 if kin is not None and kin.reading and a.kmsg_alive() else 0)
    yield up
