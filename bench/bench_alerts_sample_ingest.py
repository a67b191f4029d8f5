"""Benchmark: sample ingest in the alerts service, decode to health state, per sample.

Run: ``.venv/bin/python bench/bench_alerts_sample_ingest.py`` (about 20 seconds; no broker).

The alerts service reads every GpuSample of the fleet for its health signals. The input: 30 s of a
simulated fleet of 512 GPUs at 1 s (15,360 samples, encoded once; a sample's bytes as they sit
in Kafka). Each leg runs in this process on the same records, best of three:

* **ingest** (what the service does per sample after ``consume()``): the service's decoder
  (:class:`~gpupipe_consumers.alerts.sample_decode.AlertsDecoder`), the consume loop's contract
  check (:func:`~gpupipe_schemas.validate.violation`) and
  :meth:`~gpupipe_consumers.alerts.handler.AlertsHandler.handle` in batches of 500, as the loop
  calls it;
* **codec ingest**: the same with the shared codec's decode (the service's path before it decoded
  only what it reads);
* **codec decode**: the shared codec's decode alone, the floor the review measured (56 us).

``alerts_sample_ingest``: ratio = codec decode time / ingest time, the same records side by side.
Target 0.75: a whole sample's ingest -- decode, contract check and health state -- costs at most
4/3 of what decoding it with the shared codec alone costs (measured 0.89-1.01 on a shared 2-core VM;
the codec's path, as before this decoder, reads 0.58-0.64). Figures: us per sample of each leg.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import figure, ratio_line

from gpupipe_consumers.alerts.handler import AlertsHandler
from gpupipe_consumers.alerts.sample_decode import AlertsDecoder
from gpupipe_consumers.plumbing.consume_loop import InRecord
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.validate import violation

NODES, GPUS_PER_NODE, SECONDS = 64, 8, 30
BATCH = 500
START_MS = 1_790_000_000_000
TARGET = 0.75


class _Sink:
    def send(self, record: dict) -> None:
        return None

    def flush(self, timeout_s: float = 30.0) -> None:
        return None


def payloads(codec: AvroCodec) -> list[bytes]:
    fleet = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS_PER_NODE, seed=7))
    enc = codec.encoder("GpuSample").encode
    out = []
    for s in range(SECONDS):
        samples, _ = fleet.tick(START_MS + s * 1000)
        out.extend(enc(r) for r in samples)
    return out


def ingest_s(decode, raw: list[bytes]) -> float:
    """Seconds to take ``raw`` through ``decode``, the loop's check and a fresh service."""
    now = START_MS + SECONDS * 1000
    svc = AlertsHandler(sink=_Sink(), clock=lambda: now / 1000)
    began = time.perf_counter()
    batch: list[InRecord] = []
    for i, payload in enumerate(raw):
        d = decode(payload)
        if violation(d.name, d.record, now, now) is not None:
            raise SystemExit(f"sample {i} refused")
        batch.append(InRecord("gpu.samples.v1", 0, i, None, d.name, d.record, now, None))
        if len(batch) == BATCH:
            svc.handle(batch)
            batch = []
    if batch:
        svc.handle(batch)
    return time.perf_counter() - began


def decode_s(decode, raw: list[bytes]) -> float:
    began = time.perf_counter()
    for payload in raw:
        decode(payload)
    return time.perf_counter() - began


def main() -> None:
    logging.disable(logging.WARNING)
    codec = AvroCodec()
    raw = payloads(codec)
    fast = AlertsDecoder(codec)
    ours = min(ingest_s(fast.decode, raw) for _ in range(3))
    before = min(ingest_s(codec.decode, raw) for _ in range(3))
    floor = min(decode_s(codec.decode, raw) for _ in range(3))
    n = len(raw)
    figure("samples", n)
    figure("ingest_us_per_sample", ours / n * 1e6, "us")
    figure("codec_ingest_us_per_sample", before / n * 1e6, "us")
    figure("codec_decode_us_per_sample", floor / n * 1e6, "us")
    figure("fast_decode_us_per_sample", min(decode_s(fast.decode, raw) for _ in range(3)) / n * 1e6, "us")
    ratio_line("alerts_sample_ingest", floor / ours, TARGET)


if __name__ == "__main__":
    main()
