"""The alerts service's ``/alerts`` and ``/alerts.json`` routes: a snapshot of its open alerts, rendered.

Rules and reasons in full: docs/alerts.md, "Module notes", ``alerts_page.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from email.message import Message
from typing import Any

from gpupipe.web.server import Response, Route
from gpupipe_consumers.alerts.open_alerts_view import (
    MAX_ROWS,
    OpenAlertsView,
    render_html,
    render_json,
    view_of,
)

__all__ = ["LOCK_WAIT_S", "REFRESH_S", "AlertsPage"]

#: A snapshot younger than this is reused (a walk of up to --max-open-alerts alerts under the lock).
REFRESH_S = 1.0
#: How long a request waits for the service's lock before it is answered from the last snapshot.
LOCK_WAIT_S = 2.0

Snapshot = Callable[[int, float], "tuple[list[dict[str, Any]], int, int] | None"]

#: The page has no script and loads nothing: say so to the browser too (inline CSS only).
_HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class AlertsPage:
    def __init__(
        self,
        snapshot: Snapshot,
        *,
        instance: str,
        role: Callable[[], str],
        max_rows: int = MAX_ROWS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._snapshot = snapshot
        self.instance = instance
        self._role = role
        self.max_rows = max_rows
        self._clock = clock
        self._refresh = threading.Lock()
        self._last: OpenAlertsView | None = None
        self._last_at = float("-inf")  # monotonic
        self.walks = 0  # snapshots taken (the tests' count)

    def view(self) -> OpenAlertsView | None:
        """The latest snapshot as a view: a fresh one at most every REFRESH_S; None when the lock stayed
        busy and no earlier one exists."""
        start = time.monotonic()
        if not self._refresh.acquire(timeout=LOCK_WAIT_S):
            return self._stale()
        try:
            if self._last is not None and time.monotonic() - self._last_at < REFRESH_S:
                return self._last
            got = self._snapshot(self.max_rows, max(0.0, LOCK_WAIT_S - (time.monotonic() - start)))
            if got is None:
                return self._stale()
            records, total, taken_at = got
            self.walks += 1
            self._last = view_of(
                records,
                total,
                instance=self.instance,
                role=self._role(),
                taken_at_ms=taken_at,
                max_rows=self.max_rows,
            )
            self._last_at = time.monotonic()
            return self._last
        finally:
            self._refresh.release()

    def _stale(self) -> OpenAlertsView | None:
        last = self._last
        if last is None:
            return None
        return OpenAlertsView(
            rows=last.rows,
            total=last.total,
            instance=last.instance,
            role=last.role,
            taken_at_ms=last.taken_at_ms,
            stale=True,
        )

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def html(self, headers: Message) -> Response:
        view = self.view()
        if view is None:
            return _busy()
        return Response(200, render_html(view, self._now_ms()), "text/html; charset=utf-8", _HTML_HEADERS)

    def json(self, headers: Message) -> Response:
        view = self.view()
        if view is None:
            return _busy()
        return Response(
            200, render_json(view, self._now_ms()), "application/json", {"Cache-Control": "no-store"}
        )

    def routes(self) -> dict[str, Route]:
        return {"/alerts": self.html, "/alerts.json": self.json}


def _busy() -> Response:
    return Response(
        503,
        b"The alerts service is busy (waiting for the broker); try again in a few seconds.\n",
        "text/plain; charset=utf-8",
        {"Retry-After": "5"},
    )
