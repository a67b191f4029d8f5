"""One daemon thread per GPU, so a GPU whose NVML calls hang delays nobody else.

Why not ``concurrent.futures``: its worker threads are joined at interpreter exit, and an NVML call
blocked in the driver cannot be cancelled, so one hung GPU would keep a stopped agent from ever
exiting. These threads are daemons; a job still running when the source shuts down is abandoned.

A worker runs at most one job at a time; the caller does not submit to a busy worker (the GPU is
then "stalled": reported, and left out of the poll until its call returns).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Job:
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class GpuWorker:
    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.job: Job | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done.is_set()

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        self.job = job
        self._q.put(job)
        return job

    def close(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.result = job.fn()
            except BaseException as exc:  # handed to the caller, like a future
                job.error = exc
            finally:
                job.done.set()
