"""HPC jobs in the metrics: an ``hpc_job`` label as dcgm-exporter's --hpc-job-mapping-dir gives it."""

from __future__ import annotations

from gpupipe_producer.podmeta.hpc_jobs import job_allocation
from tests.unit.consumers.metrics.test_render import BASE, alloc, blank, expo, lines_of


def test_a_job_gets_an_hpc_job_label_and_no_pod_labels() -> None:
    text = expo(blank(gpu_temp_c=61.0, allocations=[job_allocation("4242")]))
    assert lines_of(text, "DCGM_FI_DEV_GPU_TEMP") == [f'DCGM_FI_DEV_GPU_TEMP{{{BASE},hpc_job="4242"}} 61']


def test_two_jobs_and_a_pod_on_one_gpu_are_three_series() -> None:
    allocs = [alloc("team-a", "train-0", "trainer"), job_allocation("7"), job_allocation("8")]
    text = expo(blank(gpu_temp_c=50.0, allocations=allocs))
    assert sorted(lines_of(text, "DCGM_FI_DEV_GPU_TEMP")) == sorted(
        [
            f'DCGM_FI_DEV_GPU_TEMP{{{BASE},container="trainer",namespace="team-a",pod="train-0"}} 50',
            f'DCGM_FI_DEV_GPU_TEMP{{{BASE},hpc_job="7"}} 50',
            f'DCGM_FI_DEV_GPU_TEMP{{{BASE},hpc_job="8"}} 50',
        ]
    )
