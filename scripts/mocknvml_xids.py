"""Development check: NVML XID events on NVIDIA's mock libnvidia-ml, each printed with its GPU.

    LD_LIBRARY_PATH=/tmp/mocknvml .venv/bin/python scripts/mocknvml_xids.py \\
        ../shared/tools/mocknvml/configs/mock-nvml-config-h100.yaml

Writes a copy of the mock's device profile where GPU 0 falls off the bus with Xid 79 and GPU 2 reports
an uncorrectable ECC error with Xid 94 (the mock's per-device ``failure`` blocks, tripped after a
number of guarded NVML calls), points MOCK_NVML_CONFIG at it, polls every GPU with the agent's
NvmlSource so the failures trip, and prints each event the agent's XidEventWatcher delivers: the
GPU it was published on and the GPU whose event set delivered it. The mock hands a pending event to
whichever set waits, so before attribution by the event's device the XIDs came out on arbitrary GPUs.

Not a test and not a dependency (the mock library lives outside the repository: see its README);
the suite's NVML double reproduces the mock's delivery (tests/fake_nvml_events.py, ``any-set``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

FAULTS = {  # device index -> its failure block, as the mock's profile spells it
    0: "    failure:\n      mode: fallen_off_bus\n      after_calls: 60\n      xid:\n        code: 79\n",
    2: "    failure:\n      mode: ecc_uncorrectable\n      after_calls: 30\n      xid:\n        code: 94\n",
}


def faulted_profile(profile: str) -> str:
    """``profile`` with the failure blocks added after each faulted device's ``minor_number``."""
    out = profile
    for index, block in FAULTS.items():
        line = f"    minor_number: {index}\n"
        if line not in out:
            raise SystemExit(f"mocknvml_xids: no device {index} in the profile")
        out = out.replace(line, line + block, 1)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: mocknvml_xids.py MOCK_PROFILE.yaml (LD_LIBRARY_PATH at the mock library)")
    if not os.environ.get("MOCKNVML_XIDS_PROFILE"):
        path = Path(tempfile.mkdtemp(prefix="mocknvml-")) / "faults.yaml"
        path.write_text(faulted_profile(Path(argv[0]).read_text()))
        # The mock's Go runtime reads the environment the process started with, not putenv's:
        # start again with the faulted profile in it.
        env = {**os.environ, "MOCK_NVML_CONFIG": str(path), "MOCKNVML_XIDS_PROFILE": str(path)}
        os.execve(sys.executable, [sys.executable, __file__, *argv], env)

    from gpupipe_producer.nvml import NvmlSource, XidEventWatcher, default_nvml_module

    nvml = default_nvml_module()
    source = NvmlSource(nvml, "mock-node")
    source.start()
    events: list[dict] = []

    def show(ev: dict) -> None:
        events.append(ev)
        print(
            f"Xid {ev.get('xid')} published on GPU {ev['gpu_index']} ({ev['uuid']}, {ev['pci_bus_id']}), "
            f"gpu_instance_id={ev.get('gpu_instance_id')}; delivered by GPU {ev.get('set_gpu_index')}'s set",
            flush=True,
        )

    watcher = XidEventWatcher(nvml, show, timeout_ms=500, mig_uuid_lookup=source.mig_uuid_for)
    watcher.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(events) < len(FAULTS):
        source.poll()  # guarded calls: the mock's failures trip after enough of them
        time.sleep(0.2)
    print("lost by polling:", [(g.gpu_index, g.uuid) for g in source.lost_gpus])
    print("deliveries:", dict(watcher.delivery_counts))
    watcher.stop()
    source.shutdown()
    return 0 if len(events) == len(FAULTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
