"""On a real broker: the FOCUS export bills a record by when it was written (its Kafka
timestamp), so one written after its month was invoiced is in the next month's export as a
correction of its charge period, and re-running the invoiced month gives the same month. Through
both report paths: by namespace, and the workload path (``--by namespace,owner``).

The records are ChargebackWindow records as chargeback writes them, with the Kafka timestamps of a
chargeback that fell three days behind at the end of October (an outage): its ``emitted_at_ms``
(the input partition's event-time watermark) still says 31 October.
"""

from __future__ import annotations

import csv
import io

import pytest
from confluent_kafka import Producer

from gpupipe.domain.prices import PriceTable
from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_consumers.chargeback.records import CORRECTION, WINDOW, GpuTimeAggregate, to_record
from gpupipe_consumers.chargeback.windows import record_id
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import gpupipe

pytestmark = pytest.mark.integration

H, DAY = 3_600_000, 86_400_000
OCT = 1_790_812_800_000  # 2026-10-01T00:00:00Z
NOV = OCT + 31 * DAY
PRICES = PriceTable(energy_per_kwh=0.1, exact={"nvidia h200": 4.0})


def record(ws: int, ns: str, gpu_s: float, emitted: int, kind: str = WINDOW) -> dict:
    agg = GpuTimeAggregate()
    agg.allocated_s, agg.used_s, agg.energy_j, agg.samples = gpu_s, gpu_s / 2, gpu_s * 300.0, 1
    key = (ws, ns, "node-1", "NVIDIA H200")
    rec = to_record(
        key, agg, kind=kind, window_ms=H, prices=PRICES, partition=0, instance_id="t", emitted_at_ms=emitted
    )
    rec["record_id"] = record_id(kind, 0, key, "0" if kind == WINDOW else f"{ws}-{ws}")
    return rec


# (record, Kafka timestamp: when chargeback wrote it)
WRITTEN = [
    (record(OCT + 10 * DAY, "ml", 3600.0, OCT + 10 * DAY + H + 300_000), OCT + 10 * DAY + H + 301_000),
    # Written on 3 November (October was invoiced on 2 November), watermark of 31 October.
    (record(NOV - 2 * H, "ml", 1800.0, NOV - 50 * 60_000), NOV + 3 * DAY),
    (record(OCT + 20 * DAY, "ml", 360.0, NOV - 40 * 60_000, CORRECTION), NOV + 3 * DAY + 1000),
    (record(NOV + 5 * DAY, "ml", 3600.0, NOV + 5 * DAY + H + 300_000), NOV + 5 * DAY + H + 301_000),
]


def focus(kafka: str, prefix: str, start: str, end: str, *by: str) -> list[dict[str, str]]:
    """The FOCUS export of ``start`` to ``end``; November is not closed (chargeback wrote nothing
    past 2 December in these topics), so its export is provisional."""
    args = ("--format", "focus", "--from", start, "--to", end, *(("--by", by[0]) if by else ()))
    args += ("--provisional",) if start.startswith("2026-11") else ()
    res = gpupipe("report", "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", prefix, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return [ln for ln in csv.DictReader(io.StringIO(res.stdout)) if ln["ConsumedUnit"] == "GPU-Hours"]


@pytest.mark.parametrize("by", [(), ("namespace,owner",)], ids=["namespace", "owner"])
def test_records_written_after_the_invoice_are_billed_in_the_month_written(
    kafka: str, topic_prefix: str, by: tuple[str, ...]
) -> None:
    ensure_topics(kafka, [topics.CHARGEBACK], prefix=topic_prefix)
    enc = AvroCodec().encoder("ChargebackWindow").encode
    p = Producer({"bootstrap.servers": kafka})
    for rec, ts in WRITTEN:
        p.produce(topic_prefix + topics.CHARGEBACK, enc(rec), b"ml/node-1", timestamp=ts)
    assert p.flush(30) == 0

    october = focus(kafka, topic_prefix, "2026-10-01", "2026-11-01", *by)
    november = focus(kafka, topic_prefix, "2026-11-01", "2026-12-01", *by)
    assert [(ln["ChargePeriodStart"], ln["ChargeClass"], ln["ConsumedQuantity"]) for ln in october] == [
        ("2026-10-11T00:00:00Z", "", "1.000000")
    ]
    got = sorted(
        (ln["BillingPeriodStart"], ln["ChargePeriodStart"], ln["ChargeClass"], ln["ConsumedQuantity"])
        for ln in november
    )
    assert got == [
        ("2026-11-01T00:00:00Z", "2026-10-21T00:00:00Z", "Correction", "0.100000"),
        ("2026-11-01T00:00:00Z", "2026-10-31T22:00:00Z", "Correction", "0.500000"),
        ("2026-11-01T00:00:00Z", "2026-11-06T00:00:00Z", "", "1.000000"),
    ]


@pytest.mark.parametrize("by", [(), ("namespace,owner",)], ids=["namespace", "owner"])
def test_a_copy_reemitted_after_the_invoice_is_billed_once(
    kafka: str, topic_prefix: str, by: tuple[str, ...]
) -> None:
    """A reprocess (offset reset) on 2 November re-emits a window of 29 October with its record_id:
    written more than the invoice lag after October ended, so it is "late" for November; the
    November export must read back to the original (before ``--from``) and drop the copy."""
    ensure_topics(kafka, [topics.CHARGEBACK], prefix=topic_prefix)
    enc = AvroCodec().encoder("ChargebackWindow").encode
    ws = NOV - 3 * DAY + 10 * H
    rec = record(ws, "ml", 3600.0, ws + H + 300_000)
    p = Producer({"bootstrap.servers": kafka})
    p.produce(topic_prefix + topics.CHARGEBACK, enc(rec), b"ml/node-1", timestamp=ws + H + 301_000)
    p.produce(topic_prefix + topics.CHARGEBACK, enc(rec), b"ml/node-1", timestamp=NOV + DAY + 9 * H)
    assert p.flush(30) == 0
    october = focus(kafka, topic_prefix, "2026-10-01", "2026-11-01", *by)
    november = focus(kafka, topic_prefix, "2026-11-01", "2026-12-01", *by)
    assert [(ln["ChargePeriodStart"], ln["ConsumedQuantity"]) for ln in october] == [
        ("2026-10-29T10:00:00Z", "1.000000")
    ]
    assert november == []
