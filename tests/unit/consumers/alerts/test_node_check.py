"""The alerts service believes a record's hostname only when that node signed the record."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpupipe.domain.node_check import NodeCheck
from gpupipe.domain.node_identity import NodeSigner, NodeVerifier
from gpupipe_consumers.alerts.handler import AlertsHandler, ListSink
from tests.pki import Pki
from tests.unit.consumers.alerts.test_handler import T0, Clock, inrec, xid


class _Raw:
    """The consumed Kafka message: the bytes the signature covers and the headers it came with."""

    def __init__(self, value: bytes, headers: list[tuple[str, bytes]] | None) -> None:
        self._value, self._headers = value, headers

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers


def _signed(signer: NodeSigner | None, rec: dict[str, Any], name: str = "XidEvent") -> Any:
    body = repr(sorted(rec.items())).encode()  # any bytes: the check covers what was consumed
    r = inrec(name, rec)
    return dataclasses.replace(r, raw=_Raw(body, signer.headers(body) if signer else None))


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[Pki, NodeSigner, NodeSigner]:
    pki = Pki(tmp_path)
    a = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a")
    b = NodeSigner(str(pki.node("b", "system:node:node-b")), None, "node-b")
    return pki, a, b


def _service(pki: Pki, mode: str) -> tuple[AlertsHandler, ListSink, CollectorRegistry]:
    reg, sink = CollectorRegistry(), ListSink()
    check = NodeCheck(NodeVerifier.from_file(str(pki.ca)), mode, service="alerts")
    svc = AlertsHandler(sink=sink, registry=reg, clock=Clock(), instance="t", node_check=check)
    return svc, sink, reg


def test_enforce_dead_letters_a_forged_hostname_and_keeps_the_real_one(nodes: Any) -> None:
    pki, a, b = nodes
    svc, sink, reg = _service(pki, "enforce")
    forged = _signed(b, xid(79, "forged", host="node-a"))  # node-b's credentials, node-a's name
    unsigned = _signed(None, xid(79, "unsigned", host="node-a", bus="0000:28:00"))
    real = _signed(b, xid(79, "real", host="node-b"))
    rejected = svc.handle([forged, unsigned, real])
    assert [(r.value["event_id"], reason, detail) for r, reason, detail in rejected] == [
        ("forged", "node-identity", "wrong-node: hostname 'node-a'"),
        ("unsigned", "node-identity", "unsigned: hostname 'node-a'"),
    ]
    assert {r["hostname"] for r in sink.records if r["status"] == "firing"} == {"node-b"}
    assert svc.admission.nodes() == 1  # a refused record holds no state either
    assert not svc.handle([_signed(a, xid(79, "a-real", host="node-a"))])
    assert {r["hostname"] for r in sink.records if r["status"] == "firing"} == {"node-a", "node-b"}
    text = generate_latest(reg).decode()
    assert _count(text, "XidEvent", "verified", "enforce") == 2
    assert _count(text, "XidEvent", "wrong-node", "enforce") == 1
    assert _count(text, "XidEvent", "unsigned", "enforce") == 1


def test_audit_counts_what_enforce_would_refuse_and_takes_it(nodes: Any) -> None:
    pki, _, b = nodes
    svc, sink, reg = _service(pki, "audit")
    assert not svc.handle([_signed(b, xid(79, "forged", host="node-a"))])
    assert [r["hostname"] for r in sink.records if r["status"] == "firing"] == ["node-a"]
    text = generate_latest(reg).decode()
    assert _count(text, "XidEvent", "wrong-node", "audit") == 1
    assert _count(text, "XidEvent", "verified", "audit") == 0


def _count(text: str, record: str, result: str, mode: str) -> float:
    line = f'gpupipe_alerts_node_identity_total{{mode="{mode}",record="{record}",result="{result}"}} '
    (value,) = [ln.removeprefix(line) for ln in text.splitlines() if ln.startswith(line)]
    return float(value)


def _lost(host: str, ts: int) -> dict[str, Any]:
    """A sample saying the GPU fell off the bus: on its own it raises a drain alert."""
    return {
        "hostname": host,
        "uuid": "GPU-1",
        "pci_bus_id": "0000:18:00.0",
        "timestamp_ms": ts,
        "gpu_lost": True,
    }


def test_a_forged_sample_neither_drains_nor_ends_an_alert(nodes: Any) -> None:
    pki, a, b = nodes
    svc, sink, reg = _service(pki, "enforce")
    # node-b's credentials say node-a's GPU fell off the bus: dropped (not dead-lettered), counted
    assert not svc.handle([_signed(b, _lost("node-a", T0), "GpuSample")])
    assert not [r for r in sink.records if r["hostname"] == "node-a"]
    assert svc.admission.nodes() == 0
    # node-a's own sample raises it; a forged healthy sample does not end it
    assert not svc.handle([_signed(a, _lost("node-a", T0 + 1000), "GpuSample")])
    firing = [r for r in sink.records if r["status"] == "firing" and r["hostname"] == "node-a"]
    assert firing and firing[0]["drain_node"] is True
    healthy = {**_lost("node-a", T0 + 2000), "gpu_lost": False}
    svc.handle([_signed(b, healthy, "GpuSample"), _signed(None, healthy, "GpuSample")])
    assert not [r for r in sink.records if r["status"] == "resolved"]
    text = generate_latest(reg).decode()
    assert _count(text, "GpuSample", "wrong-node", "enforce") == 2
    assert _count(text, "GpuSample", "unsigned", "enforce") == 1
    assert _count(text, "GpuSample", "verified", "enforce") == 1


def test_a_check_that_raises_is_a_refusal_and_the_batch_goes_on(nodes: Any) -> None:
    _, a, _ = nodes

    class Broken:
        def check(self, hostname: str, value: bytes, headers: Any, at: float | None = None) -> str | None:
            raise RuntimeError("a library error the verifier did not expect")

    reg, sink = CollectorRegistry(), ListSink()
    check = NodeCheck(Broken(), "enforce", service="alerts")
    svc = AlertsHandler(sink=sink, registry=reg, clock=Clock(), instance="t", node_check=check)
    rejected = svc.handle([_signed(a, xid(79, "e1", host="node-a"))])
    assert [(reason, detail) for _, reason, detail in rejected] == [
        ("node-identity", "bad-certificate: hostname 'node-a'")
    ]


def test_without_a_ca_no_metric_and_nothing_checked() -> None:
    reg = CollectorRegistry()
    svc = AlertsHandler(sink=ListSink(), registry=reg, clock=Clock(), instance="t")
    assert not svc.handle([inrec("XidEvent", xid(79, "e1"))])
    assert "gpupipe_alerts_node_identity" not in generate_latest(reg).decode()
