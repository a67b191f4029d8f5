"""A service's start: the moment the process started, and the start-up and shutdown flags.

Waiting for Kafka is :mod:`gpupipe.kafka.ready`; the shutdown deadline is
:mod:`gpupipe.lifecycle.shutdown`; the run sequence is :mod:`gpupipe.lifecycle.runner`.
"""

from __future__ import annotations

import argparse
import time

from gpupipe.lifecycle.shutdown import DEFAULT_SHUTDOWN_S

_START_MS = int(time.time() * 1000)


def mark_start(now_ms: int | None = None) -> None:
    """Record when the service started (the CLI calls this first thing; tests may pin it)."""
    global _START_MS
    _START_MS = int(time.time() * 1000) if now_ms is None else now_ms


def process_start_ms() -> int:
    return _START_MS


# -- flags -------------------------------------------------------------------------------------------
def add_arguments(
    p: argparse.ArgumentParser, *, startup_default: str | None = "0", unset_means: str = ""
) -> None:
    """``--startup-timeout`` and ``--shutdown-timeout``.

    `startup_default` None leaves the default to the command, which says in `unset_means` what it
    then does (the producer: 10s for a --duration job, else for ever); `--help` adds the rest."""
    from gpupipe.common.argtypes import duration_ms

    g = p.add_argument_group("start-up and shutdown")
    g.add_argument(
        "--startup-timeout",
        type=duration_ms,
        default=None if startup_default is None else duration_ms(startup_default),
        metavar="DURATION",
        help="give up (exit 3) when Kafka and the topics are not usable within this time; 0 waits for "
        "ever, answering 503 on /healthz meanwhile" + (f" (default: {unset_means})" if unset_means else ""),
    )
    g.add_argument(
        "--shutdown-timeout",
        type=duration_ms,
        default=round(DEFAULT_SHUTDOWN_S * 1000),
        metavar="DURATION",
        help="exit within this time of SIGTERM, broker up or down",
    )
