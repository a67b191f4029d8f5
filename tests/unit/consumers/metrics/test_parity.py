"""Family-by-family parity with dcgm-exporter's exposition for the same GPU state (pure).

Fixtures (tests/fixtures/metrics/dcgm-exporter/): parity_states.json (a MIG node, a time-shared node,
a whole GPU with XID history), parity-counters.csv (rows of dcgm-exporter's default CSV) and
expected/<node>.prom (dcgm-exporter's exposition for those GPUs; how it was written is in its header).
Before: the MIG parent had its own series (FB counted twice), the shared T4 had one copy per pod
(power counted twice), and XID_ERRORS lacked err_code/err_msg.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpupipe_consumers.metrics.collectors_csv import load_counters
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from gpupipe_schemas import catalog
from tests.paths import TESTS

FIX = TESTS / "fixtures" / "metrics" / "dcgm-exporter"
STATES = json.loads((FIX / "parity_states.json").read_text())
NODES = sorted(p.stem for p in (FIX / "expected").glob("*.prom"))


def complete_sample(rec: dict[str, Any]) -> dict[str, Any]:
    full: dict[str, Any] = {f["name"]: f.get("default") for f in catalog.current("GpuSample").raw["fields"]}
    full.update(
        allocations=[], processes=[], gpu_lost=False, interval_ms=1000, timestamp_ms=STATES["timestamp_ms"]
    )
    full.update(rec)
    return full


def complete_xid(ev: dict[str, Any]) -> dict[str, Any]:
    full: dict[str, Any] = {f["name"]: f.get("default") for f in catalog.current("XidEvent").raw["fields"]}
    full.update(message="", allocations=[])
    full.update(ev)
    return full


def gpupipe_store(options: RenderOptions | None = None) -> SeriesStore:
    store = SeriesStore(load_counters(FIX / "parity-counters.csv"), options=options, stale_after_s=1e9)
    now = STATES["timestamp_ms"] / 1000
    for rec in STATES["samples"]:
        store.apply_sample(complete_sample(rec), 0, now)
    for ev in STATES["xid_events"]:
        store.apply_xid(complete_xid(ev), 0, now)
    return store


def families(text: str, node: str) -> dict[str, tuple[list[str], set[str]]]:
    """DCGM families of one node: (HELP/TYPE lines, sample lines)."""
    out: dict[str, tuple[list[str], set[str]]] = {}
    for ln in text.splitlines():
        if ln.startswith(("# HELP DCGM_", "# TYPE DCGM_")):
            out.setdefault(ln.split(" ")[2], ([], set()))[0].append(ln)
        elif ln.startswith("DCGM_") and f'Hostname="{node}"' in ln:
            out.setdefault(ln.split("{", 1)[0], ([], set()))[1].add(ln)
    return {k: v for k, v in out.items() if v[1]}


@pytest.mark.parametrize("node", NODES)
def test_same_series_as_dcgm_exporter(node: str) -> None:
    assert NODES == ["mig-node", "shared-node", "whole-node"]
    text = gpupipe_store().render(STATES["timestamp_ms"] / 1000).decode()
    ours = families(text, node)
    theirs = families((FIX / "expected" / f"{node}.prom").read_text(), node)
    assert sorted(ours) == sorted(theirs)
    for name, (meta, lines) in theirs.items():
        assert ours[name][0] == meta, name
        assert ours[name][1] == lines, name


def test_the_old_layouts_differ_from_dcgm_exporter() -> None:
    """The parity above is not vacuous: gpupipe's former layouts give other series."""
    now = STATES["timestamp_ms"] / 1000
    both = families(gpupipe_store(RenderOptions(mig_layout="gpu+instances")).render(now).decode(), "mig-node")
    assert len(both["DCGM_FI_DEV_FB_USED"][1]) == 3  # parent + 2 instances: FB counted twice
    copies = families(gpupipe_store(RenderOptions(virtual_gpus=True)).render(now).decode(), "shared-node")
    assert len(copies["DCGM_FI_DEV_POWER_USAGE"][1]) == 3  # the shared T4 once per pod, plus the idle T4
