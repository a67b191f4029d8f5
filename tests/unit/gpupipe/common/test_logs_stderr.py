"""The log handler writes to the stderr of the moment ("Logging error ... I/O operation on
closed file" from consumer threads still logging after pytest had closed its captured stderr)."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from gpupipe.common.logs import StderrHandler


def test_a_record_after_stderr_was_replaced_and_closed_goes_to_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = StderrHandler()
    log = logging.getLogger("gpupipe.test-stderr")
    log.propagate = False
    log.addHandler(handler)
    errors: list[logging.LogRecord] = []
    monkeypatch.setattr(handler, "handleError", errors.append)  # "--- Logging error ---" path
    try:
        log.warning("one")
        first.close()  # the capture ends; a thread logs on
        monkeypatch.setattr(sys, "stderr", second)
        log.warning("two")
    finally:
        log.removeHandler(handler)
    assert errors == []
    assert second.getvalue().splitlines() == ["two"]
