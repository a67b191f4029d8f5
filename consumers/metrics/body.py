"""The GPU part of a scrape: the line lists of every GPU joined into one chunk per family (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_

from gpupipe_consumers.metrics.render import Family


class BodyJoiner:
    """Joins the per-GPU line lists (see :mod:`gpupipe_consumers.metrics.render`) family by family.

    ``zip(*lines)`` turns the line lists into one column per slot; a family's pieces are its head
    column and value column interleaved by two slice assignments, then joined: C-level copies
    only, no Python work per series. A family whose pieces are all the very objects of the
    previous build (no GPU's line changed: renders keep the text object of an unchanged reading)
    keeps its chunk object, unjoined, so the HTTP layer's gzip of it is reused too. Not for
    concurrent use with itself except as the store uses it: the last build's state is replaced in
    one assignment, so a concurrent build compares with one build or the other, both right."""

    def __init__(self, families: Sequence[Family]) -> None:
        self.families = tuple(families)
        self._headers = [f.header.encode("utf-8") for f in self.families]
        # the columns and family chunks of the last build (a chunk is kept while its lines are)
        self._last: tuple[list[tuple[bytes, ...]], dict[int, bytes]] = ([], {})
        self.reused = 0  # family chunks kept from the build before (for tests and benchmarks)

    def join(self, lines: list[list[bytes]]) -> tuple[bytes, ...]:
        """One chunk per family with at least one line: its HELP/TYPE header, then its lines."""
        if not lines:
            return ()
        cols = list(zip(*lines, strict=True))
        n = len(lines)
        prev_cols, prev_chunks = self._last
        same_gpus = len(prev_cols) == len(cols) and bool(prev_cols) and len(prev_cols[0]) == n
        out: list[bytes] = []
        chunks: dict[int, bytes] = {}
        for fam in self.families:
            i = 2 * fam.index
            heads, values = cols[i], cols[i + 1]
            old = prev_chunks.get(i) if same_gpus else None
            if (
                old is not None
                and all(map(is_, values, prev_cols[i + 1]))
                and all(map(is_, heads, prev_cols[i]))
            ):
                chunk = old
                self.reused += 1
            elif not any(values):  # no GPU has a line: no header either
                continue
            else:
                seg: list[bytes] = [b""] * (2 * n + 1)
                seg[0] = self._headers[fam.index]
                seg[1::2] = heads
                seg[2::2] = values
                chunk = b"".join(seg)
            chunks[i] = chunk
            out.append(chunk)
        self._last = (cols, chunks)
        return tuple(out)
