"""A GPU off the bus whose samples keep saying so: its Xid 79 alert ends at the reboot that mends it.

NVML's lost-GPU samples fold into the Xid 79 alert of the same loss. After a restart of the alerts
service the sample baselines are gone, so the first lost sample of the new instance is again a
``gpu_lost`` occurrence: the same loss, not the GPU falling off the bus a second time. Counted as a
recurrence ("rebooting did not fix it", CONTACT_SUPPORT) it made the alert support-class, which no
reboot ends: the alert stayed firing after the reboot that mended the GPU, and the GPU's next Xid 79
continued it (no page). The life drill (tests/life_drill.py) found it over 30 days.
"""

from __future__ import annotations

from gpupipe_consumers.alerts.engine.alert_record import to_record
from gpupipe_consumers.alerts.engine.evidence_memory import evidence_record
from gpupipe_consumers.alerts.engine.facade import EngineConfig, EngineFacade
from gpupipe_consumers.alerts.engine.health_signals import HealthTracker
from tests.unit.consumers.alerts.engine.test_reset_evidence import MIN, T0, S, driver_loaded, xid


def sample(e: EngineFacade, tracker: HealthTracker, ts: int, *, lost: bool) -> None:
    """GPU 0's whole-GPU sample at ``ts``, through the tracker and the engine as the service hands it."""
    s = {
        "timestamp_ms": ts,
        "hostname": "node-a",
        "pci_bus_id": "00000000:18:00.0",
        "uuid": "GPU-0",
        "gpu_index": 0,
        "gpu_recovery_action": 0,
        "gpu_lost": lost,
    }
    ident, signals = tracker.observe(s)
    assert ident is not None
    for sig in signals:
        e.on_signal(ident, sig, ts)
    e.sample_seen(ident, ts, not lost, ts)


def test_the_lost_samples_after_a_restart_are_the_same_loss_and_the_reboot_ends_it() -> None:
    e, tracker = EngineFacade(EngineConfig()), HealthTracker()
    e.on_xid(xid(79, T0), T0)
    sample(e, tracker, T0 - 30 * S, lost=False)
    sample(e, tracker, T0 + 30 * S, lost=True)
    sample(e, tracker, T0 + 15 * MIN, lost=True)
    published = [to_record(a, T0 + 15 * MIN) for a in e.take(T0 + 15 * MIN, force=True)]
    # the alerts service restarts; the GPU is still off the bus
    e2, tracker2 = EngineFacade(EngineConfig()), HealthTracker()
    e2.restore(published, T0 + 20 * MIN)
    for k in range(2, 6):
        sample(e2, tracker2, T0 + k * 15 * MIN, lost=True)
    (a,) = e2.open_alerts()
    assert (a.codes, a.rule, a.action) == ((79,), "xid79", "RESTART_BM")  # one loss, not a recurrence
    # the node reboots; the GPU is back
    e2.on_xid(driver_loaded(T0 + 90 * MIN, boot="boot-B"), T0 + 90 * MIN)
    sample(e2, tracker2, T0 + 91 * MIN, lost=False)
    assert (a.status, a.resolve_reason) == ("resolved", "recovered")
    assert e2.open_alerts() == []


def test_a_driver_reload_that_leaves_the_gpu_lost_does_not_split_the_loss_across_a_restart() -> None:
    # A reload of the driver (for another GPU of the node) does not bring a GPU back onto the bus. After
    # a restart, the first lost sample of the new instance is no new loss: the alert goes on, keeps its
    # boot and action, and the reboot ends it.
    e, tracker = EngineFacade(EngineConfig()), HealthTracker()
    e.on_xid(xid(79, T0), T0)
    sample(e, tracker, T0 - 30 * S, lost=False)
    sample(e, tracker, T0 + 30 * S, lost=True)
    published = [to_record(a, T0 + MIN) for a in e.take(T0 + MIN, force=True)]
    e.on_xid(driver_loaded(T0 + 30 * MIN), T0 + 30 * MIN)
    sample(e, tracker, T0 + 31 * MIN, lost=True)
    published += [to_record(a, T0 + 32 * MIN) for a in e.take(T0 + 32 * MIN, force=True)]
    published += [evidence_record(ev, T0 + 32 * MIN) for ev in e.take_evidence()]
    e2, tracker2 = EngineFacade(EngineConfig()), HealthTracker()
    e2.restore(published, T0 + 40 * MIN)
    (before,) = e2.open_alerts()
    sample(e2, tracker2, T0 + 45 * MIN, lost=True)
    (a,) = e2.open_alerts()
    assert (a.alert_id, a.rule, a.action, a.boot_id) == (before.alert_id, "xid79", "RESTART_BM", "boot-A")
    e2.on_xid(driver_loaded(T0 + 90 * MIN, boot="boot-B"), T0 + 90 * MIN)
    assert a.status == "firing" and a.pending is not None  # the GPU has not been seen back yet
    sample(e2, tracker2, T0 + 91 * MIN, lost=False)
    assert (a.status, a.resolve_reason) == ("resolved", "recovered")


def test_a_gpu_lost_in_the_first_sample_without_an_open_alert_raises_one() -> None:
    e, tracker = EngineFacade(EngineConfig()), HealthTracker()
    sample(e, tracker, T0, lost=True)
    (a,) = e.open_alerts()
    assert (a.codes, a.rule, a.action) == ((79,), "gpu_lost", "RESTART_BM")
    sample(e, tracker, T0 + 15 * MIN, lost=True)
    assert e.open_alerts() == [a] and a.last_seen_ms == T0 + 15 * MIN
