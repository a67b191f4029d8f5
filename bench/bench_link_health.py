"""NVLink link health: false alarms on long healthy traces, lead time on synthetic degradations.

Both run :class:`~gpupipe_consumers.alerts.engine.link_health.LinkHealthTracker` with its defaults (the
alerts service's) on per-link counters as ``GpuSample.nvlink_link_counters`` carries them, one sample a
minute per GPU with +-2 s jitter and 1 % of samples missing (the tracker judges one-minute windows; the
service reads the counters every 10 s). Fixed seed.

Healthy noise, per link (an assumed model, not a field measurement; docs/alerts.md, "NVLink link
health"): CRC bursts at 6 a day (Poisson), each 1 to ~30 CRC errors with as many replays; a cluster of
3 bursts within 3 minutes once a week; a link recovery once a month; a driver reload (every counter back
to 0) once in 10 days per GPU.

Degradation: from a random onset the link's CRC error rate grows as ``0.5/min * exp(t / tau)``, ``tau``
log-uniform in 2..30 min, with replays alike and a recovery per ~200 errors, on top of the noise; the
link fails (goes down) when the rate reaches 100/s, DCGM's NVLink FAIL threshold. Lead time: failure
minus the tracker's ``degrading`` change.

Prints ``link_health_false_alarms ratio=<budget / rate> target=1.00`` where rate is false ``degrading``
or ``failed`` changes per link-day (when none is seen: the 95 % upper bound, 3 / link-days) and the
budget is an absolute 0.001 per link-day (one a week on an 8-GPU HGX node's 144 links), and
``link_health_lead_time ratio=<10th percentile lead / 5 min> target=1.00``. Run:
``.venv/bin/python bench/bench_link_health.py`` (about a minute).
"""

from __future__ import annotations

import math
import os
import random
import time

from common import figure, ratio_line

from gpupipe_consumers.alerts.engine.link_health import LinkHealthTracker

MIN = 60_000
DAY_MIN = 1440
LINKS = 18
FA_BUDGET_PER_LINK_DAY = 0.001
LEAD_TARGET_MIN = 5.0
HEALTHY_GPU_DAYS = int(os.environ.get("LH_GPU_DAYS", "400"))  # x 18 links = 7,200 link-days
DEGRADATIONS = int(os.environ.get("LH_DEGRADATIONS", "300"))
SEED = 20261207

BURSTS_PER_DAY = 6.0
CLUSTERS_PER_DAY = 1 / 7
RECOVERIES_PER_DAY = 1 / 30
RELOADS_PER_DAY = 1 / 10
FAIL_PER_MIN = 100 * 60


def _burst(rng: random.Random) -> int:
    return min(30, 1 + int(rng.expovariate(1 / 5)))


