"""A stop event that a thread blocked in ``poll(2)`` notices at once.

Why: a kernel-log reader that wakes 10 times a second (a ``select`` with a 100 ms timeout, then a
look at a stop :class:`threading.Event`) only to notice a stop that almost never comes spends about
4 ms of CPU per second for nothing. With :class:`WakeEvent` it blocks on its file
descriptor *and* this event's descriptor, without a timeout: ``set()`` makes the latter readable.

It is a :class:`threading.Event` too, so every other thread of the agent keeps using
``wait(timeout)`` / ``is_set()`` on the same object.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref


class WakeEvent(threading.Event):
    """``threading.Event`` whose ``set()`` also makes :meth:`fileno` readable (an eventfd)."""

    def __init__(self) -> None:
        super().__init__()
        eventfd = getattr(os, "eventfd", None)
        if eventfd is not None:  # Linux: one descriptor
            self._rfd = self._wfd = eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            fds = (self._rfd,)
        else:  # elsewhere a self-pipe
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
            fds = (self._rfd, self._wfd)
        weakref.finalize(self, _close, fds)

    def fileno(self) -> int:
        """Readable while the event is set."""
        return self._rfd

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # full (already readable) or closed at interpreter exit
            os.write(self._wfd, (1).to_bytes(8, "little"))

    def clear(self) -> None:
        super().clear()
        try:
            while os.read(self._rfd, 8):
                pass
        except OSError:  # drained
            pass


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
