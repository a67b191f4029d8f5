"""The node agent in-process against the fake NVML and a fake kubelet, with an in-memory producer.

Kafka is replaced by a librdkafka stand-in behind the real Publisher (delivery callbacks served on
poll), so these tests check the agent's own wiring quickly; tests/integration/test_node_agent*.py
run the same agent against a real broker.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpupipe.commands.cli import build_parser
from gpupipe_producer.agent.node_agent import AgentConfig, NodeAgent, config_from_args, default_hostname
from gpupipe_producer.kubelet.client import DEFAULT_SOCKET_PATH
from gpupipe_producer.nvml.errors import NvmlInitError
from gpupipe_producer.publish import Publisher
from gpupipe_producer.self_metrics import ProducerMetrics
from gpupipe_schemas.codec import AvroCodec
from tests.agent_harness import (
    MIG_ALICE,
    SHARED,
    UUIDS,
    combined_fixture,
    find_line,
    metric,
    node_for_fixtures,
    running_agent,
    wait_for,
)
from tests.fake_nvml import FakeNvml
from tests.kubelet_fake import FakeKubelet

CODEC = AvroCodec()


class _Msg:
    def __init__(self, topic: str, key: bytes, value: bytes) -> None:
        self._t, self._k, self._v = topic, key, value

    def topic(self) -> str:
        return self._t

    def key(self) -> bytes:
        return self._k

    def value(self) -> bytes:
        return self._v


class MemoryProducer:
    """librdkafka stand-in: records everything, acknowledges on poll/flush."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self._default_cb = conf["on_delivery"]
        self._pending: list[tuple[_Msg, Any]] = []
        self._lock = threading.Lock()
        self.delivered: list[_Msg] = []

    def produce(
        self, topic: str, value: bytes, key: bytes, headers: Any = None, on_delivery: Any = None
    ) -> None:
        with self._lock:
            self._pending.append((_Msg(topic, key, value), on_delivery or self._default_cb))

    def poll(self, timeout: float = 0.0) -> int:
        with self._lock:
            pending, self._pending = self._pending, []
        for msg, cb in pending:
            self.delivered.append(msg)
            cb(None, msg)
        return len(pending)

    def flush(self, timeout: float = 0.0) -> int:
        self.poll()
        return 0

    def __len__(self) -> int:
        return len(self._pending)

    def records(self, topic: str) -> list[dict[str, Any]]:
        return [CODEC.decode(m.value()).record for m in list(self.delivered) if m.topic() == topic]


def memory_publisher() -> tuple[Publisher, MemoryProducer]:
    holder: list[MemoryProducer] = []

    def factory(conf: dict[str, Any]) -> MemoryProducer:
        holder.append(MemoryProducer(conf))
        return holder[0]

    pub = Publisher({}, producer_factory=factory)
    return pub, holder[0]


def config(tmp_path: Path, **kw: Any) -> AgentConfig:
    base: dict[str, Any] = {
        "hostname": "node-1",
        "interval_s": 0.1,
        "kubelet_socket": str(tmp_path / "absent.sock"),
        "kubelet_timeout_s": 0.3,
        "kmsg_path": None,
        "spool_dir": str(tmp_path / "spool"),
        "xid_merge_window_s": 2.0,
        "resolve_pids": False,
    }
    base.update(kw)
    return AgentConfig(**base)


# -- configuration ----------------------------------------------------------------------------------


def test_flags_become_the_agent_config() -> None:
    args = build_parser().parse_args(
        [
            "produce",
            "--source",
            "nvml",
            "--interval",
            "500ms",
            "--hostname",
            "gpu-node-7",
            "--kubelet-socket",
            "/run/k.sock",
            "--kubelet-timeout",
            "250ms",
            "--extra-resource-names",
            "example.com/gpu, vendor.io/*",
            "--kmsg-path",
            "-",
            "--xid-merge-window",
            "1s",
            "--spool-dir",
            "/tmp/s",
            "--spool-max-bytes",
            "4096",
            "--sample-queue-max",
            "77",
            "--slow-interval",
            "1m",
            "--profiling-interval",
            "2s",
            "--processes-interval",
            "10s",
        ]
    )
    c = config_from_args(args)
    assert (c.hostname, c.interval_s, c.kubelet_socket, c.kubelet_timeout_s) == (
        "gpu-node-7",
        0.5,
        "/run/k.sock",
        0.25,
    )
    assert c.extra_resource_names == ("example.com/gpu", "vendor.io/*")
    assert (c.kmsg_path, c.nvml_events, c.xid_merge_window_s) == ("-", True, 1.0)
    assert (c.spool_dir, c.spool_max_bytes, c.sample_queue_max) == ("/tmp/s", 4096, 77)
    assert (c.slow_interval_s, c.profiling_interval_s, c.processes_interval_s) == (60.0, 2.0, 10.0)


