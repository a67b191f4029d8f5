"""A node's GPU topology as the ``GpuTopology`` record gives it: NVLink domains and a link fault's blast
radius. Pure: record dicts in, sets and ids out (the producer fills ``nvlink_domain`` with
:func:`nvlink_domains`; the recipe and the alerts read the record with :func:`blast_radius`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["blast_radius", "cpu_list", "nvlink_domains"]


def nvlink_domains(indices: Iterable[int], pairs: Iterable[Mapping[str, Any]]) -> dict[int, int | None]:
    """``gpu_index -> domain``: the lowest index a GPU reaches over NVLink peer to peer (``nvlink_p2p``
    true, directly or through other GPUs); None for a GPU that reaches none."""
    parent = {i: i for i in indices}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    linked: set[int] = set()
    for p in pairs:
        a, b = p["gpu_a"], p["gpu_b"]
        if p.get("nvlink_p2p") is True and a in parent and b in parent:
            linked |= {a, b}
            ra, rb = root(a), root(b)
            parent[max(ra, rb)] = min(ra, rb)
    return {i: (root(i) if i in linked else None) for i in parent}


def blast_radius(topology: Mapping[str, Any], uuid: str) -> set[str]:
    """UUIDs of the other GPUs of the node that share ``uuid``'s NVLink domain: those whose NVLink
    traffic a fault on that GPU's links can hit. Empty for a GPU without NVLink peers or unknown."""
    gpus = topology.get("gpus") or ()
    domain = next((g.get("nvlink_domain") for g in gpus if g["uuid"] == uuid), None)
    if domain is None:
        return set()
    return {g["uuid"] for g in gpus if g.get("nvlink_domain") == domain and g["uuid"] != uuid}


def cpu_list(words: Iterable[int], word_bits: int = 64) -> str:
    """A CPU bitmask (lowest CPUs in the first word) in the Linux cpulist form: ``0-55,112-167``."""
    cpus = [w * word_bits + b for w, word in enumerate(words) for b in range(word_bits) if int(word) >> b & 1]
    runs: list[str] = []
    start = prev = None
    for c in cpus:
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = c
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(runs)
