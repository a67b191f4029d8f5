"""Run the real ``gpupipe`` CLI with the fake NVML module (tests and benchmarks only).

    GPUPIPE_FAKE_NVML=H100:8:mig=7:procs=2 python tests/fake_nvml_cli.py produce --source nvml ...

``GPUPIPE_FAKE_NVML`` is read here and nowhere else: this launcher replaces
``gpupipe_producer.agent.node_agent.nvml_factory`` before calling
``gpupipe.commands.cli.main``. Production code never imports ``tests``. Spec:
``<model>:<count>`` (``H100``, ``H200``, ``A100``, ``L40S``) followed by
options ``mig=<gpu index>`` (that GPU in MIG mode with 3g.40gb + 2x 1g.10gb slices),
``procs=<n>`` (n compute processes per GPU), ``init-error`` (nvmlInit fails with
NVML_ERROR_DRIVER_NOT_LOADED), ``fixtures`` (the 8 GPUs of ``tests.agent_harness.node_for_fixtures``,
whose UUIDs the kubelet fixtures hold; the model and count are then ignored), ``events=any-set``
(events reach sets as NVIDIA's mock library hands them out: tests/fake_nvml_events.py),
``driver=<version>`` (620.10.01: a driver with GPU Operational Events, tests/fake_nvml_operational.py),
``salt=<text>`` (UUIDs derived from the text as well: several simulated nodes, distinct GPUs).

Faults from the test: with ``GPUPIPE_FAKE_NVML_FAULTS=<file>``, each line appended to the file is
done once, in order: ``xid <gpu> <code>``, ``lose <gpu>``, ``recover <gpu>``, ``goe <gpu> <event>`` (a
structured event of tests/fixtures/nvml/goe_r620_events.json), ``incident <gpu> <event>`` (its legacy
Xid event and the structured event).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (str(REPO), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

ENV = "GPUPIPE_FAKE_NVML"
FAULTS_ENV = "GPUPIPE_FAKE_NVML_FAULTS"


def build(spec: str):  # -> FakeNvml
    import pynvml

    from tests.fake_nvml import FakeNvml, FakeProcess

    model, _, rest = spec.partition(":")
    count_text, _, opts = rest.partition(":")
    init_error = None
    mig_index = None
    procs = 0
    fixtures = False
    delivery = "own-set"
    driver: dict[str, str] = {}
    salt = ""
    for opt in filter(None, opts.split(":")):
        key, _, value = opt.partition("=")
        if key == "mig":
            mig_index = int(value)
        elif key == "procs":
            procs = int(value)
        elif key == "init-error":
            init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        elif key == "fixtures":
            fixtures = True
        elif key == "events":
            delivery = value
        elif key == "driver":
            driver["driver_version"] = value
        elif key == "salt":
            salt = value
        else:
            raise SystemExit(f"{ENV}: unknown option {opt!r}")
    if fixtures:
        from tests.agent_harness import node_for_fixtures

        return node_for_fixtures(init_error=init_error, event_delivery=delivery, **driver)
    fake = FakeNvml.node(
        model or "H100", int(count_text or 8), init_error=init_error, event_delivery=delivery, **driver
    )
    for g in fake.gpus:
        if salt:
            from tests.fake_nvml import _det_uuid

            g.uuid = _det_uuid("GPU", salt, g.name, g.index)
        for k in range(procs):
            pid = 100_000 + 100 * g.index + k
            g.processes.append(FakeProcess(pid, f"python3-{k}", sm_util=40 + k, mem_util=10 + k))
            fake.process_names[pid] = f"python3-{k}"
    if mig_index is not None:
        fake.gpus[mig_index].enable_mig(["3g.40gb", "1g.10gb", "1g.10gb"])
    return fake


def _faults(fake, path: str) -> None:  # a daemon thread: reads what the test appends
    done = 0
    while True:
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines[done:]:
            verb, gpu, *rest = line.split()
            g = fake.gpus[int(gpu)]
            if verb == "xid":
                g.inject_xid(int(rest[0]))
            elif verb == "lose":
                g.lose()
            elif verb == "recover":
                g.recover()
            elif verb in ("goe", "incident"):
                from tests.fake_nvml_operational import goe_event

                inject = fake.inject_operational if verb == "goe" else fake.inject_incident
                inject(int(gpu), goe_event(rest[0]))
        done = len(lines)
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    spec = os.environ.get(ENV)
    if not spec:
        raise SystemExit(f"{ENV} is not set (e.g. H100:8:mig=7:procs=2)")
    fake = build(spec)
    if os.environ.get(FAULTS_ENV):
        threading.Thread(target=_faults, args=(fake, os.environ[FAULTS_ENV]), daemon=True).start()

    import gpupipe_producer.agent.node_agent as node_agent
    from gpupipe.commands import cli

    node_agent.nvml_factory = lambda: fake
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