def test_defaults_and_switches() -> None:
    args = build_parser().parse_args(["produce", "--source", "nvml", "--no-kmsg", "--no-nvml-events"])
    c = config_from_args(args)
    assert c.kmsg_path is None and not c.nvml_events
    assert c.kubelet_socket == DEFAULT_SOCKET_PATH and c.spool_dir == "/var/lib/gpupipe/spool"
    assert c.hostname == default_hostname()
    off = config_from_args(argparse.Namespace(kubelet_socket=""))
    assert off.kubelet_socket is None and off.kmsg_path == "/dev/kmsg"


def test_hostname_prefers_node_name() -> None:
    assert default_hostname({"NODE_NAME": "k8s-node-3"}) == "k8s-node-3"
    assert default_hostname({}) != ""


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"interval_s": 0}, "interval"),
        ({"kubelet_timeout_s": 0}, "kubelet-timeout"),
        ({"kubelet_socket": "relative.sock"}, "absolute"),
        ({"sample_queue_max": 0}, "sample-queue-max"),
    ],
)
def test_bad_config_is_a_config_error(tmp_path: Path, kw: dict[str, Any], message: str) -> None:
    from gpupipe.common.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **kw)


# -- lifecycle --------------------------------------------------------------------------------------


def test_nvml_init_failure_is_a_clear_error_and_nothing_is_left_running(tmp_path: Path) -> None:
    fake = FakeNvml.node("H100", 2, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    pub, _ = memory_publisher()
    agent = NodeAgent(config(tmp_path), pub, ProducerMetrics(), CODEC, "s", "x", nvml=fake)
    with pytest.raises(NvmlInitError, match="NVML init failed: Driver Not Loaded"):
        agent.run(threading.Event())
    assert threading.active_count() < 50 and not agent._threads


def test_samples_enriched_and_graceful_shutdown(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    with FakeKubelet(combined_fixture()) as kubelet:
        cfg = config(tmp_path, kubelet_socket=kubelet.socket_path, kmsg_path=str(kmsg))
        with running_agent(cfg, pub, fake) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
            ra.ticks_after(2)
            ra.stop()
    assert fake.init_count == 0, "NVML shut down by the source and the event watcher"
    assert not any(t.is_alive() for t in ra.agent._threads)
    samples = mem.records("samples")
    last = {}
    for s in samples:
        last[s["mig"]["mig_uuid"] if s["mig"] else s["uuid"]] = s
    assert len(last) == 8 + 4
    assert [a["pod"] for a in last[UUIDS[0]]["allocations"]] == ["llama-ft-0"]
    assert [(a["pod"], a["replica"]) for a in last[SHARED]["allocations"]] == [
        ("dev-pod-1", 0),
        ("dev-pod-2", 1),
    ]
    assert [a["pod"] for a in last[MIG_ALICE]["allocations"]] == ["notebook-alice"]
    assert last[UUIDS[7]]["mig_enabled"] is True and last[UUIDS[7]]["allocations"] == []
    # Exclusive GPU: its process belongs to the holder; shared GPU without a resolver: unknown.
    assert [(p["pod"], p["container"]) for p in last[UUIDS[0]]["processes"]] == [("llama-ft-0", "trainer")]
    assert {p["pod"] for p in last[SHARED]["processes"]} == {None}
    assert metric(ra.registry, "gpupipe_producer_collect_duration_seconds_count", {"group": "fast"}) >= 2
    assert metric(ra.registry, "gpupipe_producer_samples_built_total") == len(samples)


def test_xids_merged_lost_gpu_and_malformed_lines(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    with FakeKubelet(combined_fixture()) as kubelet:
        cfg = config(tmp_path, kubelet_socket=kubelet.socket_path, kmsg_path=str(kmsg))
        with running_agent(cfg, pub, fake) as ra:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
            with kmsg.open("a") as f:
                f.write(find_line("xid_real.txt", "Xid (PCI:0000:9b:00): 119", "16:24:18") + "\n")
                f.write("NVRM: Xid (PCI:0000:9b:00 garbage\n")
                f.write("[ 12.3] NVRM: Xid (PCI:zz:yy): notanumber\n")
                f.write(find_line("xid_real.txt", "GPU-I:05") + "\n")
            fake.gpus[1].inject_xid(119)
            wait_for(lambda: ra.agent.xids_sent >= 2, 10, "two XID events")
            fake.gpus[3].lose()
            wait_for(lambda: ra.agent.xids_sent >= 3, 10, "gpu_lost event")
            ra.ticks_after(2)
            ra.stop()
    events = mem.records("xid")
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e)
    (x119,) = [e for e in events if e["xid"] == 119]
    assert (x119["source"], x119["pid"], x119["process_name"], x119["uuid"]) == (
        "nvml_kmsg",
        2024380,
        "nvidia-smi",
        UUIDS[1],
    )
    assert [a["pod"] for a in x119["allocations"]] == ["llama-ft-0"]
    (x94,) = [e for e in events if e["xid"] == 94]
    assert (x94["source"], x94["mig_uuid"], x94["gpu_instance_id"]) == ("kmsg", MIG_ALICE, 5)
    assert [a["pod"] for a in x94["allocations"]] == ["notebook-alice"]
    (lost,) = by_kind["gpu_lost"]
    assert (lost["uuid"], lost["gpu_index"], [a["pod"] for a in lost["allocations"]]) == (
        UUIDS[3],
        3,
        ["llama-ft-0"],
    )
    reg = ra.registry
    assert metric(reg, "gpupipe_producer_kmsg_malformed_lines_total") == 2
    assert metric(reg, "gpupipe_producer_xid_merged_total") == 1
    assert metric(reg, "gpupipe_producer_xid_events_total", {"kind": "gpu_lost"}) == 1
    assert metric(reg, "gpupipe_producer_gpus_lost") == 1
    assert metric(reg, "gpupipe_producer_xid_spool_depth") == 0
    # The other GPUs kept reporting after GPU 3 was lost; GPU 3 reports gpu_lost records.
    after = [s for s in mem.records("samples") if s["timestamp_ms"] >= lost["timestamp_ms"]]
    assert {s["gpu_index"] for s in after if not s["gpu_lost"]} >= {0, 1, 2, 4, 5, 6, 7}
    assert any(s["gpu_index"] == 3 and s["gpu_lost"] for s in after)
    assert [s for s in mem.records("samples") if s["uuid"] == UUIDS[1]][-1]["last_xid"] == 119


def test_kubelet_errors_are_counted_and_samples_keep_flowing(tmp_path: Path) -> None:
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with FakeKubelet(combined_fixture()) as kubelet:
        kubelet.set_garbage(True)
        with running_agent(config(tmp_path, kubelet_socket=kubelet.socket_path), pub, fake) as ra:
            wait_for(
                lambda: (
                    metric(ra.registry, "gpupipe_producer_kubelet_errors_total", {"kind": "bad_response"})
                    >= 2
                ),
                5,
                "bad_response errors",
            )
            ra.ticks_after(2)
            kubelet.clear_failures()
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "recovery")
            ra.ticks_after(2)
            ra.stop()
    firsts = [s for s in mem.records("samples") if s["uuid"] == UUIDS[0] and not s["mig"]]
    assert firsts[0]["allocations"] == [] and firsts[-1]["allocations"][0]["pod"] == "llama-ft-0"


def test_spool_replays_events_of_a_previous_run(tmp_path: Path) -> None:
    from gpupipe_producer.xid.spool import XidSpool

    spool = XidSpool(tmp_path / "spool")
    spool.append(b"GPU-x", b"left-over-event")
    spool.close()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path), pub, node_for_fixtures()) as ra:
        wait_for(lambda: ra.agent.sender is not None and ra.agent.sender.depth == 0, 5, "replay")
        ra.stop()
    assert [m.value() for m in mem.delivered if m.topic() == "xid"] == [b"left-over-event"]


