"""The node agent letting go of NVML and taking it again (producer/agent/nvml_control.py), in-process
against the fake NVML: a reset GPU seen again without a restart, the release file for
``nvidia-smi -r`` / driver upgrades, readiness and liveness while released."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pynvml
from prometheus_client import CollectorRegistry

from gpupipe.commands.cli import build_parser
from gpupipe.web.server import HttpServer, registry_route
from gpupipe_producer.agent_config import config_from_args
from tests.agent_harness import metric, running_agent, wait_for
from tests.fake_nvml import FakeNvml
from tests.unit.producer.agent.test_node_agent import config, memory_publisher


def test_release_file_and_reinit_flags() -> None:
    def cfg(*flags: str) -> Any:
        return config_from_args(build_parser().parse_args(["produce", "--source", "nvml", *flags]))

    c = cfg("--spool-dir", "/tmp/s")
    assert c.nvml_release_file == "/tmp/s/nvml-release" and c.nvml_reinit_after_s == 60.0
    c = cfg("--nvml-release-file", "/run/gpupipe/release", "--nvml-reinit-after", "5m")
    assert c.nvml_release_file == "/run/gpupipe/release" and c.nvml_reinit_after_s == 300.0
    assert cfg("--nvml-release-file", "").nvml_release_file is None


def _lost_events(mem: Any) -> list[dict[str, Any]]:
    return [x for x in mem.records("xid") if x["kind"] == "gpu_lost"]


def test_a_reset_gpu_reports_again_after_the_agent_reinitialises_nvml(tmp_path: Path) -> None:
    fake = FakeNvml.node("H100", 4)
    pub, mem = memory_publisher()
    cfg = config(tmp_path, nvml_reinit_after_s=0.3, nvml_event_timeout_ms=50)
    with running_agent(cfg, pub, fake) as ra:
        agent = ra.agent
        fake.gpus[3].lose()
        wait_for(lambda: _lost_events(mem), 5, "the gpu_lost event")
        fake.gpus[3].reset()  # visible to a new NVML session only
        wait_for(lambda: fake.sessions >= 2, 10, "NVML re-initialised")
        wait_for(lambda: agent.source is not None and not agent.source.lost_gpus, 5, "GPU 3 back")
        since_ms = time.time() * 1000
        ra.ticks_after(2)
        wait_for(lambda: any(s["timestamp_ms"] > since_ms for s in mem.records("samples")), 5, "samples")
        back = [s for s in mem.records("samples") if s["gpu_index"] == 3 and s["timestamp_ms"] > since_ms]
        assert back and all(not s["gpu_lost"] and s["power_w"] is not None for s in back)
        # NVML events of every GPU are watched again under the new session.
        wait_for(lambda: agent.watcher is not None and agent.watcher.registered == [0, 1, 2, 3], 5, "events")
        fake.gpus[3].inject_xid(79)
        wait_for(lambda: any(x["xid"] == 79 for x in mem.records("xid")), 5, "Xid 79 through NVML")
        assert metric(ra.registry, "gpupipe_producer_nvml_reinits_total", {"reason": "gpu_lost"}) >= 1
        assert agent.ready()[0] and agent.health()[0]
        ra.stop()
    assert fake.init_count == 0
    assert len(_lost_events(mem)) == 1  # one loss, one event: the re-initialisation adds none


def test_an_event_wait_stuck_in_nvml_postpones_the_reinit_and_the_other_gpus_stay_watched(
    tmp_path: Path,
) -> None:
    # Review finding 1: GPU 3's wait blocked in the driver past the stop timeout; the let-go went
    # on anyway, the watcher's NVML reference kept the old session alive (a reset GPU never seen
    # again) and its start() did nothing: no NVML XID from any GPU, with /healthz 200.
    fake = FakeNvml.node("H100", 4)
    pub, mem = memory_publisher()
    cfg = config(tmp_path, nvml_reinit_after_s=0.3, nvml_event_timeout_ms=50, nvml_timeout_s=0.3)
    stuck = {"state": "stuck"}
    try:
        with running_agent(cfg, pub, fake) as ra:
            agent = ra.agent
            fake.stick_event_waits(3)
            wait_for(lambda: fake.stuck_waits >= 1, 5, "GPU 3's wait stuck in the driver")
            fake.gpus[3].lose()
            fake.gpus[3].reset()  # visible to a new NVML session only
            wait_for(lambda: _lost_events(mem), 5, "the gpu_lost event")
            # The re-initialisation comes due: the watcher is stopped (GPUs 0-2 free their sets)...
            wait_for(lambda: fake.count("nvmlEventSetFree") >= 3, 10, "the let-go tried")
            w = agent.watcher
            assert w is not None
            wait_for(lambda: 0 in w.registered, 5, "the healthy GPUs watched again at once")
            fake.gpus[0].inject_xid(79)
            wait_for(lambda: any(x["xid"] == 79 for x in mem.records("xid")), 5, "Xid 79 through NVML")
            postponed = {"reason": "event_wait_stuck"}
            name = "gpupipe_producer_nvml_let_go_postponed_total"
            wait_for(lambda: metric(ra.registry, name, postponed) >= 2, 10, "re-initialisation postponed")
            assert fake.sessions == 1
            ok, detail = agent.health()
            assert ok and detail["nvml_event_threads"] == {"stuck": [3], "dead": []}
            assert metric(ra.registry, "gpupipe_producer_nvml_event_gpus", stuck) == 1
            fake.unstick_event_waits(3)  # the wait returns: now NVML can really be re-initialised
            wait_for(lambda: fake.sessions >= 2, 10, "a new NVML session")
            wait_for(lambda: agent.source is not None and not agent.source.lost_gpus, 5, "GPU 3 back")
            wait_for(
                lambda: agent.watcher is not None and agent.watcher.registered == [0, 1, 2, 3], 5, "events"
            )
            fake.gpus[3].inject_xid(48)
            wait_for(lambda: any(x["xid"] == 48 for x in mem.records("xid")), 5, "Xid 48 through NVML")
            assert "nvml_event_threads" not in agent.health()[1]
            assert metric(ra.registry, "gpupipe_producer_nvml_event_gpus", stuck) == 0
            ra.stop()
    finally:
        fake.unstick_event_waits(3)
    assert fake.init_count == 0


def test_a_release_that_must_wait_for_a_hung_gpu_is_said_on_readyz_and_in_a_metric(tmp_path: Path) -> None:
    # Finding 5: the release file was ignored without a word while a GPU's call was in flight.
    fake = FakeNvml.node("H100", 2)
    pub, _ = memory_publisher()
    release = tmp_path / "nvml-release"
    cfg = config(tmp_path, nvml_release_file=str(release), nvml_event_timeout_ms=50, nvml_timeout_s=0.2)
    try:
        with running_agent(cfg, pub, fake) as ra:
            agent = ra.agent
            fake.gpus[1].hang(30.0)
            wait_for(lambda: agent.stalled_gpus() == 1, 5, "GPU 1 stalled")
            release.touch()
            wait_for(lambda: "nvml_release_pending" in agent.ready()[1], 5, "release pending said")
            ok, detail = agent.ready()
            # Still ready: NVML is held, so whoever waits for 503 before `nvidia-smi -r` waits on.
            assert ok and detail["nvml_release_pending"] == "gpu_call_in_flight"
            assert metric(ra.registry, "gpupipe_producer_nvml_release_pending") == 1
            assert fake.init_count == 2
            fake.gpus[1].hang(0)
            wait_for(lambda: fake.init_count == 0, 5, "NVML released once the call returned")
            assert not agent.ready()[0] and "nvml_release_pending" not in agent.ready()[1]
            assert metric(ra.registry, "gpupipe_producer_nvml_release_pending") == 0
            ra.stop()
    finally:
        fake.gpus[1].hang(0)


def test_the_release_file_lets_go_of_nvml_until_it_is_removed(tmp_path: Path) -> None:
    fake = FakeNvml.node("H100", 2)
    pub, mem = memory_publisher()
    release = tmp_path / "nvml-release"
    cfg = config(tmp_path, nvml_release_file=str(release), nvml_event_timeout_ms=50)
    with running_agent(cfg, pub, fake) as ra:
        agent = ra.agent
        ra.ticks_after(1)
        assert fake.init_count == 2  # the source and the event watcher
        release.touch()
        wait_for(lambda: fake.init_count == 0, 5, "NVML released")  # nvidia-smi -r may run now
        ok, detail = agent.ready()
        assert not ok and detail["nvml_released"] == "request" and "nvml_released" in detail["problems"]
        assert agent.health()[0], "released on purpose: alive, only not ready"
        assert metric(ra.registry, "gpupipe_producer_nvml_released") == 1
        ticks = agent.ticks
        for _ in range(2):  # the polling loop goes round, publishing nothing
            beat = agent._poll_beat
            wait_for(lambda b=beat: agent._poll_beat > b + 0.25, 5, "the polling loop going round")
            if _ == 0:
                n = len(mem.records("samples"))  # after what was queued before the release
        assert len(mem.records("samples")) == n and agent.ticks == ticks  # no NVML, no samples
        release.unlink()
        wait_for(lambda: fake.init_count == 2, 5, "NVML taken again")
        wait_for(lambda: len(mem.records("samples")) > n, 5, "samples again")
        assert agent.ready()[0]
        assert metric(ra.registry, "gpupipe_producer_nvml_released") == 0
        assert metric(ra.registry, "gpupipe_producer_nvml_reinits_total", {"reason": "request"}) == 1
        wait_for(lambda: agent.watcher is not None and agent.watcher.registered == [0, 1], 5, "events")
        ra.stop()
    assert fake.init_count == 0


def test_a_driver_upgraded_under_the_agent_fails_liveness_so_the_pod_restarts(tmp_path: Path) -> None:
    fake = FakeNvml.node("H100", 1)
    pub, _ = memory_publisher()
    release = tmp_path / "nvml-release"
    cfg = config(tmp_path, nvml_release_file=str(release), nvml_event_timeout_ms=50)
    with running_agent(cfg, pub, fake) as ra:
        agent = ra.agent
        release.touch()
        wait_for(lambda: fake.init_count == 0, 5, "NVML released")
        fake.init_error = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH  # the new driver is loaded
        release.unlink()
        wait_for(lambda: not agent.health()[0], 5, "liveness failing")
        assert "nvml_library_mismatch" in agent.health()[1]["problems"]
        assert not agent.ready()[0]
        labels = {"error": "NVMLError_LibRmVersionMismatch"}
        assert metric(ra.registry, "gpupipe_producer_nvml_reinit_failures_total", labels) >= 1
        fake.init_error = None  # (a driver that came back without a version change: taken again)
        wait_for(lambda: agent.ready()[0], 5, "ready again")
        ra.stop()
    assert fake.init_count == 0


def test_readyz_answers_the_readiness_check_and_healthz_the_liveness_one() -> None:
    http = HttpServer(
        "127.0.0.1:0",
        None,
        routes={"/metrics": registry_route(CollectorRegistry())},
        health=lambda: (True, {"ticks": 3}),
        ready=lambda: (False, {"problems": ["nvml_released"]}),
    ).start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        with urllib.request.urlopen(base + "/healthz", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(base + "/readyz", timeout=5)
            raise AssertionError("/readyz should answer 503")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and json.loads(exc.read())["problems"] == ["nvml_released"]
        assert time.monotonic() - t0 < 5
    finally:
        http.stop()
