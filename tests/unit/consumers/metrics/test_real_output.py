"""gpupipe's exposition against real dcgm-exporter output, line for line (pure).

Fixtures (tests/fixtures/metrics/dcgm-exporter/real/, sources in each file's header): scrapes of
dcgm-exporter quoted in public places, verbatim, and real_states.json, the GpuSample state behind
each (values read back from the output). For each, the counters CSV is the one the output itself
shows (its HELP/TYPE lines), the GPUs are fed to a SeriesStore, and every real line must come out the
same: names, HELP, TYPE, label names, label order, label values, value text. This checks the
template-derived fixtures of test_metrics_parity.py against what dcgm-exporter really prints.

Known, documented differences (docs/metrics.md, compatibility table) are the only exceptions, each
asserted:
``pod_uid=""`` (GPU Operator's --kubernetes-enable-pod-uid; an empty label is no label to Prometheus)
and DCGM_FI_DEV_VGPU_LICENSE_STATUS (never read by the node agent: absent, where DCGM prints 0 on
bare metal).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gpupipe_consumers.metrics.collectors_csv import parse_counters
from gpupipe_consumers.metrics.render import RenderOptions
from gpupipe_consumers.metrics.store import SeriesStore
from tests.paths import TESTS
from tests.unit.consumers.metrics.test_parity import complete_sample

REAL = TESTS / "fixtures" / "metrics" / "dcgm-exporter" / "real"
STATES = json.loads((REAL / "real_states.json").read_text())
_META = re.compile(r"^# (HELP|TYPE) (\S+) ?(.*)$")


def meta_and_lines(text: str) -> tuple[dict[str, dict[str, str]], dict[str, set[str]]]:
    """HELP/TYPE per family and sample lines per family of an exposition (DCGM_* only)."""
    meta: dict[str, dict[str, str]] = {}
    lines: dict[str, set[str]] = {}
    for ln in text.splitlines():
        m = _META.match(ln)
        if m and m[2].startswith("DCGM_"):
            meta.setdefault(m[2], {})[m[1]] = m[3]
        elif ln.startswith("DCGM_"):
            lines.setdefault(ln.split("{", 1)[0], set()).add(ln)
    return meta, lines


def csv_of(meta: dict[str, dict[str, str]], lines: dict[str, set[str]]) -> str:
    """The counters CSV behind an output: its families with their TYPE and HELP (a family the
    excerpt shows without its HELP gets dcgm-exporter's stock text), and the driver label row when
    its lines carry that label."""
    stock = {"DCGM_FI_DEV_FB_USED": ("gauge", "Framebuffer memory used (in MiB).")}
    rows = []
    for name in dict.fromkeys([*meta, *lines]):
        m = meta.get(name) or dict(zip(("TYPE", "HELP"), stock[name], strict=True))
        rows.append(f'{name}, {m["TYPE"]},"{m["HELP"]}"')
    if any("DCGM_FI_DRIVER_VERSION=" in ln for ls in lines.values() for ln in ls):
        rows.append("DCGM_FI_DRIVER_VERSION, label, Driver Version")
    return "\n".join(rows) + "\n"


def ours(name: str, csv: str) -> str:
    state: dict[str, Any] = STATES[name]
    store = SeriesStore(parse_counters(csv), options=RenderOptions(**state["options"]), stale_after_s=1e9)
    now = STATES["timestamp_ms"] / 1000
    for rec in state["samples"]:
        store.apply_sample(complete_sample({**rec, "timestamp_ms": STATES["timestamp_ms"]}), 0, now)
    return store.render(now).decode()


def test_gpu_operator_scrape_of_a_whole_gpu_with_a_pod() -> None:
    text = (REAL / "gpu-operator-rtx4000.prom").read_text()
    assert text.count('pod_uid=""') == 25  # the only label we do not print (it is empty)
    meta, theirs = meta_and_lines(text.replace(',pod_uid=""', ""))
    got_meta, got = meta_and_lines(ours("gpu-operator-rtx4000", csv_of(meta, theirs)))
    assert len(theirs) == 25
    absent = {"DCGM_FI_DEV_VGPU_LICENSE_STATUS"}  # documented: not read by the node agent
    assert set(got) == set(theirs) - absent
    for name in got:
        assert got_meta[name] == meta[name], name
        assert got[name] == theirs[name], name


def test_mig_and_whole_gpus_of_one_node_with_the_hostname_label() -> None:
    """MIG as dcgm-exporter's default -d f: each instance carries its pod and its parent GPU's
    temperature; no parent series; no decoder/encoder line for an instance; 4.8.3's ``hostname``;
    a HELP with a non-ASCII character."""
    meta, theirs = meta_and_lines((REAL / "pr736-mig-a30.prom").read_text())
    got_meta, got = meta_and_lines(ours("pr736-mig-a30", csv_of(meta, theirs)))
    assert sum(len(v) for v in theirs.values()) == 8
    for name, ls in theirs.items():
        if name in meta:
            assert got_meta[name] == meta[name], name
        assert ls <= got[name], (name, ls - got[name])
    for complete in ("DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_ENC_UTIL"):
        assert got[complete] == theirs[complete]
    temps = got["DCGM_FI_DEV_GPU_TEMP"]
    assert len(temps) == 4 and all("GPU_I_ID" in ln for ln in temps if "A30" in ln)  # 3 instances + RTX
