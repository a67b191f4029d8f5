"""The life drill's real-Alertmanager leg: what a real Alertmanager sends, in the drill's time.

The drill (tests/life_drill.py) runs the alerts service on a simulated clock, days in seconds. A real
Alertmanager keeps its own, wall clock, so the leg's senders talk to it in wall time: each instance's
:class:`~gpupipe.clients.alertmanager.AlertmanagerSender` runs on the wall clock (re-sends every
``resend_ms``, ``endsAt`` four of those ahead), the record's times are mapped to wall time (an
alert starts when the leg first sent it; a resolved one ends when it is sent), and labels, annotations
and every firing/resolved decision are the service's own. Alertmanager groups every label set on its
own and notifies a webhook receiver at once (``group_wait``/``group_interval`` a few tens of ms, which
is minutes of the drill's time, well under any fault's life).

:meth:`AlertmanagerLeg.view` turns the notifications back into the drill's time: a label set notified
firing is a page, notified resolved a RESOLVED, firing again after that a second page -- the events
:func:`tests.life_drill.check` holds against the truth, as it does the simulated Alertmanager's. Each
is placed at the drill's time when Alertmanager took it to start (its ``startsAt``: the post that
made it fire) or to end (its ``endsAt``: the resolved post, or the expiry of the last re-send), not
when the notification arrived, so Alertmanager's own notification delay on a loaded machine does not
move a page past its fault's recovery.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import time
import urllib.request
from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from gpupipe.clients.alertmanager import AlertmanagerSender, AmState
from gpupipe_consumers.alerts.am_shape import gpu_alert_shape
from tests import hygiene
from tests.am_webhook import Notification, WebhookReceiver
from tests.life_drill import T0, AmEvent, LabelKey

ALERTMANAGER = "/usr/bin/prometheus-alertmanager"  # Debian's prometheus-alertmanager

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
    def __init__(self, url: str, hook: WebhookReceiver, resend_ms: int = 5000) -> None:
        self.url = url
        self.hook = hook
        self.resend_ms = resend_ms
        self._started: dict[str, int] = {}  # firing alert id -> wall ms it was first sent
        self._wall: list[int] = [int(time.time() * 1000)]  # wall ms of each step
        self._drill: list[int] = [T0]  # the drill's time at that step

    def sender(self) -> AlertmanagerSender:
        return AlertmanagerSender(
            self.url, shape=self._shape, resend_interval_ms=self.resend_ms, timeout_s=10
        )

    def _shape(self, rec: dict[str, Any]) -> AmState:
        s = gpu_alert_shape(rec)
        now = int(time.time() * 1000)
        if s.status == "firing":
            started = self._started.setdefault(s.alert_id, now)
        else:  # over: a reopened alert starts anew
            started = self._started.pop(s.alert_id, now)
        return replace(s, first_seen_ms=started, resolved_at_ms=None)

    def on_step(self, drill_ms: int) -> None:
        self._wall.append(int(time.time() * 1000))
        self._drill.append(drill_ms)

    def drill_time(self, wall_ms: int) -> int:
        """The drill's time at the first step logged after the wall clock read ``wall_ms``: a step is
        logged when it ends, after its posts, and several steps share a millisecond, so this is the step
        of the post or one a few ticks later, never an earlier one."""
        return self._drill[min(bisect_right(self._wall, wall_ms), len(self._drill) - 1)]

    def view(self, notifications: list[Notification]) -> LegView:
        out = LegView()
        firing: set[LabelKey] = set()
        for n in notifications:
            for a in n.alerts():
                key: LabelKey = tuple(sorted(a["labels"].items()))
                if a["status"] == "firing" and key not in firing:
                    firing.add(key)
                    at = self.drill_time(_wall_ms(a["startsAt"]))
                    out.events.append(AmEvent(at, "page", dict(key), a["annotations"]))
                elif a["status"] == "resolved" and key in firing:
                    firing.discard(key)
                    at = self.drill_time(_wall_ms(a["endsAt"]))
                    out.events.append(AmEvent(at, "resolved", dict(key), a["annotations"]))
        out.events.sort(key=lambda e: e.at_ms)
        out.ends = dict.fromkeys(firing, 0)
        return out

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.url + "/api/v2/alerts", timeout=10) as r:
            return [a for a in json.loads(r.read()) if a["labels"].get("source") == "gpupipe"]

    def settle(self, sender: AlertmanagerSender, timeout_s: float = 60.0) -> LegView:
        """Once ``sender`` (the last instance's) delivered all it holds and every label set Alertmanager
        has firing was notified firing, every other notified resolved: the notifications, viewed."""
        deadline = time.monotonic() + timeout_s
        while True:
            if sender.step():
                active = {tuple(sorted(a["labels"].items())) for a in self.alerts()}
                view = self.view(self.hook.notifications())
                if set(view.ends) == active:
                    return view
            if time.monotonic() > deadline:
                raise TimeoutError("Alertmanager's notifications never matched its alerts")
            time.sleep(0.1)


def _wall_ms(rfc3339: str) -> int:
    return int(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() * 1000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def alertmanager_leg(tmp: Path, binary: str = ALERTMANAGER) -> Iterator[AlertmanagerLeg]:
    """A real Alertmanager configured as the leg needs, and its webhook receiver, for the ``with``."""
    with WebhookReceiver() as hook:
        cfg = copy.deepcopy(AM_CONFIG)
        cfg["receivers"][0]["webhook_configs"][0]["url"] = hook.url("/drill")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "am.yml").write_text(yaml.safe_dump(cfg))
        port = _free_port()
        with (tmp / "am.log").open("wb") as log:
            proc = hygiene.popen(
                [binary, f"--config.file={tmp / 'am.yml'}", f"--storage.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            leg = AlertmanagerLeg(f"http://127.0.0.1:{port}", hook)
            deadline = time.monotonic() + 30
            while True:
                try:
                    leg.alerts()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError((tmp / "am.log").read_text()[-2000:]) from None
                    time.sleep(0.1)
            yield leg
        finally:
            hygiene.stop_group(proc)