def test_unusable_spool_dir_keeps_xids_in_memory_instead_of_a_crash(tmp_path: Path) -> None:
    # Review 1.1a: a root-owned hostPath made the spool raise PermissionError and the agent exit at
    # start (crash loop). Now: one log line, a metric, XIDs kept in memory and still delivered.
    (tmp_path / "file").write_text("")
    fake = node_for_fixtures()
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path, spool_dir=str(tmp_path / "file" / "spool")), pub, fake) as ra:
        ra.ticks_after(1)
        fake.gpus[1].inject_xid(48)
        wait_for(lambda: ra.agent.xids_sent >= 1, 5, "XID event")
        assert metric(ra.registry, "gpupipe_producer_xid_spool_on_disk") == 0
        assert metric(ra.registry, "gpupipe_producer_xid_spool_write_errors_total") >= 1
        ra.stop()
    assert [e["xid"] for e in mem.records("xid")] == [48]


def test_a_stale_kubelet_map_is_not_used(tmp_path: Path) -> None:
    import time

    from gpupipe_producer.kubelet.mapping import build_allocation_map, pod_resources_from_dict

    pub, _ = memory_publisher()
    agent = NodeAgent(
        config(tmp_path, kubelet_grace_s=0.01),
        pub,
        ProducerMetrics(),
        CODEC,
        "s",
        "x",
        nvml=node_for_fixtures(),
    )
    amap = build_allocation_map(pod_resources_from_dict(combined_fixture()))
    agent._amap_state = (amap, time.monotonic())
    assert agent.allocations is amap
    agent._amap_state = (amap, time.monotonic() - 2 * 0.1 - 0.3 - 0.01)  # 2 intervals + the timeout
    assert len(agent.allocations) == 0
