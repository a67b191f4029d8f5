"""NvmlSource letting go of NVML and taking it again (producer/nvml/session.py).

Review §2, ``nvml/source.py:433-456``: a lost GPU was re-probed through the same NVML session,
which usually does not see a reset or rebind, so recovery needed a pod restart. The fake models
that (tests/fake_nvml_session.py): a reset GPU answers only in a new session, and handles from an
earlier session are refused.
"""

from __future__ import annotations

import time

import pynvml

from tests.fake_nvml import FakeMigSlice, FakeNvml
from tests.unit.producer.nvml.test_source import by_gpu, make, tick


def test_a_reset_gpu_is_seen_again_after_nvml_is_reinitialised() -> None:
    fake, src, clock, hooks = make(FakeNvml.node("H100", 4))
    src.poll()
    fake.gpus[2].lose()
    assert by_gpu(tick(src, clock))[2]["gpu_lost"] is True
    fake.gpus[2].reset()  # nvidia-smi -r / a rebind: this NVML session still sees it lost
    for _ in range(4):
        assert by_gpu(tick(src, clock, 30.0))[2]["gpu_lost"] is True  # the same-session probe
    assert fake.sessions == 1
    assert src.reinit() is True
    assert fake.sessions == 2 and fake.init_count == 1
    s = by_gpu(tick(src, clock))
    assert s[2]["gpu_lost"] is False and s[2]["uuid"] == fake.gpus[2].uuid
    assert s[2]["power_w"] is not None
    assert [r.uuid for r in hooks.recovered] == [fake.gpus[2].uuid]
    # The other GPUs carry on under their new handles (the old ones are refused now).
    assert all(s[i]["power_w"] is not None and s[i]["gpu_lost"] is False for i in (0, 1, 3))
    assert by_gpu(tick(src, clock))[0]["sm_active_ratio"] is not None  # GPM sampling again
    src.shutdown()
    assert fake.init_count == 0 and fake.allocated_gpm_samples == 0


def test_reinit_is_due_after_the_loss_then_backs_off_and_stops_when_none_is_lost() -> None:
    fake, src, clock, _ = make(FakeNvml.node("H100", 2), intervals={"lost_reinit": 60})
    src.poll()
    assert src.reinit_due(clock()) is False
    fake.gpus[1].lose()
    tick(src, clock)
    assert src.reinit_due(clock()) is False  # the loss starts the clock
    clock.advance(59)
    assert src.reinit_due(clock()) is False
    clock.advance(1)
    assert src.reinit_due(clock()) is True
    src.reinit_tried(clock())
    clock.advance(119)
    assert src.reinit_due(clock()) is False
    clock.advance(1)
    assert src.reinit_due(clock()) is True  # doubled: 120 s
    fake.gpus[1].reset()
    assert src.reinit() is True
    tick(src, clock)
    assert src.lost_gpus == [] and src.reinit_due(clock()) is False
    src.shutdown()


def test_suspend_holds_nothing_and_resume_re_enumerates_slices_and_support() -> None:
    fake = FakeNvml.node("H100", 2)
    fake.gpus[1].enable_mig([FakeMigSlice("3g.40gb", 1, index=0), FakeMigSlice("3g.40gb", 2, index=1)])
    fake.gpus[0].unsupported.add("nvmlDeviceGetEncoderUtilization")
    fake, src, clock, _ = make(fake)
    src.poll()
    tick(src, clock)
    assert fake.allocated_gpm_samples > 0
    assert src.suspend() is True
    assert fake.init_count == 0 and fake.allocated_gpm_samples == 0
    assert src.poll() == [] and src.released
    asked = fake.count("nvmlDeviceGetEncoderUtilization", gpu=0)
    assert src.resume() is True and not src.released
    samples = tick(src, clock)
    assert sorted(s["mig"]["gpu_instance_id"] for s in samples if s["mig"]) == [1, 2]
    assert fake.count("nvmlDeviceGetEncoderUtilization", gpu=0) == asked + 1  # a new driver may answer
    src.shutdown()
    assert fake.init_count == 0


def test_resume_while_the_driver_is_away_stays_released_and_says_why() -> None:
    fake, src, clock, _ = make(FakeNvml.node("H100", 1))
    src.poll()
    assert src.suspend()
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert src.resume() is False
    assert src.released and src.resume_error == "NVMLError_DriverNotLoaded"
    assert src.poll() == []
    fake.init_error = None
    assert src.resume() is True and src.resume_error is None
    assert by_gpu(tick(src, clock))[0]["power_w"] is not None
    src.shutdown()
    assert fake.init_count == 0


def test_a_gpu_gone_from_the_enumeration_stays_listed_as_lost() -> None:
    fake, src, clock, hooks = make(FakeNvml.node("H100", 3))
    src.poll()
    gone = fake.gpus.pop()  # after the new session NVML enumerates 2 GPUs
    assert src.reinit() is True
    s = by_gpu(tick(src, clock))
    assert s[2]["gpu_lost"] is True and s[2]["uuid"] == gone.uuid
    assert [lost.gpu.uuid for lost in hooks.lost] == [gone.uuid] and hooks.lost[0].call == "reinit"
    assert s[0]["gpu_lost"] is False and s[1]["gpu_lost"] is False
    src.shutdown()


def test_nvml_is_not_shut_down_under_a_call_in_flight() -> None:
    fake, src, clock, _ = make(FakeNvml.node("H100", 2))
    src.call_timeout_s = 0.2
    src.poll()
    fake.gpus[1].hang(30.0)
    tick(src, clock)
    assert src.stalled_count() == 1
    assert src.can_suspend() is False and src.suspend() is False and fake.init_count == 1
    fake.gpus[1].hang(0)  # the call returns
    deadline = time.monotonic() + 5
    while not src.can_suspend():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert src.suspend() is True and fake.init_count == 0
    src.shutdown()
