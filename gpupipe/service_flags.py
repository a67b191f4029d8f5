"""The flags that every service declares alike, each declared once.

Where a service serves its own ``/metrics`` and ``/healthz``, whether it creates missing topics, and
where a new consumer group starts: one name, default and help for all, so a fix to one cannot miss
the others. A service says only what differs (what its port serves, what its input is)."""

from __future__ import annotations

import argparse


def add_listen(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, serves: str = "/metrics") -> None:
    """``--listen``: off unless given (the producer and consumers serve their own metrics there)."""
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help=f"address of {serves} and /healthz")


def add_create_topics(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--create-topics`` / ``--no-create-topics``: on, so a fresh cluster needs no set-up step."""
    p.add_argument(
        "--create-topics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="create missing topics with default partitions and retention",
    )


def add_from_beginning(
    p: argparse.ArgumentParser | argparse._ArgumentGroup, *, what: str = "records"
) -> None:
    """``--from-beginning``: where a consumer group without committed offsets starts."""
    p.add_argument(
        "--from-beginning",
        action="store_true",
        help=f"a new consumer group starts at the oldest retained {what} instead of the newest",
    )
