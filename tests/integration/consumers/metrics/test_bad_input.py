"""Bad input to `gpupipe metrics` on a real broker: dead letters with reasons, counted; absurd values.

Undecodable bytes, unknown schemas and records of the wrong type for their topic, on both input
topics, land on gpu.deadletter.v1 with the original bytes and the reason in headers, and are
counted in /metrics; the service goes on serving the good records around them. A sample with
readings beyond the contract's bounds (NaN, infinity, negative utilisation) is dead-lettered
whole; one with odd values the contract allows (huge counters, a negative retry count) never
breaks the exposition.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import pytest

from gpupipe_consumers.metrics.service import MetricsConfig, MetricsService
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from tests.integration.kafka_util import read_all
from tests.integration.metrics_helpers import (
    CraftedProducer,
    http_get,
    parse_exposition,
    promtool_check,
    wait_for,
)

pytestmark = pytest.mark.integration

OUT_OF_RANGE_XIDS = 2  # XID codes outside 0-65535: dead-lettered by the XID reader's contract check
OUT_OF_RANGES = OUT_OF_RANGE_XIDS + 1  # and a sample with readings beyond the contract's bounds


def test_dead_letters_and_absurd_values(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    samples_topic = topic_prefix + "gpu.samples.v1"
    xid_topic = topic_prefix + "gpu.xid.v1"
    dlq_topic = topic_prefix + "gpu.deadletter.v1"
    svc = MetricsService(
        MetricsConfig(
            bootstrap=kafka,
            topic_prefix=topic_prefix,
            group_id=f"metrics-{uuid.uuid4().hex[:8]}",
            host="127.0.0.1",
            port=0,
            from_beginning=True,  # "latest" is resolved after assignment: records sent now could be skipped
        )
    ).start()
    try:
        wait_for(lambda: svc.health()[0] and svc.handler.assigned, 60, "the service to be assigned")
        wait_for(lambda: svc.handler.samples_partitions, 30, "the XID reader to know the samples topic")
        now_ms = int(time.time() * 1000)
        recs, xids = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=4, xid_rate_per_gpu_hour=1e9)).tick(
            now_ms
        )
        good, absurd, odd, later = ({**r, "mig": None} for r in recs[:4])
        tag = uuid.uuid4().hex[:8]
        for rec, c in ((good, "good"), (absurd, "absurd"), (odd, "odd"), (later, "later")):
            rec["uuid"] = f"GPU-{tag}-{c}"
        absurd.update(  # beyond the contract's bounds: the whole sample is dead-lettered
            power_w=float("nan"),
            gpu_util_ratio=-0.5,
            mem_copy_util_ratio=7.5,
            tensor_active_ratio=float("inf"),
            sm_active_ratio=float("-inf"),
            fb_used_bytes=-1,
        )
        odd.update(  # within the contract, odd for the exposition: served, the odd reading left out
            gpu_temp_c=-40,
            total_energy_mj=2**62,
            sm_clock_mhz=2**31 - 1,
            pcie_replay_count=-3,
        )
        codec = AvroCodec()
        xid_bytes = codec.encoder("XidEvent").encode({**xids[0], "uuid": good["uuid"]})
        sample_bytes = codec.encoder("GpuSample").encode(good)
        out = CraftedProducer(kafka)
        out.sample(samples_topic, good)
        bad_samples = [  # (value, key, reason)
            (b"definitely not avro", b"k1", "not-gpupipe-avro"),
            (b"\xc3\x01" + bytes(8) + b"body", b"k2", "unknown-schema-fingerprint"),
            (b"\x00\x00\x00\x00\x07body", b"k3", "confluent-framing-without-registry"),
            (sample_bytes[:14], good["uuid"].encode(), "corrupt-avro-body"),
            (None, b"k5", "empty-payload"),
            (xid_bytes, good["uuid"].encode(), "unexpected-record-type"),
        ]
        for value, key, _ in bad_samples:
            out.raw(samples_topic, value, key)
        out.sample(samples_topic, absurd)
        out.sample(samples_topic, odd)
        out.sample(samples_topic, later)
        # on the XID topic: garbage, a sample, and events with odd values that must not break anything
        bad_xids = [
            (b"\xc3\x01garbage!", b"kx1", "unknown-schema-fingerprint"),
            (sample_bytes, good["uuid"].encode(), "unexpected-record-type"),
        ]
        for value, key, _ in bad_xids:
            out.raw(xid_topic, value, key)
        for i, (code, kind) in enumerate(
            [(-5, "xid"), (None, "xid"), (79, "sxid"), (0, "xid"), (2**31 - 1, "xid")]
        ):
            out.xid(
                xid_topic,
                {**xids[0], "uuid": good["uuid"], "xid": code, "kind": kind, "event_id": f"{tag}/{i}"},
            )
        out.flush()

        def all_there() -> str | None:
            text = http_get(svc.url + "/metrics").decode()
            uuids = {lab.get("UUID") for n, lab, _ in parse_exposition(text) if n == "DCGM_FI_DEV_GPU_TEMP"}
            dead = [v for n, _, v in parse_exposition(text) if n == "gpupipe_consumer_dead_letters_total"]
            want = {good["uuid"], odd["uuid"], later["uuid"]}
            if want <= uuids and sum(dead) == len(bad_samples) + len(bad_xids) + OUT_OF_RANGES:
                return text
            state["last"] = (sorted(want - uuids), dead, svc.handler.xid_results, svc.health())
            return None

        state: dict[str, object] = {}

        text = wait_for(
            all_there, 30, lambda: f"good records served and every bad record dead-lettered: {state}"
        )
        assert svc.health()[0], svc.health()

        # -- dead letters: original bytes and key, reason in the headers -------------------------
        dead = read_all(
            kafka, dlq_topic, expect=len(bad_samples) + len(bad_xids) + OUT_OF_RANGES, timeout_s=30
        )
        got = sorted(
            (
                dict(m.headers())["gpupipe.dlq.topic"].decode(),
                dict(m.headers())["gpupipe.dlq.reason"].decode(),
            )
            for m in dead
        )
        want = sorted(
            [(samples_topic, r) for _, _, r in bad_samples]
            + [(xid_topic, r) for _, _, r in bad_xids]
            + [(xid_topic, "out-of-range")] * OUT_OF_RANGE_XIDS  # codes -5 and 2**31-1
            + [(samples_topic, "out-of-range")]  # the absurd sample
        )
        assert got == want
        by_key = {m.key(): m for m in dead}
        assert by_key[b"k1"].value() == b"definitely not avro"
        assert by_key[b"k5"].value() is None
        h = dict(by_key[b"k1"].headers())
        assert h["gpupipe.dlq.service"] == b"metrics" and h["gpupipe.dlq.partition"].isdigit()

        # -- counted ------------------------------------------------------------------------------
        samples = parse_exposition(text)
        errors = {
            (lab["topic"], lab["reason"]): v
            for n, lab, v in samples
            if n == "gpupipe_consumer_decode_errors_total"
        }
        for topic, items in ((samples_topic, bad_samples), (xid_topic, bad_xids)):
            for _, _, reason in items:
                assert errors.get((topic, reason)) == 1.0, (topic, reason, errors)
        assert errors.get((xid_topic, "out-of-range")) == OUT_OF_RANGE_XIDS, errors
        assert errors.get((samples_topic, "out-of-range")) == 1.0, errors

        # -- absurd values: the sample refused; odd ones left out and counted, the GPU served ---------
        def series(name: str, uid: str) -> list[float]:
            return [v for n, lab, v in samples if n == name and lab.get("UUID") == uid]

        assert not [lab for _, lab, _ in samples if lab.get("UUID") == absurd["uuid"]]
        assert series("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", odd["uuid"]) == []  # negative
        assert series("DCGM_FI_DEV_GPU_TEMP", odd["uuid"]) == [-40.0]
        assert series("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", odd["uuid"]) == [float(2**62)]
        assert all(math.isfinite(v) for _, _, v in samples)
        invalid = {
            (lab["field"], lab["reason"])
            for n, lab, _ in samples
            if n == "gpupipe_metrics_invalid_values_total"
        }
        assert ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "negative") in invalid, invalid
        assert promtool_check(text.encode()) == []

        # odd XID events were taken (or ignored) without harm; the GPU's counter shows the real ones
        xid_lines = [(lab["xid"], v) for n, lab, v in samples if n == "DCGM_EXP_XID_ERRORS_TOTAL"]
        assert ("0", 1.0) not in xid_lines
        assert not {"-5", str(2**31 - 1)} & {code for code, _ in xid_lines}, xid_lines
        assert svc.handler.xid_results["applied"] >= 1
    finally:
        svc.stop()
    assert not svc._loop_thread.is_alive()
