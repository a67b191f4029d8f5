"""A client call bounded by a deadline: :func:`with_deadline` raises :class:`StuckCallError` instead
of hanging on the few librdkafka calls that can block past their own timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpupipe.common.errors import GpupipeError

T = TypeVar("T")


class StuckCallError(GpupipeError):
    """A client call did not return within its deadline (see :func:`with_deadline`)."""


def with_deadline(
    fn: Callable[..., T], deadline_s: float, what: str, stop: threading.Event | None = None
) -> Callable[..., T]:
    """``fn`` run in a helper thread that the caller waits on for at most ``deadline_s``.

    For the few librdkafka calls that can block past their own timeout (send_offsets_to_transaction
    with the group coordinator gone, confluentinc/librdkafka#5456): the caller gets
    StuckCallError instead of hanging, and replaces the client. The stuck thread is left behind
    (a daemon; it cannot be interrupted) along with the abandoned client. A set `stop` ends the
    wait early (the service is shutting down: it must not wait out the deadline)."""

    def call(*args: Any) -> T:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=target, name=f"deadline:{what}", daemon=True)
        t.start()
        end = time.monotonic() + deadline_s
        while t.is_alive() and time.monotonic() < end:
            t.join(0.1)
            if stop is not None and stop.is_set() and t.is_alive():
                raise StuckCallError(f"{what} still running when the service was asked to stop")
        if t.is_alive():
            raise StuckCallError(f"{what} did not return within {deadline_s:g}s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return call
