"""gzip and family chunks of a scrape: only what changed is joined and deflated again (pure).

Before, any change re-joined every family and re-deflated the whole body (80 MB at 10k GPUs);
a family in which no GPU's line changed (counters at 0, clocks, framebuffer sizes) now keeps its
chunk object and that chunk's deflate blocks.
"""

from __future__ import annotations

import gzip
import random
import time
import zlib

from gpupipe_consumers.metrics.decode import MetricsDecoder
from gpupipe_consumers.metrics.gzipcache import GzipCache, crc32_combine
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas.codec import AvroCodec
from tests.unit.consumers.metrics.test_store import T_MS, blank


def test_crc32_combine_equals_the_crc_of_the_concatenation() -> None:
    rng = random.Random(2)
    for _ in range(200):
        a = rng.randbytes(rng.choice([0, 1, 3, 100, 4097]))
        b = rng.randbytes(rng.choice([0, 1, 7, 255, 65536, 70001]))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def scrape_store() -> tuple[SeriesStore, MetricsDecoder]:
    store = SeriesStore(stale_after_s=3600)
    return store, MetricsDecoder(AvroCodec(), store.renderer)


def feed(store: SeriesStore, dec: MetricsDecoder, k: int, n: int = 6) -> None:
    enc = AvroCodec().encoder("GpuSample")
    for i in range(n):  # power moves every sample; temperatures, clocks, counters stay
        rec = blank(f"GPU-{i}", timestamp_ms=T_MS + k, power_w=100.0 + k + i, sm_clock_mhz=1980)
        store.apply_sample(dec.decode(enc.encode(rec)).record, 0, time.time())


def test_unchanged_families_keep_their_chunk_and_deflate_blocks() -> None:
    store, dec = scrape_store()
    gz = GzipCache()
    feed(store, dec, 0)
    first = store.render_parts()
    assert gzip.decompress(b"".join(gz.compress(first))) == b"".join(first)
    feed(store, dec, 1)
    second = store.render_parts()
    kept = [c for c in second[:-1] if any(c is o for o in first[:-1])]
    power = [c for c in second[:-1] if c.startswith(b"# HELP DCGM_FI_DEV_POWER_USAGE ")]
    assert kept and power and not any(c is p for c in first for p in power)
    assert b"sm_clock" not in b"".join(power) and any(
        c.startswith(b"# HELP DCGM_FI_DEV_SM_CLOCK ") for c in kept
    )
    before = gz.chunk_hits
    assert gzip.decompress(b"".join(gz.compress(second))) == b"".join(second)
    assert gz.chunk_hits - before == len(kept)
    # a new GPU shifts every family: all joined again, and the answer is still right
    feed(store, dec, 2, n=7)
    third = store.render_parts()
    assert not any(c is o for c in third[:-1] for o in second[:-1])
    assert gzip.decompress(b"".join(gz.compress(third))) == b"".join(third)
    now = time.time()  # the same moment for both (the sample-age series moves with the clock)
    assert store.render(now) == b"".join(store.render_parts(now))
