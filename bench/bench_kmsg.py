"""Kernel-log parsing throughput: ``KmsgParser.feed`` over a realistic line mix, one core.

The mix (~300k lines, built in memory, fixed seed): 98 % ordinary kernel lines - the real non-Xid lines
from ``tests/fixtures/kmsg/non_xid_real.txt`` (NVRM banners, NVSwitch, peermem, raw ``/dev/kmsg``
records, syslog/journal/``dmesg -T`` prefixes) plus common generic kernel lines with ``dmesg`` stamps -
and 2 % Xid/SXid lines from ``tests/fixtures/kmsg/xid_real.txt``.

Baseline, timed in the same run: a bare loop doing ``line.split(" ", 1)`` per line.

Prints ``kmsg_parse_lines_per_s ratio=<lines_per_s / 200000> target=1.00`` (target: 200,000 lines/s)
and the absolute figures. Run: ``.venv/bin/python bench/bench_kmsg.py``.
"""

from __future__ import annotations

import random

from common import REPO, best_of, figure, timed

from gpupipe_producer.xid.kmsg_parse import KernelXid, KmsgParser

TARGET_LINES_PER_S = 200_000
N_LINES = 300_000
XID_SHARE = 0.02
REPEATS = 5

FIXTURES = REPO / "tests" / "fixtures" / "kmsg"

GENERIC = [
    "IPv6: ADDRCONF(NETDEV_CHANGE): cali{h}: link becomes ready",
    'audit: type=1400 audit({t}:{n}): apparmor="DENIED" operation="open" profile="cri-containerd" pid={n}',
    "EXT4-fs (nvme0n1p{d}): mounted filesystem with ordered data mode. Quota mode: none.",
    "mlx5_core 0000:{b}:00.0 mlx5_{d}: Port: 1 Link ACTIVE",
    "device veth{h} entered promiscuous mode",
    "cni0: port {d}(veth{h}) entered forwarding state",
    "perf: interrupt took too long ({n} > {n}), lowering kernel.perf_event_max_sample_rate to 79500",
    "nvidia-nvswitch{d}: open (major=510)",
    "TCP: request_sock_TCP: Possible SYN flooding on port {n}. Sending cookies.",
    "kauditd_printk_skb: {d} callbacks suppressed",
    "xfs filesystem being mounted at /var/lib/kubelet/pods/{h}/volumes supports timestamps until 2038",
    "Memory cgroup out of memory: Killed process {n} (python3) total-vm:{n}kB, anon-rss:{n}kB",
]


def _fixture(name: str) -> list[str]:
    text = (FIXTURES / name).read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def build_mix(rng: random.Random, n: int = N_LINES) -> tuple[list[str], int]:
    ordinary = _fixture("non_xid_real.txt")
    xids = _fixture("xid_real.txt")
    lines: list[str] = []
    n_xid = 0
    t = 1000.0
    for _ in range(n):
        t += rng.random() * 0.01
        if rng.random() < XID_SHARE:
            lines.append(rng.choice(xids))
            n_xid += 1
        elif rng.random() < 0.3:
            lines.append(rng.choice(ordinary))
        else:
            body = rng.choice(GENERIC).format(
                h=f"{rng.getrandbits(40):010x}",
                n=rng.randint(1, 99999),
                d=rng.randint(0, 9),
                b=f"{rng.randint(0, 255):02x}",
                t=f"{t:.3f}",
            )
            lines.append(f"[{t:12.6f}] {body}")
    return lines, n_xid


def run_parser(lines: list[str]) -> int:
    parser = KmsgParser()
    feed = parser.feed
    n = 0
    for line in lines:
        if feed(line):
            n += 1
    return n + len(parser.flush())


def run_baseline(lines: list[str]) -> None:
    for line in lines:
        line.split(" ", 1)


def main() -> None:
    lines, n_xid = build_mix(random.Random(20240809))
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    n_events = sum(isinstance(e, KernelXid) for e in events)
    assert n_events == n_xid, (n_events, n_xid)

    parse_s = best_of(REPEATS, lambda: timed(lambda: run_parser(lines)))
    base_s = best_of(REPEATS, lambda: timed(lambda: run_baseline(lines)))
    rate = len(lines) / parse_s
    base_rate = len(lines) / base_s

    print(f"kmsg_parse_lines_per_s ratio={rate / TARGET_LINES_PER_S:.2f} target=1.00", flush=True)
    figure("kmsg_parse_lines_per_s", round(rate))
    figure("baseline_split_lines_per_s", round(base_rate))
    figure("parse_cost_vs_baseline", base_rate / rate, "x slower than line.split")
    figure("lines", len(lines))
    figure("xid_lines", n_xid)
    figure("xid_events", n_events)


if __name__ == "__main__":
    main()
