"""Scrape work follows what changed: a GPU is rendered once per scrape at most, from its latest
sample, and not at all when it sent nothing (pure).

Before: every sample was rendered at ingest (five samples between two scrapes: five renders, four
of them never shown).
"""

from __future__ import annotations

from consumers.metrics.store import SeriesStore
from tests.unit.test_metrics_store import T_MS, blank, lines_of, xid


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
