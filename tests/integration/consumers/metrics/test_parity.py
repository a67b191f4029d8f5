"""NVIDIA's dashboard through a real Prometheus: gpupipe and dcgm-exporter give the same numbers.

One Prometheus scrapes `gpupipe metrics` (a real HTTP server over a store fed with
tests/fixtures/metrics/dcgm-exporter/parity_states.json) and dcgm-exporter's exposition for the same
GPUs (expected/<node>.prom, served as three exporters, one per node). Each job names its series'
`instance` after the node with a prefix, so every panel of NVIDIA's dashboard can be run for one node
and one source. For the MIG node and the shared-GPU node (and the whole-GPU node) every panel returns
the same values from both: no double count of a MIG GPU's memory, no over-count of a shared GPU's
power or temperature.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpupipe_consumers.metrics.http import make_metrics_server
from tests.conftest import free_port
from tests.integration.consumers.metrics.test_prometheus import dashboard_panels, grafana_escape, substitute
from tests.integration.metrics_helpers import Prometheus, wait_for
from tests.unit.consumers.metrics.test_parity import FIX, NODES, gpupipe_store

pytestmark = pytest.mark.integration


def serve_files(files: dict[str, bytes]) -> ThreadingHTTPServer:
    """A stand-in dcgm-exporter per node: GET /<node> answers that node's expected exposition."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path.strip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, args=(0.1,), daemon=True).start()
    return srv


def job(name: str, target: str, prefix: str, path: str = "/metrics") -> dict[str, Any]:
    return {
        "job_name": name,
        "honor_labels": True,
        "metrics_path": path,
        "static_configs": [{"targets": [target]}],
        "metric_relabel_configs": [
            {
                "source_labels": ["Hostname"],
                "regex": "(.+)",
                "target_label": "instance",
                "replacement": f"{prefix}:$1",
            }
        ],
    }


def values(prom: Prometheus, q: str) -> list[float]:
    return sorted(round(float(r["value"][1]), 6) for r in prom.query(q))


def test_dashboard_panels_equal_dcgm_exporter(tmp_path: Path) -> None:
    store = gpupipe_store()
    ours = make_metrics_server(store, "127.0.0.1", 0).start()
    theirs = serve_files({n: (FIX / "expected" / f"{n}.prom").read_bytes() for n in NODES})
    port = free_port()
    jobs = [job("gpupipe", f"127.0.0.1:{ours.port}", "gpupipe")]
    jobs += [job(f"dcgm-{n}", f"127.0.0.1:{theirs.server_address[1]}", "dcgm", f"/{n}") for n in NODES]
    cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": jobs}
    prom = Prometheus(cfg, tmp_path / "prom", port)
    try:
        prom.wait_ready()
        want = {f"{src}:{n}" for src in ("gpupipe", "dcgm") for n in NODES}
        wait_for(
            lambda: want <= set(prom.label_values("instance", "DCGM_FI_DEV_GPU_TEMP")),
            30,
            "Prometheus to hold both sources for every node",
        )
        exprs, _ = dashboard_panels()
        assert len(exprs) == 8, exprs
        compared = 0
        for node in NODES:
            gpus = prom.label_values("gpu", f'DCGM_FI_DEV_GPU_TEMP{{instance="dcgm:{node}"}}')
            for expr in exprs:
                got = {}
                for src in ("gpupipe", "dcgm"):
                    q = substitute(
                        expr,
                        {"instance": grafana_escape(f"{src}:{node}"), "gpu": "(" + "|".join(gpus) + ")"},
                    )
                    got[src] = values(prom, q)
                assert got["gpupipe"] == got["dcgm"], (node, expr, got)
                compared += bool(got["dcgm"])
            # the sums that went wrong before, spelled out
            for q in (
                "sum(DCGM_FI_DEV_FB_USED{{instance=~'{i}'}})",
                "count(DCGM_FI_DEV_GPU_TEMP{{instance=~'{i}'}})",
            ):
                a = values(prom, q.format(i=f"gpupipe:{node}"))
                b = values(prom, q.format(i=f"dcgm:{node}"))
                assert a == b, (node, q, a, b)
        assert compared >= 20  # panels with data on these nodes (utilisation is blank on MIG, as upstream)
        err = (
            'DCGM_FI_DEV_XID_ERRORS{{instance="{s}:whole-node",err_code="79",'
            'err_msg="GPU has fallen off the bus"}}'
        )
        assert values(prom, err.format(s="gpupipe")) == values(prom, err.format(s="dcgm")) == [79.0]
    except BaseException:
        print("--- prometheus log ---\n" + prom.log_tail())
        raise
    finally:
        prom.stop()
        ours.close()
        theirs.shutdown()
        theirs.server_close()
