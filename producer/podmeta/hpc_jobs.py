"""HPC (Slurm) jobs as GPU holders, from dcgm-exporter's ``--hpc-job-mapping-dir`` files.

The format is dcgm-exporter's (``internal/pkg/transformation/hpc.go``), so a site's existing
prolog/epilog scripts work unchanged: one file per GPU in the directory, named by the GPU's index
(``0``, ``1``, ...) or, for a MIG instance, ``<GPU index>.<GPU instance id>`` (``2.1``); each line of
a file is one job id holding that GPU (several lines: several jobs share it). Other names, and
directories, are ignored. dcgm-exporter keeps blank lines as an empty job id; we skip them (an
empty ``hpc_job`` label helps no one). The scheduler's prolog writes a file, its epilog removes it.

Each job becomes an allocation of the GPU: ``namespace`` = ``--hpc-namespace`` (default ``hpc``),
``pod`` = the job id, owner ``HpcJob/<job id>``, ``hpc_job`` = the job id. Chargeback, alerts and the
metrics then attribute to jobs with no further code: per-job cost is ``--by owner`` (or the pod)
in the hpc namespace, metrics carry ``hpc_job`` as dcgm-exporter does.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import Any

_NAME = re.compile(r"^\d+(\.\d+)?$")
DEFAULT_NAMESPACE = "hpc"


def parse_job_file(text: str) -> list[str]:
    """Job ids of one mapping file: one per line, blank lines skipped, order kept, no duplicates."""
    out: list[str] = []
    for line in text.splitlines():
        job = line.strip()
        if job and job not in out:
            out.append(job)
    return out


def read_mapping_dir(path: str) -> dict[str, list[str]]:
    """``{"0": ["1234"], "2.1": ["1240", "1241"]}`` from the directory; {} when it does not exist."""
    out: dict[str, list[str]] = {}
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        if not _NAME.match(entry.name):
            continue
        try:
            if not entry.is_file():
                continue
            with open(entry.path, encoding="utf-8", errors="replace") as f:
                jobs = parse_job_file(f.read())
        except OSError:  # removed by an epilog while we read: the job ended
            continue
        if jobs:
            out[entry.name] = jobs
    return out


def mapping_key(gpu_index: int | None, gpu_instance_id: int | None) -> str | None:
    if gpu_index is None:
        return None
    return f"{gpu_index}.{gpu_instance_id}" if gpu_instance_id is not None else str(gpu_index)


def job_allocation(job: str, namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    return {
        "namespace": namespace,
        "pod": job,
        "container": "",
        "resource_name": None,
        "replica": None,
        "owner_kind": "HpcJob",
        "owner_name": job,
        "labels": {},
        "priority_class": None,
        "metadata_status": None,
        "hpc_job": job,
    }


class HpcJobMap:
    """The mapping directory, re-read at most every ``refresh_s`` (prolog/epilog change it rarely)."""

    def __init__(
        self,
        path: str,
        namespace: str = DEFAULT_NAMESPACE,
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.namespace = namespace
        self.refresh_s = refresh_s
        self._clock = clock
        self._jobs: dict[str, list[str]] = {}
        self._read_at: float | None = None

    def jobs(self) -> dict[str, list[str]]:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self.refresh_s:
            self._jobs = read_mapping_dir(self.path)
            self._read_at = now
        return self._jobs

    def decorate(self, record: dict[str, Any]) -> None:
        """Append the jobs holding ``record``'s GPU (a GpuSample or XidEvent dict) to its allocations."""
        mig = record.get("mig")
        gi = mig.get("gpu_instance_id") if mig else record.get("gpu_instance_id")
        key = mapping_key(record.get("gpu_index"), gi)
        jobs = self.jobs().get(key) if key is not None else None
        if not jobs:
            return
        allocs = list(record.get("allocations") or ())
        have = {a.get("hpc_job") for a in allocs}
        allocs.extend(job_allocation(j, self.namespace) for j in jobs if j not in have)
        record["allocations"] = allocs
