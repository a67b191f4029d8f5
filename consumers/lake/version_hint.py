"""``metadata/version-hint.text`` beside a table's metadata files, naming the current one.

Readers without a catalog (DuckDB's ``iceberg_scan('<table dir>')``) find a table's newest metadata
file through it. A SQL or REST catalog never writes it, so the lake does after each of its commits.
The hint is the metadata file's name without ``.metadata.json`` (``00012-<uuid>``): DuckDB tries
``v<hint>.metadata.json`` then ``<hint>.metadata.json``. Best effort: a hint that cannot be written
is logged, never fails the commit (the catalog stays the source of truth)."""

from __future__ import annotations

import logging

from pyiceberg.table import Table

from gpupipe.common.logs import fields

log = logging.getLogger(__name__)

HINT = "version-hint.text"
SUFFIX = ".metadata.json"


def hint_of(metadata_location: str) -> tuple[str, str]:
    """(the hint file's location, its content) for a table's current metadata file."""
    folder, _, name = metadata_location.rpartition("/")
    return f"{folder}/{HINT}", name.removesuffix(SUFFIX)


def write_version_hint(table: Table) -> None:
    """Point ``version-hint.text`` at the table's current metadata file (after a commit)."""
    location, content = hint_of(table.metadata_location)
    try:
        with table.io.new_output(location).create(overwrite=True) as out:
            out.write(content.encode())
    except Exception as exc:  # storage: the commit itself succeeded, readers use the catalog
        log.warning("lake version hint not written", extra=fields(location=location, error=str(exc)))
