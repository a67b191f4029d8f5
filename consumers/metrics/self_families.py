"""The store's own families and the service registry's, as exposition text (pure).

Written at every scrape after the GPUs' families: ``gpupipe_sample_age_seconds`` per GPU, the
input's freshness (``gpupipe_metrics_node_last_sample_age_seconds`` per node and
``gpupipe_metrics_pipeline_delay_seconds``: a late pipeline holds series rather than expiring
them, so the rules need these to see it), the store's counters (GPUs, invalid values, expiries,
XID outcomes, GPU keys dropped at the cap), the unsupported counters-CSV
rows, and the ``prometheus_client`` registry's families minus any whose name is one of ours, so
no family appears twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpupipe_consumers.metrics.collectors_csv import CounterSet
from gpupipe_consumers.metrics.labels import SAMPLE_AGE_METRIC
from gpupipe_consumers.metrics.textfmt import escape_label_value

GPUS_METRIC = "gpupipe_metrics_gpus"
INVALID_METRIC = "gpupipe_metrics_invalid_values_total"
EXPIRED_METRIC = "gpupipe_metrics_expired_total"
XID_EVENTS_METRIC = "gpupipe_metrics_xid_events_total"
UNSUPPORTED_METRIC = "gpupipe_metrics_unsupported_fields"
HEALTH_NOT_RUN_METRIC = "gpupipe_metrics_health_watch_not_run"
NODE_AGE_METRIC = "gpupipe_metrics_node_last_sample_age_seconds"
PIPELINE_DELAY_METRIC = "gpupipe_metrics_pipeline_delay_seconds"
DROPPED_METRIC = "gpupipe_metrics_gpus_dropped_total"
OWN_METRICS = (
    SAMPLE_AGE_METRIC,
    NODE_AGE_METRIC,
    PIPELINE_DELAY_METRIC,
    DROPPED_METRIC,
    GPUS_METRIC,
    INVALID_METRIC,
    EXPIRED_METRIC,
    XID_EVENTS_METRIC,
    UNSUPPORTED_METRIC,
    HEALTH_NOT_RUN_METRIC,
)


def own_text(
    now: float,
    ages: list[tuple[bytes, int]],
    ngpus: int,
    invalid: list[tuple[tuple[str, str], int]],
    xid_results: list[tuple[str, int]],
    expired: int,
    unsupported: str,
    *,
    nodes: Sequence[tuple[str, int]] = (),
    node_label: str = "Hostname",
    progress_s: float | None = None,
    dropped: Sequence[tuple[str, int]] = (),
) -> bytes:
    """The store's families; ``ages``: (label head, sample time in ms) per GPU; ``nodes``: (node,
    newest sample time in ms of its GPUs); ``progress_s``: ingest time of the newest sample (None
    while no GPU is sampled); ``dropped``: GPU keys refused at the cap, per kind."""
    out: list[bytes] = []
    if ages:
        out.append(
            f"# HELP {SAMPLE_AGE_METRIC} Seconds from the GPU's latest sample time to this scrape.\n"
            f"# TYPE {SAMPLE_AGE_METRIC} gauge\n".encode()
        )
        out.extend(b"%s%.3f\n" % (head, now - ts / 1000.0) for head, ts in ages)
    if nodes:
        out.append(
            f"# HELP {NODE_AGE_METRIC} Seconds from the newest sample time of the node's GPUs to this "
            f"scrape: all nodes old together is a late pipeline, one alone is that node.\n"
            f"# TYPE {NODE_AGE_METRIC} gauge\n".encode()
        )
        out.append(
            "".join(
                f'{NODE_AGE_METRIC}{{{node_label}="{escape_label_value(host)}"}} {now - ts / 1000.0:.3f}\n'
                for host, ts in nodes
            ).encode("utf-8")
        )
    if progress_s is not None:
        out.append(
            f"# HELP {PIPELINE_DELAY_METRIC} Seconds since the newest sample was ingested: grows while "
            f"Kafka, the producers' link or this consumer is stalled (series are then held, not expired).\n"
            f"# TYPE {PIPELINE_DELAY_METRIC} gauge\n"
            f"{PIPELINE_DELAY_METRIC} {max(0.0, now - progress_s):.3f}\n".encode()
        )
    text = [
        f"# HELP {GPUS_METRIC} GPUs and MIG slices with series in this exposition.\n"
        f"# TYPE {GPUS_METRIC} gauge\n{GPUS_METRIC} {ngpus}\n"
        f"# HELP {INVALID_METRIC} Sample values left out: NaN, infinite, negative or not a number.\n"
        f"# TYPE {INVALID_METRIC} counter\n"
    ]
    text.extend(
        f'{INVALID_METRIC}{{field="{escape_label_value(f)}",reason="{reason}"}} {n}\n'
        for (f, reason), n in invalid
    )
    text.append(
        f"# HELP {EXPIRED_METRIC} GPUs removed because no sample came within the staleness limit.\n"
        f"# TYPE {EXPIRED_METRIC} counter\n{EXPIRED_METRIC} {expired}\n"
        f"# HELP {XID_EVENTS_METRIC} gpu.xid events by outcome (ignored: SXid, GPU lost, XID 0...).\n"
        f"# TYPE {XID_EVENTS_METRIC} counter\n"
    )
    text.extend(f'{XID_EVENTS_METRIC}{{result="{res}"}} {n}\n' for res, n in xid_results)
    if dropped:
        text.append(
            f"# HELP {DROPPED_METRIC} New GPU keys not stored because --max-gpus were held, by record kind.\n"
            f"# TYPE {DROPPED_METRIC} counter\n"
        )
        text.extend(f'{DROPPED_METRIC}{{kind="{kind}"}} {n}\n' for kind, n in dropped)
    text.append(unsupported)
    out.append("".join(text).encode("utf-8"))
    return b"".join(out)


def registry_text(registry: Any, own: frozenset[str]) -> str:
    """A prometheus_client registry's exposition without the families named in ``own``."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode("utf-8")
    out = []
    skip = False
    for line in text.splitlines(keepends=True):
        if line.startswith(("# HELP ", "# TYPE ")):
            skip = line.split(" ", 3)[2] in own
        if not skip:
            out.append(line)
    return "".join(out)


def health_not_run_text(watches: Sequence[str]) -> str:
    """The DCGM health watches DCGM_EXP_GPU_HEALTH_STATUS has no series for: no check of them runs
    here, and a missing series must not be read as a pass or as a lost GPU."""
    if not watches:
        return ""
    head = (
        f"# HELP {HEALTH_NOT_RUN_METRIC} DCGM health watches not run here (no series in "
        f"DCGM_EXP_GPU_HEALTH_STATUS): GpuSample carries no signal for them.\n"
        f"# TYPE {HEALTH_NOT_RUN_METRIC} gauge\n"
    )
    return head + "".join(f'{HEALTH_NOT_RUN_METRIC}{{health_watch="{w}"}} 1\n' for w in watches)


def unsupported_text(counters: CounterSet) -> str:
    """The info metric listing counters-CSV rows the service cannot serve (empty when none)."""
    if not counters.unsupported:
        return ""
    head = (
        f"# HELP {UNSUPPORTED_METRIC} Counters-CSV rows this service cannot serve (left out; see the log).\n"
        f"# TYPE {UNSUPPORTED_METRIC} gauge\n"
    )
    return head + "".join(
        f'{UNSUPPORTED_METRIC}{{field="{escape_label_value(u.name)}",line="{u.line}",'
        f'reason="{escape_label_value(u.reason)}"}} 1\n'
        for u in counters.unsupported
    )
