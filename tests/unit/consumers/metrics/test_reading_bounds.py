"""Readings beyond what any GPU reports are neither taken nor printed: the split decoder, which
leaves readings to the scrape, matches them against the contract's bounds
(:func:`gpupipe_schemas.validate.reading_range`), so a sample beyond them takes the whole-record path and
the consume loop's check refuses it; a record that reaches the store anyway is held to the same
bounds (:func:`gpupipe_schemas.validate.reading_max`) when rendered."""

from __future__ import annotations

import math
import random
import re
import struct

import pytest

from gpupipe_consumers.metrics.collectors_csv import all_counters
from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.readings import PENDING
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_consumers.plumbing.avro_patterns import bounded_body
from gpupipe_schemas.codec import AvroCodec
from gpupipe_schemas.validate import POWER_MAX_W, reading_max, reading_range, violation
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


GOOD = blank("GPU-good", power_w=300.0, gpu_temp_c=50.0, memory_temp_c=40.0, gpu_util_ratio=0.5)


@pytest.mark.parametrize(("field", "bad", "family"), [*ABSURD, ("gpu_temp_c", -100.0, "")])
def test_an_absurd_reading_leaves_the_split_path_and_is_refused(field: str, bad: float, family: str) -> None:
    dec = MetricsDecoder(CODEC, SeriesStore().renderer)
    assert PENDING in dec.decode(ENC.encode(GOOD)).record
    d = dec.decode(ENC.encode({**GOOD, "uuid": "GPU-bad", field: bad}))
    assert PENDING not in d.record
    assert d.violation(T_MS, T_MS) == violation("GpuSample", {**GOOD, field: bad}, T_MS, T_MS)
    assert (d.violation(T_MS, T_MS) or "").startswith(f"{field}: ")


@pytest.mark.parametrize(("field", "bad", "family"), ABSURD)
def test_an_absurd_reading_is_not_printed_and_is_counted(field: str, bad: float, family: str) -> None:
    worse = {**GOOD, "uuid": "GPU-bad", field: bad}
    text = exposition([GOOD, worse], False)
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


def test_a_power_over_its_limit_leaves_the_split_path_where_the_limit_is_read() -> None:
    dec = MetricsDecoder(CODEC, SeriesStore(all_counters()).renderer)
    ok = {**GOOD, "power_limit_w": 700.0, "power_w": 690.0}
    assert PENDING in dec.decode(ENC.encode(ok)).record
    assert PENDING in dec.decode(ENC.encode({**ok, "power_limit_w": None, "power_w": 2500.0})).record
    d = dec.decode(ENC.encode({**ok, "power_w": 2500.0}))
    assert PENDING not in d.record
    assert (d.violation(T_MS, T_MS) or "").startswith("power_w: 2500.0, over 3x the power limit 700 W")


@pytest.mark.parametrize("field", ["gpu_util_ratio", "power_w", "gpu_temp_c", "pcie_tx_bytes_per_s"])
def test_the_bytes_pattern_admits_no_value_beyond_the_bounds(field: str) -> None:
    """Random bit patterns and values around the bounds: the pattern admits none beyond them (NaN
    included), and every bound itself, zero and the common values within."""
    lo, hi = reading_range(field)  # type: ignore[misc]
    pattern = re.compile(bounded_body("double", lo, hi) + rb"\Z")
    rng = random.Random(5)
    raw = [rng.randbytes(8) for _ in range(20_000)]
    raw += [struct.pack("<d", rng.uniform(2 * lo - 1, 2 * hi + 1)) for _ in range(20_000)]
    specials = [lo, hi, 0.0, -0.0, math.nan, math.inf, -math.inf, math.nextafter(hi, math.inf)]
    raw += [struct.pack("<d", v) for v in specials]
    for b in raw:
        v = struct.unpack("<d", b)[0]
        if pattern.match(b) is not None:
            assert lo <= v <= hi, (field, v)
    for v in (lo, hi, 0.0, hi / 2, lo / 2):
        assert pattern.match(struct.pack("<d", v)) is not None, (field, v)


def test_a_negative_count_is_refused_by_its_varint_alone() -> None:
    pattern = re.compile(bounded_body("long", 0, math.inf) + rb"\Z")

    def zigzag(n: int) -> bytes:
        u, out = ((n << 1) ^ (n >> 63)) & (2**64 - 1), bytearray()
        while u > 127:
            out.append(u & 127 | 128)
            u >>= 7
        return bytes([*out, u])

    for n in (0, 1, 63, 64, 2**40, 2**63 - 1, -1, -64, -(2**40), -(2**63)):
        assert (pattern.match(zigzag(n)) is not None) == (n >= 0), n
