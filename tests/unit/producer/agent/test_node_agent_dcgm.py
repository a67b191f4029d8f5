"""The agent fills profiling fields of GPUs without GPM from the node's dcgm-exporter (a local HTTP server
serving a real A100 MIG scrape), marks their source, and keeps GPM's own on a Hopper GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpupipe.commands.cli import build_parser
from gpupipe.common.errors import ConfigError
from gpupipe_producer.agent_config import config_from_args
from tests.agent_harness import metric, running_agent, wait_for
from tests.fake_nvml import FakeGpu, FakeMigSlice, FakeNvml
from tests.unit.producer.agent.test_node_agent import config, memory_publisher
from tests.unit.producer.samples.test_dcgm_scraper import Exporter

A100 = "GPU-2c2f45e8-0886-e3cc-02be-a4181a13fc9b"  # the GPU of tests/fixtures/dcgm/a100-pcie-mig.prom


def node() -> FakeNvml:
    a100 = FakeGpu.a100(0, uuid=A100)
    a100.enable_mig([FakeMigSlice("1g.10gb", gi) for gi in (8, 9, 10)])
    return FakeNvml([a100, FakeGpu.h100(1)])


def last_by_device(records: list[dict[str, Any]]) -> dict[tuple[str, int | None], dict[str, Any]]:
    out = {}
    for r in records:
        out[(r["uuid"], r["mig"]["gpu_instance_id"] if r["mig"] else None)] = r
    return out


def test_an_a100_without_gpm_gets_the_exporters_ratios_marked_with_their_source(tmp_path: Path) -> None:
    ex = Exporter()
    ex.body = (Path(__file__).resolve().parents[3] / "fixtures" / "dcgm" / "a100-pcie-mig.prom").read_bytes()
    fake = node()
    h100 = fake.gpus[1].uuid
    pub, mem = memory_publisher()
    cfg = config(tmp_path, kubelet_socket=None, dcgm_exporter_url=ex.url, profiling_interval_s=0.1)
    try:
        with running_agent(cfg, pub, fake) as ra:

            def both_sources() -> bool:
                last = last_by_device(mem.records("samples"))
                return (
                    (A100, 9) in last
                    and last[(A100, 9)]["profiling_source"] == "dcgm-exporter"
                    and ((h100, None) in last and last[(h100, None)]["profiling_source"] == "gpm")
                )

            wait_for(both_sources, 10, "samples from both sources")
            errors = metric(ra.registry, "gpupipe_producer_dcgm_scrape_errors_total", {"kind": "connect"})
            ra.stop()
    finally:
        ex.close()
    last = last_by_device(mem.records("samples"))
    assert last[(A100, 8)]["gr_engine_active_ratio"] == 0.029399
    assert last[(A100, 9)]["gr_engine_active_ratio"] == 0.033893
    assert last[(A100, 10)]["gr_engine_active_ratio"] == 0.0
    assert last[(A100, None)]["profiling_source"] is None  # the exporter lists no parent series in MIG mode
    assert last[(h100, None)]["sm_active_ratio"] is not None  # GPM's own value, not replaced
    assert errors == 0


def test_an_exporter_that_never_answers_leaves_the_fields_null_and_is_counted(tmp_path: Path) -> None:
    fake = FakeNvml([FakeGpu.a100(0, uuid=A100)])
    pub, mem = memory_publisher()
    cfg = config(
        tmp_path,
        kubelet_socket=None,
        dcgm_exporter_url="http://127.0.0.1:9/metrics",
        profiling_interval_s=0.1,
    )
    with running_agent(cfg, pub, fake) as ra:
        wait_for(
            lambda: (
                metric(ra.registry, "gpupipe_producer_dcgm_scrape_errors_total", {"kind": "connect"}) >= 2
            ),
            10,
            "counted scrape failures",
        )
        ra.ticks_after(2)
        ra.stop()
    samples = mem.records("samples")
    assert samples and all(s["profiling_source"] is None and s["sm_active_ratio"] is None for s in samples)


def test_the_flag_becomes_the_config_and_a_bad_url_is_one_config_error(tmp_path: Path) -> None:
    argv = ["produce", "--source", "nvml", "--dcgm-exporter-url", "http://localhost:9400/metrics"]
    assert (
        config_from_args(build_parser().parse_args(argv)).dcgm_exporter_url == "http://localhost:9400/metrics"
    )
    assert config_from_args(build_parser().parse_args(argv[:3])).dcgm_exporter_url is None
    with pytest.raises(ConfigError, match="dcgm-exporter-url"):
        config(tmp_path, dcgm_exporter_url="localhost:9400")
