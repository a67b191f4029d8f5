"""A body is exactly one record: bytes after it are refused by every decoder, not ignored."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_producer.simulated.fleet import FleetConfig, SimulatedFleet
from gpupipe_schemas import catalog
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.errors import DecodeError
from gpupipe_schemas.fastdecode import SampleDecoder


def _decoders() -> dict[str, Callable[[bytes], object]]:
    codec = AvroCodec()
    return {
        "codec": codec.decode,
        "chargeback": SampleDecoder(codec, catalog.current("GpuSample").raw).decode,
        "metrics": MetricsDecoder(codec, SeriesStore().renderer).decode,
    }


@pytest.mark.parametrize("name", sorted(_decoders()))
def test_trailing_bytes_are_a_decode_error(name: str) -> None:
    decode = _decoders()[name]
    sample = SimulatedFleet(FleetConfig(nodes=1, gpus_per_node=1)).tick(1_795_000_000_000)[0][0]
    good = AvroCodec().encoder("GpuSample").encode(sample)
    for _ in range(3):  # the metrics decoder caches what it saw: ask after it has seen the good one
        assert decode(good) is not None
    with pytest.raises(DecodeError) as info:
        decode(good + b"\x00extra")
    assert "after the record" in (info.value.detail or "")
