"""In-process cost of chargeback's per-sample path, Kafka-free, against our own decoder beside it.

Input: GpuSample payloads of a simulated fleet (10 nodes x 8 GPUs, 10 s interval), encoded in
memory. Measured in this process on the same payloads, best of 3 passes each, interleaved, in
process CPU time (the machine is shared: CPU time leaves out the waits for a core):

* ``path``: ``ChargebackService.process`` (what the service runs per consumed batch: decode, the
  contract check, the age and price-hold checks, window accounting) over batches of 500 in-memory
  messages (a stand-in for confluent-kafka's Message: its accessors cost a few hundred ns in all);
  the transactions are not in it (``bench_chargeback.py`` times those with a broker);
* ``decode``: the service's own decoder alone (:func:`decoder_of`), the floor of the path;
* ``bare``: iterating the same messages and reading their values (the loop's own floor).

Prints ``chargeback_path_us`` (µs per sample), ``chargeback_path_vs_decode`` (decode / path, a
ratio against the floor measured beside it), and ``chargeback_path_budget``: 20 µs / path, an
**absolute budget** (at most 20 µs per sample on the 2-core dev machine), not a ratio
to anything measured here.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

from common import figure, ratio_line

from gpupipe_consumers.chargeback.service import ChargebackService, ServiceConfig
from gpupipe_consumers.chargeback.settings import ChargebackSettings, build_engine, projected_sample_schema
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec

T0 = 1_795_000_000_000
NODES, GPUS, INTERVAL_MS = 10, 8, 10_000
BATCH = 500
BUDGET_US = 20.0  # at most this per sample, on the 2-core dev machine (absolute)
DECODE_SHARE = 6.0 / BUDGET_US  # target: the decoder (about 6 us) is this share of the path at budget


class Msg:
    """What ``process`` reads of a consumed message."""

    __slots__ = ("_o", "_p", "_ts", "_v")

    def __init__(self, partition: int, offset: int, value: bytes, ts: int) -> None:
        self._p, self._o, self._v, self._ts = partition, offset, value, ts

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def value(self) -> bytes:
        return self._v

    def headers(self) -> None:
        return None

    def topic(self) -> str:
        return "in"

    def key(self) -> bytes:
        return b"k"

    def timestamp(self) -> tuple[int, int]:
        return (2, self._ts)  # LogAppendTime, as the samples topic is created


def messages(ticks: int, parts: int = 4) -> list[Msg]:
    """The fleet's samples, tick by tick, spread over ``parts`` partitions by GPU."""
    fleet = SimulatedFleet(FleetConfig(nodes=NODES, gpus_per_node=GPUS, interval_ms=INTERVAL_MS, seed=3))
    enc = AvroCodec().encoder("GpuSample").encode
    offsets = [0] * parts
    out = []
    for k in range(ticks):
        t = T0 + k * INTERVAL_MS
        for i, s in enumerate(fleet.tick(t)[0]):
            p = i % parts
            out.append(Msg(p, offsets[p], enc(s), t + 50))
            offsets[p] += 1
    return out


def service() -> ChargebackService:
    """The service as ``build`` makes it (its decoder included), on clients it never calls here."""
    proj = projected_sample_schema(catalog.current("GpuSample").raw)
    codec = AvroCodec(reader_schemas={"GpuSample": proj})
    cfg = ServiceConfig(bootstrap="unused", input_topic="in", output_topic="out", deadletter_topic="dlq")
    engine = build_engine(ChargebackSettings(), None, "bench")  # type: ignore[arg-type]
    return ChargebackService(
        cfg,
        engine,
        codec,
        decode=decoder_of(codec),
        consumer_factory=_unused,
        producer_factory=_unused,
    )


def decoder_of(codec: AvroCodec) -> Callable[..., Any]:
    """The decoder ``service.build`` gives the service."""
    from gpupipe_consumers.chargeback import service as svc

    make = getattr(svc, "sample_decoder", None)
    if make is not None:
        return make(codec)  # type: ignore[no-any-return]
    from gpupipe_schemas.fastdecode import SampleDecoder

    return SampleDecoder(codec, projected_sample_schema(catalog.current("GpuSample").raw)).decode


def _unused(conf: dict[str, Any]) -> Any:
    raise AssertionError("no Kafka client in the in-process bench")


def measure(ticks: int = 250, rounds: int = 3) -> dict[str, float]:
    """µs per sample of the path, the decoder and the bare loop (best of ``rounds`` each)."""
    msgs = messages(ticks)
    batches = [msgs[i : i + BATCH] for i in range(0, len(msgs), BATCH)]
    n = len(msgs)

    def path() -> float:
        svc = service()  # fresh state every pass: the same windows are built each time
        gc.collect()
        t = time.process_time()
        for b in batches:
            svc.process(b)
        dt = time.process_time() - t
        assert svc.engine.stats["samples"] == n, dict(svc.engine.stats)
        return dt

    decode = decoder_of(
        AvroCodec(reader_schemas={"GpuSample": projected_sample_schema(catalog.current("GpuSample").raw)})
    )

    def dec() -> float:
        t = time.process_time()
        for m in msgs:
            decode(m.value(), m.headers())
        return time.process_time() - t

    def bare() -> float:
        t = time.process_time()
        for b in batches:
            for m in b:
                m.value()
        return time.process_time() - t

    best = {"path": float("inf"), "decode": float("inf"), "bare": float("inf")}
    dec()  # warm the caches the decoder keeps
    for _ in range(rounds):
        for name, fn in (("path", path), ("decode", dec), ("bare", bare)):
            best[name] = min(best[name], fn())
    return {k: v / n * 1e6 for k, v in best.items()} | {"samples": float(n)}


def report(us: dict[str, float]) -> None:
    figure("chargeback_path_samples", int(us["samples"]))
    figure("chargeback_path_us", us["path"], "us/sample (ChargebackService.process, in process, no Kafka)")
    figure("chargeback_decode_us", us["decode"], "us/sample (the service's own decoder, same payloads)")
    figure("chargeback_loop_us", us["bare"], "us/sample (iterating the messages: the loop's floor)")
    figure("chargeback_path_samples_per_s", 1e6 / us["path"], "samples/s (one core, no Kafka)")
    ratio_line("chargeback_path_vs_decode", us["decode"] / us["path"], DECODE_SHARE)
    print("  # chargeback_path_budget: an absolute budget (20 us/sample), not a measured baseline")
    ratio_line("chargeback_path_budget", BUDGET_US / us["path"], 1.00)


if __name__ == "__main__":
    report(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 250))
