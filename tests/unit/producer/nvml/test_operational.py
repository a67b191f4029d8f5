"""GPU Operational Events through the pynvml surface: registration, v3 wait, contexts, older drivers."""

from __future__ import annotations

import dataclasses
import logging
import queue
import types
from typing import Any

import pynvml
import pytest

from gpupipe.domain.pci import canonical
from gpupipe_producer.nvml.operational import OperationalEventWatcher
from tests.fake_nvml import MODELS, VOLTA, FakeGpu, FakeNvml
from tests.fake_nvml_operational import goe_event

R620 = "620.10.01"


def _watch(nvml: Any, **kw: Any) -> tuple[OperationalEventWatcher, queue.Queue[dict[str, Any]]]:
    got: queue.Queue[dict[str, Any]] = queue.Queue()
    w = OperationalEventWatcher(nvml, got.put, timeout_ms=50, **kw)
    w.start()
    return w, got


def test_a_structured_event_is_read_with_its_identity_and_legacy_xid() -> None:
    nvml = FakeNvml.node("H100", 2, driver_version=R620)
    support: list[tuple[int, str]] = []
    w, got = _watch(nvml, on_support=lambda gpu, state: support.append((gpu, state)))
    try:
        assert sorted(support) == [(0, "supported"), (1, "supported")]
        assert w.registered_bus(canonical(nvml.gpus[1].pci_bus_id))
        trace = nvml.inject_operational(1, goe_event("sparing_event"))
        ev = got.get(timeout=10)
    finally:
        assert w.stop()
    assert not w.registered_bus(canonical(nvml.gpus[1].pci_bus_id))  # freed at stop
    op = ev["operational"]
    assert (ev["type"], ev["uuid"], ev["gpu_index"], ev["legacy_xid"]) == (
        "operational",
        nvml.gpus[1].uuid,
        1,
        185,
    )
    assert (op["module_signature"], op["module_event_code"], op["category"]) == (
        "GPU-RAS",
        0x003D,
        "MEMORY_INTEGRITY_ERROR",
    )
    assert op["contexts"] == [
        {"context_type": 1, "source_context_type": 1, "format_version": 1, "legacy_xid": 185, "data": None}
    ]
    # A 64-bit trace id with the top bit set reads back as Avro's signed long of the same bits.
    assert op["trace_id"] & 0xFFFFFFFFFFFFFFFF == 0xA000_0000_0000_0000 | trace
    assert op["trace_id"] < 0
    assert nvml.count("nvmlEventSetWait_v3") >= 1 and not nvml.unimplemented_calls


def test_an_unknown_code_keeps_its_category_and_raw_context_bytes() -> None:
    nvml = FakeNvml.node("H100", 1, driver_version=R620)
    w, got = _watch(nvml)
    try:
        nvml.inject_operational(0, goe_event("unknown_code_memory"))
        ev = got.get(timeout=10)
    finally:
        w.stop()
    op = ev["operational"]
    assert ev["legacy_xid"] is None and op["module_event_code"] == 0x0FFF and op["category_id"] == 2
    assert op["contexts"][0]["data"] == bytes.fromhex("deadbeef00010203")
    assert op["contexts"][0]["context_type"] == 0  # NVML's UNKNOWN context type


def test_an_older_driver_is_one_log_line_and_a_support_state_never_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml.node("H100", 4)  # driver 570: the library has no operational-event symbols
    support: dict[int, str] = {}
    caplog.set_level(logging.DEBUG, "gpupipe.nvml.operational")
    w, _got = _watch(nvml, on_support=support.__setitem__)
    try:
        assert support == dict.fromkeys(range(4), "FunctionNotFound")
        assert not w.running and not w.started  # nothing to watch: NVML given back at once
    finally:
        assert w.stop()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "FunctionNotFound" in warnings[0].getMessage()
    assert nvml.live_event_sets() == 0 and nvml.init_count == 0


def test_a_binding_without_the_call_is_unsupported_too() -> None:
    fake = FakeNvml.node("H100", 1, driver_version=R620)
    old = types.SimpleNamespace(
        **{
            name: getattr(fake, name)
            for name in dir(pynvml)
            if not name.startswith("_") and "Operational" not in name and "Wait_v3" not in name
        }
    )
    support: dict[int, str] = {}
    w, _got = _watch(old, on_support=support.__setitem__)
    w.stop()
    assert support == {0: "binding"}


def test_a_gpu_older_than_turing_answers_not_supported() -> None:
    volta = dataclasses.replace(MODELS["A100"], arch=VOLTA, name="Tesla V100-SXM2-32GB")
    nvml = FakeNvml([FakeGpu(0, model=volta), FakeGpu(1, model="H100")], driver_version=R620)
    support: dict[int, str] = {}
    w, got = _watch(nvml, on_support=support.__setitem__)
    try:
        assert support == {0: "NotSupported", 1: "supported"}
        nvml.inject_operational(1, goe_event("fallen_off_bus"))
        assert got.get(timeout=10)["legacy_xid"] == 79
    finally:
        w.stop()


def test_attribution_is_by_the_uuid_the_record_names_not_the_set() -> None:
    nvml = FakeNvml.node("H100", 2, driver_version=R620, event_delivery="any-set")
    w, got = _watch(nvml)
    try:
        for _ in range(4):
            nvml.inject_operational(1, goe_event("sparing_event"))
        events = [got.get(timeout=10) for _ in range(4)]
    finally:
        w.stop()
    assert {(e["gpu_index"], e["uuid"]) for e in events} == {(1, nvml.gpus[1].uuid)}
    assert sum(w.delivery_counts.values()) == 4 and w.delivery_counts["unresolved"] == 0


def test_min_severity_filters_at_registration() -> None:
    nvml = FakeNvml.node("H100", 1, driver_version=R620)
    w, got = _watch(nvml, min_severity=pynvml.NVML_OPERATIONAL_EVENT_SEVERITY_FATAL)
    try:
        nvml.inject_operational(0, goe_event("sparing_event"))  # RECOVERABLE: below the floor
        nvml.inject_operational(0, goe_event("fallen_off_bus"))  # FATAL
        first = got.get(timeout=10)
    finally:
        w.stop()
    assert first["legacy_xid"] == 79 and got.empty()
