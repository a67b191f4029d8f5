"""The per-link NVLink health state: a sustained rise warns, a burst does not, DCGM's FAIL fails,
counter resets are no rise, and a link comes back only after clean windows."""

from __future__ import annotations

from typing import Any

import pytest

from gpupipe_consumers.alerts.engine.link_health import LinkChange, LinkHealthConfig, LinkHealthTracker

STEP = 10_000  # the fabric group's 10 s
MIN = 60_000


class Link:
    """One link's counters as the producer reports them, fed to a tracker every 10 s."""

    def __init__(self, tracker: LinkHealthTracker, peer: str | None = "nvswitch") -> None:
        self.t = tracker
        self.ts = 0
        self.c: dict[str, Any] = {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}
        self.up = True
        self.peer = peer
        self.changes: list[LinkChange] = []

    def tick(self, **add: int) -> list[LinkChange]:
        self.ts += STEP
        for k, v in add.items():
            self.c[k] = self.c.get(k, 0) + v
        got = self.t.observe(
            "node-1", "0000:18:00.0", self.ts, [{"link": 3, "up": self.up, "peer": self.peer, **self.c}]
        )
        self.changes += got
        return got

    def minutes(self, n: int, **per_minute: int) -> None:
        for _ in range(n):
            self.tick(**per_minute)
            for _ in range(5):
                self.tick()

    @property
    def states(self) -> list[str]:
        return [c.state for c in self.changes]


def test_a_clean_link_stays_healthy_and_a_single_burst_does_not_warn() -> None:
    link = Link(LinkHealthTracker())
    link.minutes(30)
    link.tick(crc_flit=40, replay=40)  # one burst, as healthy links show now and then
    link.minutes(120)
    assert link.changes == []
    assert link.t.state("node-1", "0000:18:00.0", 3) == "healthy"


def test_errors_in_most_recent_windows_warn_with_the_link_and_peer() -> None:
    link = Link(LinkHealthTracker(), peer="0000:19:00.0")
    link.minutes(10)
    link.minutes(4, crc_flit=2)
    assert link.changes == []
    link.minutes(1, crc_flit=3)
    (c,) = link.changes
    assert (c.state, c.previous, c.link, c.peer) == ("degrading", "healthy", 3, "0000:19:00.0")
    assert "errors in 5 of the last 8 windows" in c.reason
    assert c.since_ms < c.ts_ms - 4 * MIN  # the evidence began with the first bad window


def test_bursts_far_apart_never_add_up_to_a_warning() -> None:
    link = Link(LinkHealthTracker())
    for _ in range(20):
        link.minutes(1, crc_data=5)
        link.minutes(6)
    assert link.changes == []


def test_two_link_recoveries_warn_on_their_own() -> None:
    link = Link(LinkHealthTracker())
    link.minutes(5)
    link.minutes(1, recovery=1)
    link.minutes(2)
    link.minutes(1, recovery=1)
    assert link.states == ["degrading"]


def test_dcgm_crc_rate_fails_the_link_after_the_warning() -> None:
    link = Link(LinkHealthTracker())
    rate = 1
    while not link.changes or link.changes[-1].state != "failed":
        link.minutes(1, crc_flit=rate)
        rate *= 2
        assert rate < 2**20
    assert link.states == ["degrading", "failed"]
    assert "CRC errors/s (DCGM fails at 100/s)" in link.changes[-1].reason


def test_a_link_that_goes_down_fails_at_once_and_stays_failed_while_down() -> None:
    link = Link(LinkHealthTracker())
    link.minutes(2)
    link.up = False
    link.tick()
    assert link.states == ["failed"] and "not active" in link.changes[0].reason
    link.minutes(60)
    assert link.states == ["failed"]
    link.up = True
    link.minutes(15)
    assert link.states == ["failed", "healthy"]


def test_a_failed_link_recovery_fails_the_link() -> None:
    link = Link(LinkHealthTracker())
    link.c["recovery_failed"] = 0
    link.minutes(2)
    link.minutes(1, recovery_failed=1)
    assert link.states == ["failed"]


def test_counter_reset_is_no_rise_and_rises_after_it_still_count() -> None:
    link = Link(LinkHealthTracker())
    link.c.update(crc_flit=1_000_000, replay=50_000)
    link.minutes(10)
    for _ in range(5):  # a driver reload every two minutes: the counters restart from zero
        link.c.update(crc_flit=0, replay=0)
        link.minutes(2)
    assert link.changes == [] and link.t.resets == 1
    link.minutes(1, crc_flit=7)  # errors counted from the new base
    link.minutes(3, crc_flit=1)
    assert link.changes == []
    link.minutes(1, crc_flit=1)
    assert link.states == ["degrading"]


def test_hysteresis_needs_clean_windows_in_a_row() -> None:
    link = Link(LinkHealthTracker(LinkHealthConfig(clear_windows=5)))
    link.minutes(1)
    link.minutes(5, replay=1)
    assert link.states == ["degrading"]
    link.minutes(4)
    link.minutes(1, replay=1)  # one more error: the clean run starts over
    link.minutes(4)
    assert link.states == ["degrading"]
    link.minutes(1)
    assert link.states == ["degrading", "healthy"]


def test_nvlink5_counters_count_and_unknown_counters_are_ignored() -> None:
    t = LinkHealthTracker()
    changes = []
    for minute in range(8):
        ts = minute * MIN
        entry = {"link": 0, "rcv": minute * 3, "symbol": None, "speed": "fast"}
        changes += t.observe("h", "d", ts, [entry])
    assert [c.state for c in changes] == ["degrading"]


def test_replayed_older_samples_change_nothing() -> None:
    link = Link(LinkHealthTracker())
    link.minutes(5)
    assert link.t.observe("node-1", "0000:18:00.0", 1_000, [{"link": 3, "crc_flit": 10**9}]) == []
    link.minutes(10)
    assert link.changes == []


def test_entries_without_a_link_id_are_skipped_and_forget_drops_a_host() -> None:
    t = LinkHealthTracker()
    assert (
        t.observe("h", "d", 0, [{"crc_flit": 1}, {"link": True}, {"link": 1}, {"link": 36}, {"link": -1}])
        == []
    )
    assert len(t) == 1, "only link ids NVML can have (0..35) hold state"
    t.forget("h")
    assert len(t) == 0


@pytest.mark.parametrize(
    "kw",
    [
        {"window_ms": 0},
        {"degrade_windows": 9},
        {"degrade_windows": 0},
        {"clear_windows": 0},
        {"crc_fail_per_s": 0},
    ],
)
def test_config_refuses_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LinkHealthConfig(**kw)
