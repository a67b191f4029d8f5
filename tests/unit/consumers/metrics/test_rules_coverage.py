"""Every metric a shipped Prometheus rule reads is in the default exposition of the service that
exports it: `gpupipe chargeback`'s own /metrics for ``gpupipe_chargeback_*``, `gpupipe alerts`'s for
``gpupipe_alerts_*``, `gpupipe metrics` for the rest (a newer generation's name of a renamed field:
under the ``--dialect`` of that generation).

Before: four rules (ECC DBE, row remap pending, recovery action, thermal throttling) read metrics the
default counters CSV left commented out, so they could never fire in the shipped deployment.
"""

from __future__ import annotations

import re

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from gpupipe_consumers.chargeback.service import ChargebackService, ServiceConfig
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine
from gpupipe_consumers.metrics import dialect
from gpupipe_consumers.metrics.collectors_csv import default_counters, in_dialect
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas.codec import AvroCodec
from tests.paths import REPO
from tests.unit.consumers.metrics.test_store import T_MS, blank, xid

RULES = sorted((REPO / "deploy" / "prometheus").glob("*.rules.yml"))
NAME = re.compile(r"\b(DCGM_[A-Z0-9_]+|gpupipe_[a-z0-9_]+)\b")


def rule_metrics() -> set[str]:
    names: set[str] = set()
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                names |= set(NAME.findall(rule["expr"]))
    return names


def full_sample() -> dict:
    """A whole GPU with every field reported (the worst case for "is the family there")."""
    rec = blank(
        gpu_util_ratio=0.5,
        mem_copy_util_ratio=0.2,
        fb_total_bytes=80 << 30,
        fb_free_bytes=40 << 30,
        fb_used_bytes=40 << 30,
        fb_reserved_bytes=1 << 30,
        power_w=300.0,
        power_limit_w=700.0,
        total_energy_mj=1,
        memory_temp_c=40.0,
        sm_clock_mhz=1980,
        mem_clock_mhz=2619,
        clock_event_reasons=0x40,
        pcie_tx_bytes_per_s=1.0,
        pcie_rx_bytes_per_s=1.0,
        pcie_replay_count=0,
        nvlink_bandwidth_total_kib=1,
        vgpu_license_status=0,
        ecc_dbe_volatile_total=0,
        remapped_rows_correctable=0,
        remapped_rows_uncorrectable=0,
        row_remap_pending=False,
        row_remap_failure=False,
        gpu_recovery_action=0,
    )
    for k in ("enc_util_ratio", "dec_util_ratio", "gr_engine_active_ratio", "tensor_active_ratio"):
        rec[k] = 0.1
    return rec


def test_rules_read_metrics() -> None:
    names = rule_metrics()
    assert RULES and "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in names and "gpupipe_sample_age_seconds" in names


def chargeback_exposition() -> str:
    """The /metrics text of a chargeback service as built by default (no partition assigned yet:
    per-partition families are there, without samples)."""
    svc = ChargebackService(
        ServiceConfig(bootstrap="unused", input_topic="in", output_topic="out", deadletter_topic="dlq"),
        build_engine(ChargebackSettings(), None, "svc"),  # type: ignore[arg-type]
        AvroCodec(),
        consumer_factory=lambda conf: None,
        producer_factory=lambda conf: None,
    )
    return generate_latest(svc.registry).decode()


def test_rules_read_chargeback_metrics() -> None:
    """Replay, commit and restart alerts are on chargeback's own series."""
    assert {
        "gpupipe_chargeback_replay_remaining_records",
        "gpupipe_chargeback_last_commit_timestamp_seconds",
        "gpupipe_chargeback_start_time_seconds",
    } <= rule_metrics()


def family(text: str, metric: str) -> bool:
    """``metric`` is a family of ``text``, or a counter's sample of one (``_total``)."""
    if f"# TYPE {metric} " in text:
        return True
    return metric.endswith("_total") and f"# TYPE {metric.removesuffix('_total')} counter" in text


@pytest.mark.parametrize("metric", sorted(rule_metrics()))
def test_rule_metric_is_in_the_default_exposition(metric: str) -> None:
    if metric.startswith("gpupipe_alerts_"):
        reg = CollectorRegistry()
        AlertsHandler(sink=ListSink(), registry=reg)
        assert family(generate_latest(reg).decode(), metric), (
            f"{metric} is read by a shipped rule but not in the alerts service's default exposition"
        )
        return
    if metric.startswith("gpupipe_chargeback_"):
        text = chargeback_exposition()
        assert f"# TYPE {metric} " in text, (
            f"{metric} is read by a shipped rule but not in chargeback's default exposition"
        )
        return
    newer = [r.since for r in dialect.RENAMES if r.new == metric]
    which = newer[0] if newer else dialect.DEFAULT_DIALECT
    store = SeriesStore(in_dialect(default_counters(), which))  # the shipped default counters
    store.apply_sample(full_sample(), 0, T_MS / 1000)
    store.apply_xid(xid(79), 0, T_MS / 1000)
    text = store.render(T_MS / 1000).decode()
    assert f"# TYPE {metric} " in text, (
        f"{metric} is read by a shipped rule but not in the default exposition of --dialect {which}"
    )
