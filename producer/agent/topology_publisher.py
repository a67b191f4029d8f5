"""Publishes the node's GPU topology (``GpuTopology``, keyed by hostname) to its compacted topic.

:meth:`TopologyPublisher.tick` runs on the NVML polling thread after each poll: it reads the topology
(:mod:`gpupipe_producer.nvml.topology`) at the first tick and whenever the GPU set changes (a GPU
added, gone, lost or back), and hands it over only when its content differs from the last one
handed over, once Kafka is ready. A record not delivered within ``redeliver_after_s`` (past
librdkafka's own retries) is handed over again, so a long broker outage cannot leave the node
without a topology until the next change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpupipe.common.logs import fields
from gpupipe_producer.nvml.topology import read_topology
from gpupipe_schemas.errors import EncodeError
from gpupipe_schemas.records import GpuTopology

log = logging.getLogger("gpupipe.agent")

#: Longer than the producer's message.timeout.ms (300 s): a record still undelivered by then failed.
REDELIVER_AFTER_S = 360.0


class TopologyPublisher:
    """``produce(topic, key, value)`` hands a record over; ``delivered(topic)`` counts deliveries
    (the Publisher's ``sent_by_topic``); ``ready()`` says Kafka can take records."""

    def __init__(
        self,
        hostname: str,
        topic: str,
        encode: Callable[[GpuTopology], bytes],
        produce: Callable[[str, bytes, bytes], None],
        delivered: Callable[[str], int],
        *,
        ready: Callable[[], bool] | None = None,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        redeliver_after_s: float = REDELIVER_AFTER_S,
    ) -> None:
        self.hostname = hostname
        self.topic = topic
        self._encode = encode
        self._produce = produce
        self._delivered = delivered
        self._ready = ready
        self._on_error = on_error or (lambda kind: None)
        self._clock = clock
        self._redeliver_after_s = redeliver_after_s
        self._gpu_set: tuple[Any, ...] | None = None
        self._content: tuple[Any, ...] | None = None  # what was last handed over, timestamp aside
        self._pending: GpuTopology | None = None  # read, not yet handed over
        self._in_flight: tuple[int, float] | None = None  # (deliveries counted before, handed at)
        #: Records handed over and topology reads made (tests and the log).
        self.published = 0
        self.reads = 0

    def tick(self, source: Any, nvml: Any) -> None:
        """Read when the GPU set changed, then hand over what is new; never raises for NVML."""
        gpus = source.gpus()
        lost = {g.uuid for g in source.lost_gpus}
        gpu_set = tuple(sorted((g.gpu_index, g.uuid, g.pci_bus_id, g.uuid in lost) for g in gpus))
        if gpu_set != self._gpu_set:
            self._gpu_set = gpu_set
            self._read(source, nvml, gpus, lost)
        self._hand_over()

    def _read(self, source: Any, nvml: Any, gpus: Any, lost: set[str]) -> None:
        read = read_topology(nvml, gpus, lost)
        self.reads += 1
        for kind, n in read.errors.items():
            for _ in range(n):
                self._on_error(f"topology_{kind}")
        driver = next((g.driver_version for g in gpus if g.driver_version), None)
        record: GpuTopology = {
            "hostname": self.hostname,
            "timestamp_ms": int(time.time() * 1000),
            "driver_version": driver,
            "gpus": read.gpus,
            "pairs": read.pairs,
        }
        content = (driver, repr(read.gpus), repr(read.pairs))
        if content == self._content:
            return  # the same topology: the compacted topic has it already
        self._content = content
        self._pending = record
        self._in_flight = None

    def _hand_over(self) -> None:
        if self._ready is not None and not self._ready():
            return
        if self._in_flight is not None:
            before, at = self._in_flight
            if self._delivered(self.topic) > before:
                self._in_flight = None
                self._pending = None
            elif self._clock() - at > self._redeliver_after_s:
                log.warning("topology not delivered in time: handing it over again")
            else:
                return
        record = self._pending
        if record is None:
            return
        try:
            value = self._encode(record)
        except EncodeError as exc:
            log.error("topology dropped: %s", exc)
            self._on_error("topology_encode")
            self._pending = None
            return
        self._in_flight = (self._delivered(self.topic), self._clock())
        self._produce(self.topic, self.hostname.encode(), value)
        self.published += 1
        log.info(
            "GPU topology handed over",
            extra=fields(gpus=len(record["gpus"]), pairs=len(record["pairs"]), topic=self.topic),
        )
