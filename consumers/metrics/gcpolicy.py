"""The cyclic GC policy of the ``gpupipe metrics`` process (not used by the store's other users).

Why: every sample allocates a few containers that reference counting frees, but each 700 of them
triggered a young collection and, every few seconds, a full one over the store's ~10 tracked
objects per GPU: about a quarter of the service's CPU at 10k samples/s (measured with
``gc.callbacks``). So what exists after startup is frozen and collections run per 50k net
allocations (:func:`tune_gc`).

Then each scrape leaves tens of thousands of new long-lived containers: a line list per GPU (80
pieces) and the kept readings. The next young collection walked all of them, and every piece they
point to (some 1.6M objects at 20k GPUs): a 200 ms pause of every thread, ingest included, about
once a second at 20k samples/s, the largest part of the service's p99 ingest delay (measured with
``gc.callbacks`` in-process: p99 0.25 s with, 0.08 s without). So after each scrape
(:func:`after_scrape`) what is alive is frozen too: a frozen object is still freed by reference
counting when the next scrape replaces it, it is only never walked by the collector. The store
and the consume path make no reference cycles, so nothing leaks in normal operation; what could
(a cycle made by an error path and still alive at a freeze) is collected by one full collection
every :data:`FULL_COLLECT_S` (0.5 s at 20k GPUs, measured).

A scrape of many GPUs leaves more than a young generation's worth (50k containers) before it
ends: from about 25k GPUs per instance, young collections ran inside the scrape and walked what it
had rendered so far (9-13 us per GPU at 50k GPUs, measured with ``gc.callbacks``). So what each
rendered chunk of GPUs leaves is frozen at once too (:func:`after_chunk`).
"""

from __future__ import annotations

import gc
import threading
import time

GC_THRESHOLDS = (50_000, 20, 100)
FULL_COLLECT_S = 900.0  # a full collection of the unfrozen heap this often, after a scrape

_lock = threading.Lock()
_state = {"enabled": False, "last_full": 0.0}


def tune_gc() -> None:
    """The service process's GC settings (called by ``gpupipe metrics``, not on import)."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    with _lock:
        _state["enabled"] = True
        _state["last_full"] = time.monotonic()


def after_scrape(clock: float | None = None) -> None:
    """Freeze what a scrape left alive (see the module doc); a no-op unless :func:`tune_gc` ran."""
    now = time.monotonic() if clock is None else clock
    with _lock:
        if not _state["enabled"]:
            return
        full = now - _state["last_full"] >= FULL_COLLECT_S
        if full:
            _state["last_full"] = now
    if full:
        gc.unfreeze()
        gc.collect()
    gc.freeze()


def after_chunk() -> None:
    """Freeze what a chunk of a scrape left alive (see the module doc); a no-op unless
    :func:`tune_gc` ran. ``gc.freeze()`` moves the generations' lists whole: it costs no walk."""
    if _state["enabled"]:
        gc.freeze()


def reset(thresholds: tuple[int, ...] = (700, 10, 10)) -> None:
    """Undo :func:`tune_gc` (tests): nothing frozen, these thresholds (the interpreter's default)."""
    with _lock:
        _state["enabled"] = False
    gc.unfreeze()
    gc.set_threshold(*thresholds)
