"""NVML collection cost per tick for 8 GPUs, with the fast group batched into one
``nvmlDeviceGetFieldValues`` call against the same source with batching off.

Which NVML: NVIDIA's mock ``libnvidia-ml`` loaded by the real ``pynvml`` when it is present (a
development aid: ``GPUPIPE_MOCK_NVML`` = the ``.so.1`` or its ``.gz``, else
``../shared/tools/mocknvml/libnvidia-ml.so.*.gz`` next to the repository); otherwise the project's
fake NVML (``tests/fake_nvml.py``). The first line says which. The mock is loaded by re-running
this script with ``LD_LIBRARY_PATH`` and ``MOCK_NVML_CONFIG`` (H100 profile, 8 GPUs) set.

Figures: CPU ms per tick (``time.process_time``, NVML's own cost included), fast group only and all
groups at default intervals, batched and unbatched (every batched field forced back to its
classic call), and the share of one core at a 1 s interval.

* ``nvml_fast_calls_batching ratio=<NVML calls per tick unbatched / batched> target=1.30``: on a
  real driver every NVML entry point is at least one ioctl into the kernel (tens of microseconds),
  so calls are what batching saves; the mock answers in 1-3 us, so its CPU figures barely move
  (both are printed, measured on this machine).
* ``nvml_tick_core_share ratio=<2 % / share> target=1.00`` (all groups, batched: under 2 % of a core)

Run: ``.venv/bin/python bench/bench_nvml_tick.py``.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, figure, ratio_line

GPUS = 8
TICKS = int(os.environ.get("GPUPIPE_BENCH_NVML_TICKS", "300"))
BATCH_KEYS = ("fi_power", "fi_power_limit", "fi_energy", "fi_viol_power", "fi_viol_thermal")
_CHILD = "GPUPIPE_BENCH_NVML_CHILD"


def find_mock() -> Path | None:
    env = os.environ.get("GPUPIPE_MOCK_NVML")
    if env:
        return Path(env) if Path(env).exists() else None
    shared = REPO.parent / "shared" / "tools" / "mocknvml"
    found = sorted(shared.glob("libnvidia-ml.so.*.gz")) if shared.is_dir() else []
    return found[0] if found else None


def rerun_with_mock(lib: Path) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="mocknvml-"))
    try:
        target = tmp / "libnvidia-ml.so.1"
        if lib.suffix == ".gz":
            with gzip.open(lib, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(lib, target)
        (tmp / "libnvidia-ml.so").symlink_to("libnvidia-ml.so.1")
        config = lib.parent / "configs" / "mock-nvml-config-h100.yaml"
        env = {
            **os.environ,
            _CHILD: "mock",
            "LD_LIBRARY_PATH": f"{tmp}:{os.environ.get('LD_LIBRARY_PATH', '')}",
            "MOCK_NVML_CONFIG": str(config),
            "MOCK_NVML_NUM_DEVICES": str(GPUS),
        }
        return subprocess.run([sys.executable, __file__], env=env, check=False).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Counting:
    """The NVML module with every device call counted (exception classes and constants as is)."""

    def __init__(self, module: Any) -> None:
        self._m = module
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._m, name)
        if name.startswith("nvmlDevice") and callable(value):

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return value(*args, **kwargs)

            return counted
        return value


def make_source(kind: str, collectors: tuple[str, ...] | None, module: Any = None) -> Any:
    from gpupipe_producer.nvml import NvmlSource

    if kind == "mock":
        import pynvml

        src = NvmlSource(module or pynvml, "bench-node", None, collectors=collectors)
    else:
        from tests.fake_nvml import FakeClock, FakeNvml

        clock = FakeClock()
        fake = FakeNvml.node("H100", GPUS, clock=clock)
        src = NvmlSource(
            Counting(fake) if module is not None else fake,
            "bench-node",
            None,
            clock,
            clock.wall,
            collectors=collectors,
        )
        src._bench_clock = clock  # type: ignore[attr-defined]
    src.start()
    return src


def force_classic(g: Any) -> None:
    """Every batched field answered as NVML answers an unsupported one (learned for good), so the
    source reads it with its classic call."""
    for key in BATCH_KEYS:
        g.ctx.unsupported.add(key, "NotSupported")


def calls_per_tick(kind: str, batched: bool) -> float:
    import pynvml

    counting = Counting(pynvml)
    src = make_source(kind, ("fast",), counting)
    if not batched:
        for g in src._table.entries:
            force_classic(g)
    src.poll()
    nvml = src._nvml
    before = nvml.calls
    clock = getattr(src, "_bench_clock", None)
    for k in range(30):
        if clock is not None:
            clock.advance(1.0)
            src.poll()
        else:
            src.poll(now=time.monotonic() + k + 1.0)
    n = (nvml.calls - before) / 30
    src.shutdown()
    return n


def cpu_per_tick(kind: str, collectors: tuple[str, ...] | None, batched: bool) -> float:
    src = make_source(kind, collectors)
    if not batched:
        for g in src._table.entries:
            force_classic(g)  # every batched field back to its classic call
    clock = getattr(src, "_bench_clock", None)
    src.poll()
    t0 = time.process_time()
    for k in range(TICKS):
        if clock is not None:
            clock.advance(1.0)
            src.poll()
        else:
            src.poll(now=time.monotonic() + k + 1.0)  # default intervals, without sleeping
    spent = time.process_time() - t0
    src.shutdown()
    return spent / TICKS * 1000.0


def main() -> int:
    kind = os.environ.get(_CHILD)
    if kind is None:
        lib = find_mock()
        if lib is not None:
            return rerun_with_mock(lib)
        kind = "fake"
    sys.path.insert(0, str(REPO))
    what = "NVIDIA mock libnvidia-ml via pynvml (H100 profile)" if kind == "mock" else "project fake NVML"
    print(f"NVML: {what}, {GPUS} GPUs, {TICKS} ticks", flush=True)
    calls_b, calls_u = calls_per_tick(kind, True), calls_per_tick(kind, False)
    figure("fast_group_nvml_calls_per_tick_batched", calls_b)
    figure("fast_group_nvml_calls_per_tick_unbatched", calls_u)
    fast_b = min(cpu_per_tick(kind, ("fast",), True) for _ in range(3))
    fast_u = min(cpu_per_tick(kind, ("fast",), False) for _ in range(3))
    all_b = min(cpu_per_tick(kind, None, True) for _ in range(3))
    all_u = min(cpu_per_tick(kind, None, False) for _ in range(3))
    figure("fast_group_cpu_ms_per_tick_batched", round(fast_b, 3), "ms")
    figure("fast_group_cpu_ms_per_tick_unbatched", round(fast_u, 3), "ms")
    figure("all_groups_cpu_ms_per_tick_batched", round(all_b, 3), "ms")
    figure("all_groups_cpu_ms_per_tick_unbatched", round(all_u, 3), "ms")
    share = all_b / 1000.0 * 100.0  # % of one core at a 1 s interval
    figure("core_share_at_1s_interval", round(share, 3), "%")
    ratio_line("nvml_fast_calls_batching", calls_u / calls_b, 1.3)
    ratio_line("nvml_tick_core_share", 2.0 / share, 1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
