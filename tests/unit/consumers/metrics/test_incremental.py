"""Scrape work follows what changed: a GPU is rendered once per scrape at most, from its latest
sample, and not at all when it sent nothing (pure).

Before: every sample was rendered at ingest (five samples between two scrapes: five renders, four
of them never shown).
"""

from __future__ import annotations

import threading
import time

from gpupipe_consumers.metrics.store import SeriesStore
from tests.unit.consumers.metrics.test_store import T_MS, blank, check_exposition, lines_of, xid


def counting(store: SeriesStore) -> list[str]:
    calls: list[str] = []
    inner = store.renderer.render

    def render(rec, view, *a, **kw):
        calls.append(rec["uuid"])
        return inner(rec, view, *a, **kw)

    store.renderer.render = render  # type: ignore[method-assign]
    return calls


def test_only_changed_gpus_are_rendered_once_per_scrape() -> None:
    store = SeriesStore(stale_after_s=3600)
    now = T_MS / 1000
    for i in range(100):
        store.apply_sample(blank(f"GPU-{i}"), 0, now)
    store.render(now)
    calls = counting(store)
    for k in range(5):  # five samples of one GPU between two scrapes
        store.apply_sample(blank("GPU-7", timestamp_ms=T_MS + k, gpu_temp_c=40.0 + k), 0, now)
    text = store.render(now).decode()
    assert calls == ["GPU-7"]
    (line,) = [ln for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP") if 'UUID="GPU-7"' in ln]
    assert line.endswith(" 44")  # the latest sample
    store.render(now)
    assert calls == ["GPU-7"]  # nothing changed: nothing rendered


def test_xid_between_sample_and_scrape_is_in_the_render() -> None:
    store = SeriesStore(stale_after_s=3600)
    now = T_MS / 1000
    store.apply_sample(blank("GPU-0"), 0, now)
    store.apply_xid(xid(48), 0, now)  # before the first render of that sample
    text = store.render(now).decode()
    (line,) = lines_of(text, "DCGM_FI_DEV_XID_ERRORS")
    assert line.endswith('err_code="48",err_msg="Double Bit ECC Error"} 48')
    assert lines_of(text, "DCGM_EXP_XID_ERRORS_TOTAL")[0].endswith(" 1")


def test_a_gpu_back_after_expiring_keeps_its_label_view() -> None:
    """A consumer that falls behind by more than the staleness limit expires GPUs whose samples are
    only late; before, each came back by rendering its label sets again (about 50 us a GPU), which
    made catching up dearer the further behind it was."""
    store = SeriesStore(stale_after_s=3)
    views: list[str] = []
    inner = store.renderer.view

    def view(rec):
        views.append(rec["uuid"])
        return inner(rec)

    store.renderer.view = view  # type: ignore[method-assign]
    now = T_MS / 1000
    store.apply_sample(blank("GPU-0"), 0, now)
    assert 'UUID="GPU-0"' in store.render(now).decode()
    store.apply_sample(blank("GPU-1", interval_ms=3_600_000), 0, now + 10)  # the input goes on
    assert 'UUID="GPU-0"' not in store.render(now + 10).decode()  # expired
    store.apply_sample(blank("GPU-0", timestamp_ms=T_MS + 1000, gpu_temp_c=51.0), 0, now + 11)
    text = store.render(now + 11).decode()
    (line,) = [ln for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP") if 'UUID="GPU-0"' in ln]
    assert line.endswith(" 51")
    assert views == ["GPU-0", "GPU-1"]
    # labels that changed while it was away are rendered anew
    store.apply_sample(blank("GPU-1", interval_ms=3_600_000), 0, now + 25)
    assert 'UUID="GPU-0"' not in store.render(now + 25).decode()  # away again
    store.apply_sample(blank("GPU-0", hostname="node-2"), 0, now + 30)
    assert 'Hostname="node-2"' in store.render(now + 30).decode()
    assert views == ["GPU-0", "GPU-1", "GPU-0"]


def test_a_batch_is_applied_under_one_lock_and_reports_its_bad_records() -> None:
    store = SeriesStore(stale_after_s=3600)
    now = T_MS / 1000
    bad = blank("GPU-1")
    del bad["uuid"]
    failed = store.apply_samples([(blank("GPU-0"), 0), (bad, 0), (blank("GPU-2"), 1)], now)
    assert [(i, type(e).__name__) for i, e in failed] == [(1, "UnusableSample")]
    assert sorted(store.keys()) == ["GPU-0", "GPU-2"]


def test_concurrent_scrapes_share_one_build() -> None:
    """Two scrapes at once (an HA Prometheus pair, or a slow scrape overlapping the next) join the
    GPUs' families once: the second takes the first one's answer."""
    store = SeriesStore(stale_after_s=3600)
    store.apply_sample(blank("GPU-0"), 0, time.time())
    builds: list[int] = []
    release = threading.Event()
    inner = store._render_parts

    def slow(now_s):
        builds.append(1)
        release.wait(10)
        return inner(now_s)

    store._render_parts = slow  # type: ignore[method-assign]
    out: dict[str, list[bytes]] = {}
    first = threading.Thread(target=lambda: out.setdefault("a", store.render_parts()))
    first.start()
    deadline = time.monotonic() + 10
    while not builds and time.monotonic() < deadline:
        time.sleep(0.001)
    second = threading.Thread(target=lambda: out.setdefault("b", store.render_parts()))
    second.start()
    while not store._flight._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.001)
    release.set()
    first.join(10)
    second.join(10)
    assert len(builds) == 1
    assert out["a"] is out["b"] and b'UUID="GPU-0"' in out["a"][0]
    # a scrape after that builds anew
    store.render_parts()
    assert len(builds) == 2


def test_kept_label_views_are_bounded_in_time_and_number() -> None:
    store = SeriesStore(stale_after_s=3, max_expired_views=2, expired_view_ttl_s=60)
    now = T_MS / 1000
    for i in range(3):
        store.apply_sample(blank(f"GPU-{i}"), 0, now)
    for t in range(1, 11):  # the input goes on, a sample a second
        store.apply_sample(blank("GPU-beat"), 0, now + t)
    store.render(now + 10)  # all three expire; two views are kept
    assert len(store._expired_views) == 2
    store.apply_sample(blank("GPU-9"), 0, now + 20)
    for t in range(21, 101):
        store.apply_sample(blank("GPU-beat"), 0, now + t)
    store.render(now + 100)  # GPU-9 expires; the other two are older than the TTL
    assert list(store._expired_views) == ["GPU-9"]


def test_a_record_without_some_metric_fields_renders_them_as_null_and_counts_bad_values_once() -> None:
    store = SeriesStore(stale_after_s=3600)
    now = T_MS / 1000
    rec = blank("GPU-0", gpu_temp_c=float("nan"), sm_clock_mhz=1980)
    del rec["power_w"], rec["fb_used_bytes"]  # a projected or hand-made record
    store.apply_sample(rec, 0, now)
    text = store.render(now).decode()
    assert lines_of(text, "DCGM_FI_DEV_SM_CLOCK")[0].endswith(" 1980")
    assert not lines_of(text, "DCGM_FI_DEV_POWER_USAGE") and not lines_of(text, "DCGM_FI_DEV_GPU_TEMP")
    assert sum(store.stats()["invalid"].values()) == 1


class _IngestBetweenChunks:
    """Stands in for the store module's ``time``: runs ``inject`` at the first pause between two
    render chunks of a scrape (where a concurrent ingest thread would take the lock)."""

    def __init__(self, inject) -> None:
        self.inject = inject
        self.done = False

    def time(self) -> float:
        return time.time()

    def sleep(self, s: float) -> None:
        if not self.done:
            self.done = True
            self.inject()


def test_samples_arriving_during_a_scrape_wait_for_the_next_one(monkeypatch) -> None:
    """A scrape renders the GPUs sampled before it began, a chunk per lock hold. Before, what
    arrived while it rendered was rendered under its final lock hold, all at once: at 20k GPUs/s
    thousands of GPUs (hundreds of ms) with ingest blocked behind the lock."""
    from gpupipe_consumers.metrics import store as store_mod

    store = SeriesStore(stale_after_s=3600, flush_chunk=4)
    now = T_MS / 1000
    for i in range(12):
        store.apply_sample(blank(f"GPU-{i}"), 0, now)
    calls = counting(store)

    def ingest() -> None:  # 8 GPUs sample again (some already rendered), 2 are new
        for i in range(8):
            store.apply_sample(blank(f"GPU-{i}", gpu_temp_c=70.0), 0, now)
        for i in (20, 21):
            store.apply_sample(blank(f"GPU-{i}"), 0, now)

    monkeypatch.setattr(store_mod, "time", _IngestBetweenChunks(ingest))
    text = store.render(now).decode()
    assert len(calls) == 12  # the GPUs dirty when the scrape began, each once
    # first sampled during the scrape: in the next one
    assert not [ln for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP") if 'UUID="GPU-20"' in ln]
    check_exposition(text)
    calls.clear()
    text = store.render(now).decode()
    temps = {
        ln.split('UUID="')[1].split('"')[0]: ln.rsplit(" ", 1)[1]
        for ln in lines_of(text, "DCGM_FI_DEV_GPU_TEMP")
    }
    assert "GPU-20" in temps and "GPU-21" in temps
    assert all(temps[f"GPU-{i}"] == "70" for i in range(8)), temps  # none shows a stale body
    assert len(calls) <= 10  # the 8 sampled again (less those rendered late in the first) + 2 new


def test_an_xid_for_a_gpu_waiting_in_a_scrape_is_rendered_with_it(monkeypatch) -> None:
    """An XID for a GPU whose first sample is queued in a running scrape (no lines yet)."""
    from gpupipe_consumers.metrics import store as store_mod

    store = SeriesStore(stale_after_s=3600, flush_chunk=2)
    now = T_MS / 1000
    for i in range(6):
        store.apply_sample(blank(f"GPU-{i}"), 0, now)

    def ingest() -> None:
        waiting = [k for k, g in store._gpus.items() if not g.lines]
        assert waiting
        for k in waiting:
            assert store.apply_xid(xid(48, uuid=k), 0, now)

    monkeypatch.setattr(store_mod, "time", _IngestBetweenChunks(ingest))
    text = store.render(now).decode()
    xid_lines = lines_of(text, "DCGM_FI_DEV_XID_ERRORS")
    assert len(xid_lines) == 6 and sum(ln.endswith(" 48") for ln in xid_lines) == 4
