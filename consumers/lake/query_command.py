"""Answer SQL over the lake tables with DuckDB, in process (``gpupipe lake query "SQL"``).

The tables are ``samples``, ``xid_events``, ``alerts`` and ``chargeback_windows`` (docs/lake.md);
``--gpu-hours-last-quarter`` runs the shipped per-namespace GPU-hours query for the previous
calendar quarter. Output is CSV (header first) or JSON lines.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from datetime import UTC, datetime

from gpupipe.common.errors import ConfigError
from gpupipe_consumers.lake import catalog as lake_catalog

USES_KAFKA = False

#: One line for `gpupipe --help`.
HELP = "query the lake tables with SQL (DuckDB, in process)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sql", nargs="?", default=None, help="the SQL; table names as in docs/lake.md")
    p.add_argument(
        "--gpu-hours-last-quarter",
        action="store_true",
        help="GPU-hours per namespace of the previous calendar quarter (chargeback_windows)",
    )
    p.add_argument("--format", choices=["csv", "jsonl"], default="csv")
    lake_catalog.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if bool(args.sql) == bool(args.gpu_hours_last_quarter):
        raise ConfigError("give either SQL or --gpu-hours-last-quarter")
    # DuckDB, pyarrow and pyiceberg load here, not with the parser (see gpupipe_consumers.lake.command).
    from gpupipe_consumers.lake.query import gpu_hours_sql, load_tables, quarter_before, query

    tables = load_tables(lake_catalog.open_catalog(args), args.namespace)
    if args.gpu_hours_last_quarter:
        start, end = quarter_before(datetime.now(UTC))
        rows = [
            {"namespace": k, "gpu_hours": v} for k, v in sorted(gpu_hours_sql(tables, start, end).items())
        ]
    else:
        try:
            rows = query(tables, args.sql).to_pylist()
        except Exception as exc:  # duckdb's parser and binder errors: one line, exit 2
            raise ConfigError(f"query failed: {exc}") from exc
    if args.format == "jsonl":
        for r in rows:
            print(json.dumps(r, default=str))
    else:
        w = csv.writer(sys.stdout)
        if rows:
            w.writerow(rows[0].keys())
        for r in rows:
            w.writerow(r.values())
    return 0
