"""The GPU part of a scrape: the line lists of every GPU joined into one chunk per family (pure)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import chain, compress
from operator import is_not, itemgetter

from gpupipe_consumers.metrics.render import Family


class BodyJoiner:
    """Joins the per-GPU line lists (see :mod:`gpupipe_consumers.metrics.render`) family by family.

    It keeps the pieces of the last build in one flat list, GPU-major (the line lists of the GPUs
    one after the other, in scrape order), with the line-list objects they came from. A build
    finds the GPUs whose line list is another object than last time (line lists are replaced,
    never mutated) and copies only those into the flat list, one slice assignment per GPU. Their
    pieces that differ mark their family as changed; only the slots not yet known to have changed
    are compared, in one C-level step per GPU: transposing every line list per scrape and
    comparing every piece with the last build's would cost as much as the joins. The state is
    references only: a pointer per piece and one per GPU, plus the line lists replaced since the
    last build, until the next one.

    A changed family's pieces are its head and value columns, taken from the flat list by two
    strided slices and interleaved by two slice assignments, then joined: C-level copies only, no
    Python work per series. An unchanged family (no piece differs from the last build: renders
    keep the text object of an unchanged reading; equal text counts as unchanged too) keeps its
    chunk object, unjoined, so the HTTP layer's gzip of it is reused too. A family without any
    value has no chunk, header included. When the number of GPUs changes everything is rebuilt.
    Builds are serialized by a lock of its own: the state is updated in place, and a build that
    fails leaves it reset."""

    def __init__(self, families: Sequence[Family]) -> None:
        self.families = tuple(families)
        self._headers = [f.header.encode("utf-8") for f in self.families]
        self._lock = threading.Lock()
        self._lines: list[list[bytes]] = []  # the line-list objects of the last build, in order
        self._flat: list[bytes] = []  # their pieces, one line list after the other
        self._width = 0  # pieces per line list
        self._chunks: dict[int, bytes] = {}  # 2 x family index -> chunk of the last build
        self.reused = 0  # family chunks kept from the build before (for tests and benchmarks)

    def join(self, lines: list[list[bytes]]) -> tuple[bytes, ...]:
        """One chunk per family with at least one line: its HELP/TYPE header, then its lines."""
        if not lines:
            return ()
        with self._lock:
            try:
                return self._join(lines)
            except BaseException:
                self._reset()  # a half-updated state must not be diffed against
                raise

    def _reset(self) -> None:
        self._lines, self._flat, self._width, self._chunks = [], [], 0, {}

    def _join(self, lines: list[list[bytes]]) -> tuple[bytes, ...]:
        n = len(lines)
        prev = self._lines
        w = self._width
        changed: set[int] | None  # changed piece slots; None: every family is built
        if len(prev) != n or not w:
            self._rebuild(lines)
            changed = None
        else:
            changed = set()
            flat = self._flat
            slots = range(w)
            # the slots not known to have changed yet, compared in one C-level step per GPU: most
            # line lists differ from their last build in the same few (value) slots
            pick: itemgetter | None = itemgetter(*slots)
            for p in compress(range(n), map(is_not, lines, prev)):
                new, old = lines[p], prev[p]  # flat holds old's pieces at this position
                if len(new) != w:
                    raise ValueError(f"line list of {len(new)} pieces, not {w}")
                if pick is not None and pick(new) != pick(old):  # equal text is no change either
                    changed.update(compress(slots, map(is_not, new, old)))
                    rest = [s for s in slots if s not in changed]
                    pick = itemgetter(*rest) if rest else None
                start = p * w
                flat[start : start + w] = new
            self._lines = list(lines)
        flat, w = self._flat, self._width
        if not w:  # empty line lists: nothing to show
            return ()
        prev_chunks = self._chunks
        chunks: dict[int, bytes] = {}
        out: list[bytes] = []
        for fam in self.families:
            i = 2 * fam.index
            old = prev_chunks.get(i)
            if old is not None and changed is not None and i not in changed and i + 1 not in changed:
                chunk = old
                self.reused += 1
            else:
                values = flat[i + 1 :: w]
                if not any(values):  # no GPU has a line: no header either
                    continue
                seg: list[bytes] = [b""] * (2 * n + 1)
                seg[0] = self._headers[fam.index]
                seg[1::2] = flat[i::w]
                seg[2::2] = values
                chunk = b"".join(seg)
            chunks[i] = chunk
            out.append(chunk)
        self._chunks = chunks
        return tuple(out)

    def _rebuild(self, lines: list[list[bytes]]) -> None:
        """Start over from these line lists (the GPU set changed): no chunk is reused."""
        self._reset()
        w = len(lines[0])
        flat = list(chain.from_iterable(lines))
        if len(set(map(len, lines))) != 1:
            raise ValueError("line lists of different lengths")
        self._flat, self._width, self._lines = flat, w, list(lines)
