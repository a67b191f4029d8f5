"""Readings beyond what any GPU reports are not printed: the exposition converts a sample's readings
only when scraped, so the whole-record bounds check of the consume loop never sees them; the
renderer holds them to the same bounds (:func:`gpupipe_schemas.validate.reading_max`) on every path."""

from __future__ import annotations

import re

import pytest

from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.readings import PENDING
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.validate import POWER_MAX_W, reading_max
from tests.unit.consumers.metrics.test_store import T_MS, blank

CODEC = AvroCodec()
ENC = CODEC.encoder("GpuSample")

ABSURD = [
    ("power_w", 1e300, "DCGM_FI_DEV_POWER_USAGE"),
    ("gpu_temp_c", 1e12, "DCGM_FI_DEV_GPU_TEMP"),
    ("gpu_util_ratio", 7.0, "DCGM_FI_DEV_GPU_UTIL"),
    ("memory_temp_c", 300.0, "DCGM_FI_DEV_MEMORY_TEMP"),
]


def exposition(recs: list[dict], split: bool) -> str:
    store = SeriesStore()
    dec = MetricsDecoder(CODEC, store.renderer)
    for rec in recs:
        got = dec.decode(ENC.encode(rec)).record if split else rec
        assert (PENDING in got) == split
        store.apply_sample(got, 0, T_MS / 1000)
    return store.render(T_MS / 1000).decode()


def value(text: str, family: str, uuid: str) -> str | None:
    m = re.search(rf'^{family}{{[^}}]*UUID="{uuid}"[^}}]*}} (\S+)$', text, re.M)
    return None if m is None else m[1]


@pytest.mark.parametrize("split", [True, False], ids=["pending-readings", "decoded-record"])
@pytest.mark.parametrize(("field", "bad", "family"), ABSURD)
def test_an_absurd_reading_is_not_printed_and_is_counted(
    split: bool, field: str, bad: float, family: str
) -> None:
    good = blank("GPU-good", power_w=300.0, gpu_temp_c=50.0, memory_temp_c=40.0, gpu_util_ratio=0.5)
    worse = {**good, "uuid": "GPU-bad", field: bad}
    text = exposition([good, worse], split)
    assert value(text, family, "GPU-good") is not None
    assert value(text, family, "GPU-bad") is None
    assert value(text, "DCGM_FI_DEV_SM_CLOCK", "GPU-bad") == value(text, "DCGM_FI_DEV_SM_CLOCK", "GPU-good")
    assert re.search(
        rf'^gpupipe_metrics_invalid_values_total{{field="{family}",reason="out-of-range"}} 1(\.0)?$',
        text,
        re.M,
    ), text[-2000:]


def test_values_at_the_bound_are_printed() -> None:
    assert reading_max("power_w") == POWER_MAX_W
    edge = blank("GPU-edge", power_w=POWER_MAX_W, gpu_util_ratio=1.0)
    text = exposition([edge], split=True)
    assert value(text, "DCGM_FI_DEV_POWER_USAGE", "GPU-edge") == f"{POWER_MAX_W:f}"
    assert value(text, "DCGM_FI_DEV_GPU_UTIL", "GPU-edge") == "100"
