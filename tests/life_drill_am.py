"""The life drill's real-Alertmanager leg: what a real Alertmanager sends, in the drill's time.

The drill (tests/life_drill.py) runs the alerts service on a simulated clock, days in seconds. A real
Alertmanager keeps its own, wall clock, so the leg's senders talk to it in wall time: each instance's
:class:`~gpupipe.alertmanager.AlertmanagerSender` runs on the wall clock (re-sends every
``resend_ms``, ``endsAt`` four of those ahead), the record's times are mapped to wall time (an
alert starts when the leg first sent it; a resolved one ends when it is sent), and labels, annotations
and every firing/resolved decision are the service's own. Alertmanager groups every label set on its
own and notifies a webhook receiver at once (``group_wait``/``group_interval`` a few tens of ms, which
is minutes of the drill's time, well under any fault's life).

:meth:`AlertmanagerLeg.view` turns the notifications back into the drill's time (the drill's time
when each arrived): a label set notified firing is a page, notified resolved a RESOLVED, firing again
after that a second page -- the events :func:`tests.life_drill.check` holds against the truth, as it
does the simulated Alertmanager's.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Any

from gpupipe.alertmanager import AlertmanagerSender, AmState
from gpupipe_consumers.alerts.alert_record import gpu_alert_shape
from tests.am_webhook import Notification
from tests.life_drill import T0, AmEvent, LabelKey

#: One aggregation group per label set, notified at once and never repeated while it fires.
AM_CONFIG = {
    "route": {
        "receiver": "drill",
        "group_by": ["..."],
        "group_wait": "20ms",
        "group_interval": "20ms",
        "repeat_interval": "1000h",
    },
    "receivers": [{"name": "drill", "webhook_configs": [{"url": "", "send_resolved": True}]}],
}


@dataclass
class LegView:
    events: list[AmEvent] = field(default_factory=list)
    ends: dict[LabelKey, int] = field(default_factory=dict)


class AlertmanagerLeg:
    def __init__(self, url: str, resend_ms: int = 2000) -> None:
        self.url = url
        self.resend_ms = resend_ms
        self._started: dict[str, int] = {}  # alert id -> wall ms it was first sent
        self._wall: list[float] = [time.monotonic()]  # monotonic seconds of each step
        self._drill: list[int] = [T0]  # the drill's time at that step

    def sender(self) -> AlertmanagerSender:
        return AlertmanagerSender(
            self.url, shape=self._shape, resend_interval_ms=self.resend_ms, timeout_s=10
        )

    def _shape(self, rec: dict[str, Any]) -> AmState:
        s = gpu_alert_shape(rec)
        started = self._started.setdefault(s.alert_id, int(time.time() * 1000))
        return replace(s, first_seen_ms=started, resolved_at_ms=None)

    def on_step(self, drill_ms: int) -> None:
        self._wall.append(time.monotonic())
        self._drill.append(drill_ms)

    def drill_time(self, monotonic_s: float) -> int:
        """The drill's time when the wall clock read ``monotonic_s`` (its last step by then)."""
        return self._drill[max(0, bisect_right(self._wall, monotonic_s) - 1)]

    def view(self, notifications: list[Notification]) -> LegView:
        out = LegView()
        firing: set[LabelKey] = set()
        for n in notifications:
            at = self.drill_time(n.received_s)
            for a in n.alerts():
                key: LabelKey = tuple(sorted(a["labels"].items()))
                if a["status"] == "firing" and key not in firing:
                    firing.add(key)
                    out.events.append(AmEvent(at, "page", dict(key), a["annotations"]))
                elif a["status"] == "resolved" and key in firing:
                    firing.discard(key)
                    out.events.append(AmEvent(at, "resolved", dict(key), a["annotations"]))
        out.ends = dict.fromkeys(firing, 0)
        return out
