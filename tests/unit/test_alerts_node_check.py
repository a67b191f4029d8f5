"""The alerts service believes an XID's hostname only when that node signed the record."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from consumers.alerts.node_check import NodeCheck
from consumers.alerts.service import AlertsService, ListSink
from gpupipe.node_identity import NodeSigner, NodeVerifier
from tests.pki import Pki
from tests.unit.test_alerts_service import Clock, inrec, xid


class _Raw:
    """The consumed Kafka message: the bytes the signature covers and the headers it came with."""

    def __init__(self, value: bytes, headers: list[tuple[str, bytes]] | None) -> None:
        self._value, self._headers = value, headers

    def value(self) -> bytes:
        return self._value

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers


def _signed(signer: NodeSigner | None, rec: dict[str, Any]) -> Any:
    body = repr(sorted(rec.items())).encode()  # any bytes: the check covers what was consumed
    r = inrec("XidEvent", rec)
    return dataclasses.replace(r, raw=_Raw(body, signer.headers(body) if signer else None))


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[Pki, NodeSigner, NodeSigner]:
    pki = Pki(tmp_path)
    a = NodeSigner(str(pki.node("a", "system:node:node-a")), None, "node-a")
    b = NodeSigner(str(pki.node("b", "system:node:node-b")), None, "node-b")
    return pki, a, b


def _service(pki: Pki, mode: str) -> tuple[AlertsService, ListSink, CollectorRegistry]:
    reg, sink = CollectorRegistry(), ListSink()
    check = NodeCheck(NodeVerifier.from_file(str(pki.ca)), mode)
    svc = AlertsService(sink=sink, registry=reg, clock=Clock(), instance="t", node_check=check)
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
    assert 'gpupipe_alerts_node_identity_total{mode="enforce",result="verified"} 2.0' in text
    assert 'gpupipe_alerts_node_identity_total{mode="enforce",result="wrong-node"} 1.0' in text
    assert 'gpupipe_alerts_node_identity_total{mode="enforce",result="unsigned"} 1.0' in text


def test_audit_counts_what_enforce_would_refuse_and_takes_it(nodes: Any) -> None:
    pki, _, b = nodes
    svc, sink, reg = _service(pki, "audit")
    assert not svc.handle([_signed(b, xid(79, "forged", host="node-a"))])
    assert [r["hostname"] for r in sink.records if r["status"] == "firing"] == ["node-a"]
    text = generate_latest(reg).decode()
    assert 'gpupipe_alerts_node_identity_total{mode="audit",result="wrong-node"} 1.0' in text
    assert 'gpupipe_alerts_node_identity_total{mode="audit",result="verified"} 0.0' in text


def test_samples_are_not_checked(nodes: Any) -> None:
    pki, _, _ = nodes
    svc, _, _ = _service(pki, "enforce")
    value = {"hostname": "node-a", "uuid": "GPU-1", "pci_bus_id": None, "timestamp_ms": 1}
    sample = inrec("GpuSample", value)
    assert not svc.handle([sample])
    assert svc.node_check is not None and sum(svc.node_check.results.values()) == 0


def test_without_a_ca_no_metric_and_nothing_checked() -> None:
    reg = CollectorRegistry()
    svc = AlertsService(sink=ListSink(), registry=reg, clock=Clock(), instance="t")
    assert not svc.handle([inrec("XidEvent", xid(79, "e1"))])
    assert "gpupipe_alerts_node_identity" not in generate_latest(reg).decode()