class Gpu:
    """One GPU's 18 links' counters, sampled once a minute."""

    def __init__(self, rng: random.Random, tracker: LinkHealthTracker, name: str) -> None:
        self.rng, self.t, self.name = rng, tracker, name
        self.c = [{"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0} for _ in range(LINKS)]
        self.up = [True] * LINKS
        self.pending: list[tuple[int, int]] = []  # (minute, link) of the rest of a burst cluster

    def noise(self, minute: int) -> None:
        rng, p = self.rng, 1 / DAY_MIN
        if rng.random() < RELOADS_PER_DAY * p:
            for c in self.c:
                for k in c:
                    c[k] = 0
        for link, c in enumerate(self.c):
            if rng.random() < BURSTS_PER_DAY * p:
                n = _burst(rng)
                c["crc_flit"] += n
                c["replay"] += n
            if rng.random() < RECOVERIES_PER_DAY * p:
                c["recovery"] += 1
            if rng.random() < CLUSTERS_PER_DAY * p:
                self.pending += [(minute + rng.randint(0, 3), link) for _ in range(3)]
        for item in [x for x in self.pending if x[0] <= minute]:
            self.pending.remove(item)
            n = _burst(self.rng)
            self.c[item[1]]["crc_flit"] += n
            self.c[item[1]]["replay"] += n

    def sample(self, minute: int) -> list[tuple[int, str]]:
        if self.rng.random() < 0.01:
            return []  # a sample lost on the way
        ts = minute * MIN + self.rng.randint(-2000, 2000)
        links = [{"link": i, "up": self.up[i], "peer": "nvswitch", **c} for i, c in enumerate(self.c)]
        return [(ch.link, ch.state) for ch in self.t.observe("node", self.name, ts, links)]


def healthy(rng: random.Random) -> tuple[int, float, int]:
    """(false changes, link-days, DCGM-style warnings: any CRC/replay in a window) on healthy traces."""
    t = LinkHealthTracker()
    false = dcgm_warn = 0
    for g in range(HEALTHY_GPU_DAYS):
        gpu = Gpu(rng, t, f"gpu-{g}")
        before = [sum(c.values()) for c in gpu.c]
        for minute in range(DAY_MIN):
            gpu.noise(minute)
            false += sum(1 for _, state in gpu.sample(minute) if state != "healthy")
            now = [sum(c.values()) for c in gpu.c]
            dcgm_warn += sum(1 for a, b in zip(before, now, strict=True) if b > a)
            before = now
        t.forget("node", f"gpu-{g}")
    return false, HEALTHY_GPU_DAYS * LINKS, dcgm_warn


def degradation(rng: random.Random, n: int) -> float | None:
    """Lead in minutes of one degradation (None: no warning before the failure)."""
    t = LinkHealthTracker()
    gpu = Gpu(rng, t, f"deg-{n}")
    tau = math.exp(rng.uniform(math.log(2), math.log(30)))
    onset = 120 + rng.randint(0, 60)
    link = rng.randrange(LINKS)
    warned: int | None = None
    for minute in range(100_000):
        gpu.noise(minute)
        if minute >= onset:
            rate = 0.5 * math.exp((minute - onset) / tau)
            if rate >= FAIL_PER_MIN:
                gpu.up[link] = False
                gpu.sample(minute)
                return None if warned is None else float(minute - warned)
            errors = _poisson(rng, rate)
            c = gpu.c[link]
            c["crc_flit"] += errors
            c["replay"] += errors
            c["recovery"] += 1 if errors and rng.random() < errors / 200 else 0
        for changed, state in gpu.sample(minute):
            if changed == link and state == "degrading" and warned is None:
                warned = minute
    raise AssertionError("a degradation never failed")


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 30:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    n, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


def main() -> None:
    rng = random.Random(SEED)
    t0 = time.perf_counter()
    false, link_days, dcgm_warn = healthy(rng)
    rate = false / link_days
    bound = 3 / link_days
    figure("healthy_link_days", link_days)
    figure("false_alarms", false)
    figure("false_alarms_per_link_day", rate)
    figure("upper_bound_95_per_link_day", bound if false == 0 else rate)
    figure("dcgm_style_warnings_per_link_day", dcgm_warn / link_days, "(any CRC/replay rise in a window)")
    ratio_line("link_health_false_alarms", FA_BUDGET_PER_LINK_DAY / max(rate, bound), 1.0)
    leads = [degradation(rng, i) for i in range(DEGRADATIONS)]
    warned = sum(1 for x in leads if x is not None)
    got = sorted(0.0 if x is None else x for x in leads)  # a miss counts as no lead
    p10 = got[len(got) // 10]
    figure("degradations", DEGRADATIONS)
    figure("warned_before_failure", warned)
    figure("lead_min_minutes", got[0])
    figure("lead_p10_minutes", p10)
    figure("lead_median_minutes", got[len(got) // 2])
    figure("elapsed_s", time.perf_counter() - t0)
    ratio_line("link_health_lead_time", p10 / LEAD_TARGET_MIN, 1.0)


if __name__ == "__main__":
    main()
