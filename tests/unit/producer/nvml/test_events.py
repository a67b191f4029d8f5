"""XidEventWatcher against the fake NVML event set: real threads, no sleeps used as sync
(callbacks put into queues; tests block on the queues with a timeout).

Every test runs in both of the double's delivery modes (tests/fake_nvml_events.py): ``own-set``,
each event in its GPU's own set, and ``any-set``, as NVIDIA's mock library hands a pending event to
whichever set waits (the double: another GPU's set whenever one waits). Attribution must follow
the device the event names in both.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import pynvml
import pytest

from gpupipe_producer.nvml import NvmlInitError, NvmlSource, XidEventWatcher, nvml_xid_event
from gpupipe_schemas.codec import AvroCodec
from tests.fake_nvml import EVENT_DELIVERY, FakeGpu, FakeMigSlice, FakeNvml

XID_ENCODER = AvroCodec().encoder("XidEvent")
WAIT_S = 5.0  # upper bound for a delivery; normally milliseconds


_STARTED: list[XidEventWatcher] = []


@pytest.fixture(autouse=True)
def _stop_watchers() -> Any:
    """Every watcher a test starts is stopped with the test, pass or fail."""
    yield
    while _STARTED:
        _STARTED.pop().stop()


class Watch:
    """A started watcher whose events and errors land in queues."""

    def __init__(self, fake: FakeNvml, **kw: Any) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.errors: queue.Queue[str] = queue.Queue()
        kw.setdefault("timeout_ms", 50)
        kw.setdefault("backoff_initial_s", 0.01)
        kw.setdefault("backoff_max_s", 0.05)
        self.watcher = XidEventWatcher(
            fake, self.events.put, on_error=self.errors.put, wall_clock=lambda: 1_767_225_600.5, **kw
        )
        _STARTED.append(self.watcher)
        self.watcher.start()

    def event(self) -> dict[str, Any]:
        return self.events.get(timeout=WAIT_S)

    def error(self) -> str:
        return self.errors.get(timeout=WAIT_S)


@pytest.fixture(params=EVENT_DELIVERY)
def delivery(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fake(delivery: str) -> FakeNvml:
    return FakeNvml.node("H100", 4, event_delivery=delivery)


def test_injected_xid_is_delivered_and_stop_is_clean(fake):
    w = Watch(fake)
    assert w.watcher.registered == [0, 1, 2, 3] and w.watcher.running
    fake.gpus[2].inject_xid(79)
    ev = w.event()
    assert ev == {
        "xid": 79,
        "uuid": fake.gpus[2].uuid,
        "pci_bus_id": "00000000:52:00.0",
        "gpu_index": 2,
        "gpu_instance_id": None,  # 0xFFFFFFFF: not attributable to a MIG instance
        "compute_instance_id": None,
        "mig_uuid": None,
        "set_gpu_index": ev["set_gpu_index"],  # which set delivered it: any, in the mock's mode
        "timestamp_ms": 1_767_225_600_500,
    }
    record = nvml_xid_event(ev, "node-a", model_name="NVIDIA H100 80GB HBM3", driver_version="570.124.06")
    XID_ENCODER.encode(record)
    assert record["kind"] == "xid" and record["source"] == "nvml" and record["xid"] == 79
    t0 = time.monotonic()
    assert w.watcher.stop() is True
    assert time.monotonic() - t0 < 2.5  # about one 50 ms wait; generous for loaded CI machines
    assert not w.watcher.running
    assert fake.free_while_waiting == 0
    assert fake.count("nvmlEventSetFree") == 4  # one set per GPU
    assert fake.init_count == 0
    assert w.watcher.stop() is True  # idempotent


def test_several_xids_in_order(fake):
    w = Watch(fake)
    for xid in (13, 31, 43):
        fake.gpus[0].inject_xid(xid)
    assert [w.event()["xid"] for _ in range(3)] == [13, 31, 43]
    w.watcher.stop()


def test_timeouts_are_not_errors(fake):
    w = Watch(fake, timeout_ms=10)
    fake.gpus[1].inject_xid(48)  # proves the loop went round timeouts and still delivers
    assert w.event()["xid"] == 48
    w.watcher.stop()
    assert w.watcher.error_counts == {}
    assert w.errors.empty()


def test_mig_attributed_xid_with_mig_uuid_lookup(delivery):
    gpus = [FakeGpu.h100(0), FakeGpu.h100(1, mig=[FakeMigSlice("3g.40gb", gpu_instance_id=2, index=0)])]
    fake = FakeNvml(gpus, event_delivery=delivery)
    src = NvmlSource(fake, "node-a")
    src.start()
    w = Watch(fake, mig_uuid_lookup=src.mig_uuid_for)
    fake.gpus[1].inject_xid(31, gpu_instance_id=2, compute_instance_id=0)
    ev = w.event()
    assert ev["gpu_instance_id"] == 2 and ev["compute_instance_id"] == 0
    assert ev["mig_uuid"] == gpus[1].mig_slices[0].uuid
    assert ev["uuid"] == gpus[1].uuid
    w.watcher.stop()
    src.shutdown()
    assert fake.init_count == 0  # NVML init is reference-counted between the two


def test_gpu_without_event_support_is_skipped_and_the_set_still_works(delivery):
    gpus = [FakeGpu.h100(0, events_supported=False), FakeGpu.h100(1)]
    fake = FakeNvml(gpus, event_delivery=delivery)
    w = Watch(fake)
    assert w.watcher.unsupported == [0] and w.watcher.registered == [1]
    fake.gpus[0].inject_xid(79)  # not registered: NVML would not record it
    fake.gpus[1].inject_xid(94)
    assert w.event()["gpu_index"] == 1
    w.watcher.stop()
    assert w.events.empty()


def test_wait_errors_are_reported_and_the_thread_backs_off_then_continues(fake):
    w = Watch(fake)
    fake.fail_event_wait(pynvml.NVML_ERROR_UNKNOWN, gpu=3)
    assert w.error() == "NVMLError_Unknown"
    fake.gpus[3].inject_xid(45)
    assert w.event()["xid"] == 45
    assert w.watcher.error_counts["NVMLError_Unknown"] == 1
    w.watcher.stop()


def test_gpu_lost_during_wait_reported_other_gpus_keep_reporting(fake):
    w = Watch(fake)
    fake.gpus[2].lose()
    assert w.error() == "NVMLError_GpuIsLost"
    fake.gpus[0].inject_xid(79)
    assert w.event()["gpu_index"] == 0
    w.watcher.stop()


def test_repeated_errors_rebuild_the_event_set(fake):
    w = Watch(fake, rebuild_after=3)
    fake.fail_event_wait(pynvml.NVML_ERROR_UNKNOWN, times=3, gpu=1)
    for _ in range(3):
        assert w.error() == "NVMLError_Unknown"
    # The old set is freed from the watcher's own thread, a new one registered.
    _until(lambda: fake.count("nvmlEventSetCreate") == 4 + 1, "GPU 1's set rebuilt")
    fake.gpus[1].inject_xid(79)
    got = w.event()
    assert got["xid"] == 79 and got["gpu_index"] == 1
    assert fake.count("nvmlEventSetCreate") == 4 + 1  # one set per GPU, GPU 1's rebuilt once
    w.watcher.stop()
    assert fake.free_while_waiting == 0
    assert fake.count("nvmlEventSetFree") == 4 + 1
    assert fake.live_event_sets() == 0


def test_callback_failure_does_not_kill_the_thread(fake):
    seen: queue.Queue[int] = queue.Queue()

    def flaky(ev: dict[str, Any]) -> None:
        seen.put(ev["xid"])
        if ev["xid"] == 13:
            raise RuntimeError("downstream hiccup")

    w = XidEventWatcher(fake, flaky, timeout_ms=50)
    _STARTED.append(w)
    w.start()
    fake.gpus[0].inject_xid(13)
    fake.gpus[0].inject_xid(31)
    assert [seen.get(timeout=WAIT_S), seen.get(timeout=WAIT_S)] == [13, 31]
    assert w.running
    w.stop()


def test_init_failure_is_a_clear_error(delivery):
    fake = FakeNvml.node("H100", 1, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED, event_delivery=delivery)
    w = XidEventWatcher(fake, lambda ev: None)
    with pytest.raises(NvmlInitError, match="NVML init failed: Driver Not Loaded"):
        w.start()
    assert not w.running


# -- a failing GPU costs the other GPUs nothing -----------------


def _deliver_each(
    w: Watch, fake: FakeNvml, gpus: list[int], xid: int, within_s: float
) -> list[dict[str, Any]]:
    """Inject ``xid`` on each GPU in turn; each must be delivered within ``within_s``."""
    got = []
    for i in gpus:
        t0 = time.monotonic()
        fake.gpus[i].inject_xid(xid)
        ev = w.events.get(timeout=within_s)
        assert ev["gpu_index"] == i and ev["xid"] == xid
        assert time.monotonic() - t0 < within_s
        got.append(ev)
    return got


def test_a_gpu_whose_event_channel_keeps_failing_delays_and_loses_no_other_gpus_xid(fake):
    # GPU 2 registers fine but every wait involving it fails: with one shared set the watcher
    # backed off, dropped the set (and the other GPUs' queued XIDs) and re-registered GPU 2 forever.
    w = Watch(fake, backoff_initial_s=0.2, backoff_max_s=0.4)
    fake.gpus[2].event_wait_error = pynvml.NVML_ERROR_UNKNOWN
    fake._notify_events()
    assert w.error() == "NVMLError_Unknown"
    for _ in range(3):  # over several of GPU 2's back-off periods and rebuilds
        _deliver_each(w, fake, [0, 1, 3], 43, within_s=1.0)
    assert w.watcher.failing == [2]
    assert w.watcher.registered in ([0, 1, 3], [0, 1, 2, 3])  # 2 only between a rebuild and its error
    # GPU 2's retries are paced by its back-off (0.2 s doubling to 0.4 s), never a busy loop.
    assert fake.count("nvmlDeviceRegisterEvents", gpu=2) <= 2 + 10
    fake.gpus[2].event_wait_error = None  # the channel heals: GPU 2 reports again
    deadline = time.monotonic() + WAIT_S
    while 2 not in w.watcher.registered or w.watcher.failing:
        assert time.monotonic() < deadline, "GPU 2 was not set up again"
        time.sleep(0.01)
    assert _deliver_each(w, fake, [2], 79, within_s=1.0)[0]["uuid"] == fake.gpus[2].uuid


def test_gpu_lost_the_others_xids_in_flight_and_after_are_delivered_at_once(fake):
    w = Watch(fake, backoff_initial_s=2.0, backoff_max_s=4.0)  # long back-off: nobody else waits on it
    fake.gpus[0].inject_xid(13)  # queued while GPU 2 falls off the bus
    fake.gpus[2].lose()
    fake.gpus[1].inject_xid(31)
    got = {w.event()["xid"], w.event()["xid"]}
    assert got == {13, 31}
    assert w.error() == "NVMLError_GpuIsLost"
    _deliver_each(w, fake, [0, 1, 3], 45, within_s=1.0)


def test_events_queued_in_a_set_that_is_rebuilt_are_drained_not_dropped(fake):
    w = Watch(fake, rebuild_after=3)
    fake.fail_event_wait(pynvml.NVML_ERROR_UNKNOWN, times=3, gpu=1)
    fake.gpus[1].inject_xid(48)  # behind the three errors in GPU 1's set
    for _ in range(3):
        assert w.error() == "NVMLError_Unknown"
    assert w.event()["xid"] == 48  # drained from the set before it was freed
    deadline = time.monotonic() + WAIT_S
    while fake.count("nvmlEventSetCreate") < 4 + 1:  # GPU 1 set up again after its back-off
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _deliver_each(w, fake, [1], 31, within_s=1.0)


def test_a_lost_gpu_is_watched_again_when_it_answers(fake):
    w = Watch(fake)
    fake.gpus[2].lose()
    assert w.error() == "NVMLError_GpuIsLost"
    deadline = time.monotonic() + WAIT_S
    while 2 in w.watcher.registered:  # dropped after rebuild_after failures
        assert time.monotonic() < deadline
        time.sleep(0.01)
    fake.gpus[2].recover()
    while 2 not in w.watcher.registered:
        assert time.monotonic() < deadline, "the recovered GPU was never registered again"
        time.sleep(0.01)
    assert _deliver_each(w, fake, [2], 79, within_s=1.0)[0]["gpu_index"] == 2


def test_a_gpu_lost_at_start_is_set_up_once_it_answers(delivery):
    fake = FakeNvml.node("H100", 2, event_delivery=delivery)
    fake.gpus[1].lost = True
    w = Watch(fake)
    assert w.watcher.registered == [0] and w.watcher.failing == [1]
    _deliver_each(w, fake, [0], 79, within_s=1.0)
    fake.gpus[1].recover()
    deadline = time.monotonic() + WAIT_S
    while w.watcher.registered != [0, 1]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _deliver_each(w, fake, [1], 94, within_s=1.0)


def test_stop_while_start_is_under_way_leaves_no_thread_running(fake):
    # The agent's polling thread restarts the watcher after an NVML re-initialisation while the
    # agent may be shutting down from the main thread: stop() must wait for that start to finish.
    import threading

    fake.gpus[0].hang(0.3)  # start() is in GPU 0's identity calls for 0.3 s
    w = XidEventWatcher(fake, lambda ev: None, timeout_ms=50)
    starter = threading.Thread(target=w.start)
    starter.start()
    deadline = time.monotonic() + WAIT_S
    while fake.count("nvmlDeviceGetUUID", gpu=0) == 0:  # start() is under way
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert w.stop() is True
    starter.join(WAIT_S)
    assert not starter.is_alive() and not w.running
    assert fake.init_count == 0 and fake.live_event_sets() == 0
    fake.gpus[0].hang(0)


# -- a wait stuck in NVML and a GPU hung in its set-up (finding 4) ------------


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_wait_stuck_in_nvml_is_left_to_itself_and_start_works_again(fake):
    w = Watch(fake)
    fake.stick_event_waits(3)  # GPU 3 hangs in the driver: its wait does not return
    try:
        _until(lambda: fake.stuck_waits >= 1, "GPU 3's wait stuck")
        assert w.watcher.stop(timeout_s=0.3) is False
        assert fake.live_event_sets() == 1  # GPU 3's set: never freed under its wait
        assert fake.init_count == 1  # and the watcher still holds that start's NVML reference
        # Before: start() did nothing (still "started", its stop flag set): no GPU was watched.
        w.watcher.start()
        assert w.watcher.running and w.watcher.registered == [0, 1, 2, 3]
        fake.gpus[0].inject_xid(79)
        assert w.event()["gpu_index"] == 0
        assert w.watcher.stuck == [3]  # said (health, metrics) until it returns
    finally:
        fake.unstick_event_waits(3)
    # The stuck wait returns: that thread frees its own set and gives its NVML reference back;
    # it does not go on waiting (its start's stop event stays set: the new start has its own).
    _until(lambda: not w.watcher.stuck and fake.init_count == 1, "the orphan's clean-up")
    assert fake.live_event_sets() == 4
    fake.gpus[3].inject_xid(48)
    ev = w.event()
    assert (ev["gpu_index"], ev["xid"]) == (3, 48) and w.events.empty()  # once: no old thread
    assert w.watcher.stop() is True
    assert fake.init_count == 0 and fake.live_event_sets() == 0 and fake.free_while_waiting == 0


def test_a_gpu_hung_in_its_set_up_holds_up_neither_start_nor_stop(fake):
    # The agent's polling thread restarts the watcher after an NVML re-initialisation; the set-up
    # calls (GetHandleByIndex, GetUUID...) of a hung GPU ran under the start/stop lock, so the
    # agent's shutdown waited in stop() until the GPU answered, past its 10 s budget.
    import threading

    fake.gpus[0].hang(8.0)
    w = XidEventWatcher(fake, lambda ev: None, timeout_ms=50)
    _STARTED.append(w)
    starter = threading.Thread(target=w.start)
    starter.start()
    try:
        _until(lambda: fake.count("nvmlDeviceGetUUID", gpu=0) > 0, "start() under way")
        t0 = time.monotonic()
        clean = w.stop(timeout_s=0.3)
        took = time.monotonic() - t0
    finally:
        fake.gpus[0].hang(0)
        starter.join(WAIT_S)
    assert took < 2.0, f"stop() took {took:.1f}s while GPU 0 hung"
    assert clean is False and not starter.is_alive()
    _until(lambda: not w.stuck and fake.init_count == 0, "GPU 0's thread returning")
    assert not w.running and fake.live_event_sets() == 0


def test_a_gpu_that_stops_offering_events_is_logged_once_and_watched_when_it_offers_them_again(
    fake, caplog: pytest.LogCaptureFixture
):
    # Finding 7: a GPU answering NotSupported when its set was rebuilt logged "does not support
    # XID events" at every back-off period, for ever.
    w = Watch(fake, rebuild_after=1)
    fake.gpus[1].events_supported = False  # e.g. after a reset; its registered set stays
    with caplog.at_level(logging.WARNING, logger="gpupipe.nvml.events"):
        fake.fail_event_wait(pynvml.NVML_ERROR_UNKNOWN, times=1, gpu=1)  # the set is rebuilt
        asked = fake.count("nvmlDeviceGetSupportedEventTypes", gpu=1)
        _until(lambda: fake.count("nvmlDeviceGetSupportedEventTypes", gpu=1) >= asked + 4, "retries")
        assert w.watcher.unsupported == [1]
        said = [
            r.getMessage() for r in caplog.records if "GPU 1" in r.getMessage() and "events" in r.getMessage()
        ]
    assert len([m for m in said if "XID events through NVML" in m]) == 1, said
    fake.gpus[1].events_supported = True
    _until(lambda: w.watcher.registered == [0, 1, 2, 3], "GPU 1 set up again")
    assert w.watcher.unsupported == []
    fake.gpus[1].inject_xid(31)
    assert w.event()["gpu_index"] == 1


# -- an event belongs to the device it names ---------------------------------------


def _identity(ev: dict[str, Any]) -> tuple[Any, ...]:
    return (ev["gpu_index"], ev["uuid"], ev["pci_bus_id"])


def _of(fake: FakeNvml, i: int) -> tuple[Any, ...]:
    g = fake.gpus[i]
    return (i, g.uuid, g.pci_bus_id)


def test_two_gpus_failing_with_different_xids_are_each_named_whatever_set_delivers(delivery):
    # NVIDIA's mock library hands GPU 0's Xid 79 to whichever set waits: the watcher published it
    # on GPU 4 in one run and on GPU 2 in the next, and GPU 2's Xid 94 on GPU 3.
    fake = FakeNvml.node("H100", 8, event_delivery=delivery)
    w = Watch(fake)
    fake.gpus[2].inject_xid(94)
    ev = w.event()
    assert (ev["xid"], *_identity(ev)) == (94, *_of(fake, 2))
    fake.gpus[0].inject_xid(79)
    ev = w.event()
    assert (ev["xid"], *_identity(ev)) == (79, *_of(fake, 0))
    counts = w.watcher.delivery_counts
    assert sum(counts.values()) == 2 and counts["unresolved"] == 0
    # The cross-check: in the mock's mode both came through another GPU's set, and say so.
    assert counts["other_set"] == (2 if delivery == "any-set" else 0)
    w.watcher.stop()
    assert w.events.empty()  # each once


def test_a_burst_of_events_on_every_gpu_is_each_attributed_once(delivery):
    fake = FakeNvml.node("H100", 8, event_delivery=delivery)
    w = Watch(fake)
    for i in range(8):
        fake.gpus[i].inject_xid(40 + i)
    fake.gpus[5].inject_recovery_action(2)
    fake.gpus[6].inject_gpu_unavailable(1)
    got = [w.event() for _ in range(10)]
    xids = sorted((e["xid"], _identity(e)) for e in got if "xid" in e)
    assert xids == [(40 + i, _of(fake, i)) for i in range(8)]
    notices = sorted((e["type"], _identity(e)) for e in got if "type" in e)
    assert notices == [("gpu_unavailable", _of(fake, 6)), ("recovery_action", _of(fake, 5))]
    w.watcher.stop()
    assert w.events.empty()


def test_a_lost_gpus_xid_delivered_through_another_set_names_the_lost_gpu():
    # The mock's Xid 79: the GPU falls off the bus, its own set fails, another set delivers the
    # event; the device it names is the lost GPU, whose identity is known from its set-up.
    fake = FakeNvml.node("H100", 8, event_delivery="any-set")
    w = Watch(fake, backoff_initial_s=1.0, backoff_max_s=2.0)
    fake.gpus[0].lose()
    assert w.error() == "NVMLError_GpuIsLost"
    fake.gpus[0].inject_xid(79)
    ev = w.event()
    assert (ev["xid"], *_identity(ev)) == (79, *_of(fake, 0))
    assert w.watcher.delivery_counts["other_set"] == 1


def test_an_event_for_a_gpu_whose_set_is_being_rebuilt_is_delivered_on_its_gpu():
    fake = FakeNvml.node("H100", 4, event_delivery="any-set")
    w = Watch(fake, rebuild_after=1, backoff_initial_s=0.5, backoff_max_s=1.0)
    fake.fail_event_wait(pynvml.NVML_ERROR_UNKNOWN, times=1, gpu=1)
    assert w.error() == "NVMLError_Unknown"
    _until(lambda: 1 not in w.watcher.registered, "GPU 1's set freed for its rebuild")
    fake.gpus[1].inject_xid(48)
    ev = w.event()
    assert (ev["xid"], *_identity(ev)) == (48, *_of(fake, 1))


def test_an_event_naming_a_device_unknown_to_the_watcher_is_resolved_through_nvml():
    # GPU 1 was lost at start (never set up here), answers again, and its event comes through GPU
    # 0's set before its own thread has set it up: NVML itself says which GPU the handle is.
    fake = FakeNvml.node("H100", 2, event_delivery="any-set")
    fake.gpus[1].lost = True
    w = Watch(fake, backoff_initial_s=5.0, backoff_max_s=5.0)  # GPU 1 not set up again meanwhile
    fake._ever_registered[1] = pynvml.nvmlEventTypeXidCriticalError  # registered by another client
    fake.gpus[1].recover()
    fake.gpus[1].inject_xid(31)
    ev = w.event()
    assert (ev["xid"], *_identity(ev)) == (31, *_of(fake, 1))
    assert w.watcher.delivery_counts["other_set"] == 1


def test_instance_ids_on_a_gpu_not_in_mig_mode_are_no_mig_instance(delivery):
    # NVIDIA's mock fills gpuInstanceId/computeInstanceId with 0 on a GPU without MIG, where the
    # driver says 0xFFFFFFFF; GPU instance 0 exists only in MIG mode.
    fake = FakeNvml.node("H100", 2, event_delivery=delivery)
    w = Watch(fake)
    fake.gpus[1].inject_xid(79, gpu_instance_id=0, compute_instance_id=0)
    ev = w.event()
    assert (ev["gpu_instance_id"], ev["compute_instance_id"], ev["mig_uuid"]) == (None, None, None)
