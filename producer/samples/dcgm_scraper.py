"""Reads the node's dcgm-exporter ``/metrics`` on a thread of its own (``--dcgm-exporter-url``).

``run(stop)`` fetches every ``interval_s`` with a ``timeout_s`` limit and keeps the last good
:data:`~gpupipe_producer.samples.dcgm_profiling.Readings`; the polling thread only calls
``readings()``, which never waits on the network and gives nothing once the last good scrape is
older than ``max_age_s``. A failed scrape (refused, timed out, HTTP error, not Prometheus text) is
passed to ``on_error(kind)`` each time and logged once until a scrape succeeds again.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from gpupipe_producer.samples.dcgm_profiling import Readings, ScrapeError, parse_scrape

log = logging.getLogger("gpupipe.dcgm")

DEFAULT_TIMEOUT_S = 0.5
MAX_BYTES = 16 << 20  # a node's full dcgm-exporter page is well under this


class DcgmExporterScraper:
    def __init__(
        self,
        url: str,
        *,
        interval_s: float,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_age_s: float | None = None,
        on_error: Callable[[str], None] = lambda kind: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Three missed scrapes: the exporter is gone; its old ratios must not pass for current.
        self.max_age_s = 3 * interval_s + timeout_s if max_age_s is None else max_age_s
        self._on_error = on_error
        self._clock = clock
        self._last: tuple[Readings, float] | None = None  # readings, when (one assignment)
        self._failing = False
        self.scrapes = 0

    def readings(self) -> Readings:
        """The last good scrape's readings, or nothing when it is too old (or none yet)."""
        last = self._last
        if last is None or self._clock() - last[1] > self.max_age_s:
            return {}
        return last[0]

    def scrape_once(self) -> bool:
        """One fetch and parse; True on success. Never raises."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                body = resp.read(MAX_BYTES)
            readings = parse_scrape(body.decode("utf-8", "replace"))
        except ScrapeError as exc:
            return self._failed("parse", exc)
        except urllib.error.HTTPError as exc:
            return self._failed("http", exc)
        except TimeoutError as exc:
            return self._failed("timeout", exc)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None)
            return self._failed("timeout" if isinstance(reason, TimeoutError) else "connect", exc)
        self._last = (readings, self._clock())
        self.scrapes += 1
        if self._failing:
            self._failing = False
            log.info("dcgm-exporter at %s answers again", self.url)
        return True

    def _failed(self, kind: str, exc: BaseException) -> bool:
        self._on_error(kind)
        if not self._failing:
            self._failing = True
            log.warning(
                "dcgm-exporter scrape of %s failed (%s: %s); profiling fields of GPUs without GPM stay "
                "null until it answers (gpupipe_producer_dcgm_scrape_errors_total counts the failures)",
                self.url,
                kind,
                exc,
            )
        return False

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            self.scrape_once()
            stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))
