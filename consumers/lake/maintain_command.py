"""Compact and expire the lake tables (``gpupipe lake maintain``): run it daily, beside the writer.

The policy is :mod:`gpupipe_consumers.lake.maintain`'s: days that ended more than ``--compact-after`` ago
are rewritten as one file per partition when a partition has ``--min-files`` files or more, and
snapshots older than ``--expire-after`` are expired, except the current one and those that carry a
partition's newest offsets, so the writer still resumes exactly once afterwards.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from gpupipe.common.argtypes import positive_duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe_consumers.lake import catalog as lake_catalog
from gpupipe_consumers.lake.command import selected_tables
from gpupipe_consumers.lake.tables import TABLES

USES_KAFKA = False

#: One line for `gpupipe --help`.
HELP = "compact the lake tables and expire old snapshots (run daily)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", default=",".join(t.name for t in TABLES), help="comma-separated tables")
    p.add_argument(
        "--expire-after",
        type=positive_duration_ms,
        default=7 * 86_400_000,
        metavar="DURATION",
        help="expire snapshots older than this (time travel reaches this far back)",
    )
    p.add_argument(
        "--compact-after",
        type=positive_duration_ms,
        default=86_400_000,
        metavar="DURATION",
        help="compact a day once it ended this long ago (days still written to are left alone)",
    )
    p.add_argument(
        "--min-files", type=int, default=4, help="compact a day when a partition of it has this many files"
    )
    lake_catalog.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    names = selected_tables(args.tables)
    if args.min_files < 2:
        raise ConfigError("--min-files must be at least 2")
    # pyiceberg loads here, not with the parser (see gpupipe_consumers.lake.command).
    from gpupipe_consumers.lake.maintain import Policy, maintain
    from gpupipe_consumers.lake.query import load_tables
    from gpupipe_consumers.lake.tables import BY_NAME

    policy = Policy(
        expire_after=timedelta(milliseconds=args.expire_after),
        compact_after=timedelta(milliseconds=args.compact_after),
        min_files=args.min_files,
    )
    tables = load_tables(lake_catalog.open_catalog(args), args.namespace)
    for name in names:
        if name not in tables:
            continue
        r = maintain(tables[name], BY_NAME[name], policy)
        print(
            f"{name}: {r.days_compacted} days compacted ({r.files_before} -> {r.files_after} files), "
            f"{r.snapshots_expired} snapshots expired"
        )
    return 0
