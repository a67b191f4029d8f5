"""A kubelet outage bills tenants' time as flagged ``__unattributed__``, never silently
as ``__unallocated__`` capacity. The node agent (fake NVML, fake kubelet) marks its samples
``allocations_known=false`` while its kubelet map is missing or stale; chargeback bills those."""

from __future__ import annotations

from pathlib import Path

from gpupipe_consumers.chargeback.accounting import AccountingConfig, account
from gpupipe_schemas.meaning import UNALLOCATED, UNATTRIBUTED
from tests.agent_harness import combined_fixture, node_for_fixtures, running_agent
from tests.kubelet_fake import FakeKubelet
from tests.unit.producer.agent.test_node_agent import config, memory_publisher, wait_for


def samples_with(tmp_path: Path, kubelet_up: bool = False, **kw) -> list[dict]:
    pub, mem = memory_publisher()
    with running_agent(config(tmp_path, **kw), pub, node_for_fixtures()) as ra:
        if kubelet_up:
            wait_for(lambda: len(ra.agent.allocations) > 0, 5, "kubelet map")
        ra.ticks_after(2)
        ra.stop()
    return mem.records("samples")


def test_samples_say_when_the_kubelet_map_is_unknown(tmp_path: Path) -> None:
    down = samples_with(tmp_path, kubelet_socket=str(tmp_path / "absent.sock"))  # kubelet unreachable
    assert down and all(s["allocations_known"] is False and s["allocations"] == [] for s in down)
    off = samples_with(tmp_path, kubelet_socket=None)  # enrichment off: nothing unknown
    assert off and all(s["allocations_known"] is True for s in off)
    with FakeKubelet(combined_fixture()) as kubelet:
        up = samples_with(tmp_path, kubelet_up=True, kubelet_socket=kubelet.socket_path)
    fresh = [s for s in up if s["allocations"]]
    assert fresh and all(s["allocations_known"] is True for s in fresh)


def test_unknown_allocations_bill_unattributed_not_unallocated(tmp_path: Path) -> None:
    s = samples_with(tmp_path, kubelet_socket=str(tmp_path / "absent.sock"))[0]
    res = account(s, None, 0, AccountingConfig())
    assert {c.namespace for c in res.contributions} <= {UNATTRIBUTED, "__mig_shared__"}
    known = dict(s, allocations_known=True)
    assert {c.namespace for c in account(known, None, 0, AccountingConfig()).contributions} <= {
        UNALLOCATED,
        "__mig_shared__",
    }
