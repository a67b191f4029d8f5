"""The open alerts page end to end: real broker, the real `gpupipe alerts` process, real headless chromium.

Two XIDs on two nodes and GPUs go to a real ``gpu.xid.v1``; the service serves ``/alerts`` and
``/alerts.json``; Debian's chromium loads the page from the service as a person's browser would.
Each alert's row in the DOM chromium built must show its node, GPU and pod (a hostile pod name as
text, not as a script), the screenshot must not be blank, and the JSON must list the same alerts in
the same order.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gpupipe.kafka import topics
from tests.integration.browser_util import colour_stats, dump_dom, screenshot
from tests.integration.consumers.alerts.test_service import (
    AlertsProcess,
    _topics,
    produce,
    wait_until,
    xid_event,
)

pytestmark = pytest.mark.integration

HOSTILE_POD = "eval-<script>document.title='owned'</script>"


def _json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_open_alerts_page_in_chromium(kafka: str, topic_prefix: str, tmp_path: Path) -> None:
    t = _topics(kafka, topic_prefix)
    svc = AlertsProcess(kafka, topic_prefix, tmp_path, "--no-health-signals").start()
    try:
        now = int(time.time() * 1000)
        a = xid_event("node-a", "0000:18:00", 79, now, uuid="GPU-aaaa-0001", gpu_index=1)
        b = xid_event("node-b", "0000:3b:00", 13, now + 10, gpu_index=3, pid=7, process_name="python3")
        b["allocations"] = [
            {
                "namespace": "team-b",
                "pod": HOSTILE_POD,
                "container": "main",
                "resource_name": None,
                "replica": None,
            }
        ]
        produce(kafka, t[topics.XID], "XidEvent", [a, b])
        base = f"http://127.0.0.1:{svc.port}"
        doc = wait_until(
            lambda: (d := _json(base + "/alerts.json"))["open_alerts"] == 2 and d,
            30,
            "two open alerts in /alerts.json",
            interval_s=0.5,
        )

        dom = dump_dom(base + "/alerts", tmp_path / "profile")
        assert "<title>gpupipe: open alerts (2)</title>" in dom
        assert "owned" not in re.search(r"<title>(.*?)</title>", dom).group(1)  # type: ignore[union-attr]
        rows = re.findall(r'<tr data-alert-id="([0-9a-f]+)">(.*?)</tr>', dom, re.S)
        assert [r[0] for r in rows] == [x["alert_id"] for x in doc["alerts"]]  # same alerts, same order
        by_node = {x["node"]: x for x in doc["alerts"]}
        assert set(by_node) == {"node-a", "node-b"}
        cells = dict(rows)
        row_a, row_b = cells[by_node["node-a"]["alert_id"]], cells[by_node["node-b"]["alert_id"]]
        assert '<td class="node">node-a</td>' in row_a and '<td class="node">node-b</td>' in row_b
        assert "GPU 1" in row_a and "GPU-aaaa-0001" in row_a and "0000:18:00.0" in row_a
        assert "GPU 3" in row_b and "0000:3b:00.0" in row_b
        assert '<li class="pod">team-a/train-node-a/main</li>' in row_a
        # the hostile name is text a person reads, never an element chromium ran
        assert "team-b/eval-&lt;script&gt;document.title='owned'&lt;/script&gt;/main" in row_b
        assert "<script" not in dom
        for row in (row_a, row_b):
            assert re.search(r'<td class="age">\d+s</td>', row) and 'class="drain"' in row

        assert by_node["node-a"]["gpu"] == {"uuid": "GPU-aaaa-0001", "index": 1, "pci_bus_id": "0000:18:00.0"}
        assert by_node["node-b"]["gpu"]["pci_bus_id"] == "0000:3b:00.0"
        assert by_node["node-b"]["pods"] == [{"namespace": "team-b", "pod": HOSTILE_POD, "container": "main"}]
        assert by_node["node-a"]["first_seen_ms"] == now and by_node["node-a"]["occurrences"] == 1

        png = tmp_path / "alerts.png"
        screenshot(base + "/alerts", png, tmp_path / "profile", size="1280,700")
        distinct, dominant = colour_stats(png)
        assert distinct > 20 and dominant < 0.95, (distinct, dominant)  # a table drawn, not a blank page
    finally:
        svc.stop()
