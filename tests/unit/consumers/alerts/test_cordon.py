"""Cordoning through the (fake) Kubernetes API: PATCH, auth, failures, rate limit, dry run, ledger restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpupipe.clients.kube import KubeClient, KubeConfig
from gpupipe_consumers.alerts.cordon import (
    PATCH_CONTENT_TYPE,
    Cordoner,
    CordonResult,
    KubeNodeApi,
    SlidingWindowLimiter,
)
from tests.k8s_api_fake import FakeKubeApi

T0 = 1_800_000_000_000
MIN = 60_000
HOUR = 60 * MIN


class Clock:
    def __init__(self) -> None:
        self.ms = T0

    def __call__(self) -> float:
        return self.ms / 1000


def rec(node: str, aid: str = "a1") -> dict[str, Any]:
    return {"alert_id": aid, "hostname": node, "summary": f"CRITICAL: XID 79 on {node}", "drain_node": True}


def make(
    api: FakeKubeApi | None,
    tmp_path: Path,
    *,
    dry_run: bool = False,
    limit: int = 2,
    token: str = "tok",
    max_share: float = 1.0,
    uncordon: bool = False,
):
    results: list[CordonResult] = []
    client = None
    if api is not None:
        tf = tmp_path / "token"
        tf.write_text(token + "\n")
        client = KubeNodeApi(KubeClient(KubeConfig(api.url, str(tf), None), timeout_s=0.5))
    clock = Clock()
    c = Cordoner(
        client,
        dry_run=dry_run,
        max_per_hour=limit,
        on_result=results.append,
        instance="i1",
        clock=clock,
        max_share=max_share,
        uncordon=uncordon,
    )
    return c, results, clock


def test_sliding_window_limiter() -> None:
    lim = SlidingWindowLimiter(2, HOUR)
    assert lim.allow(T0)
    lim.record(T0)
    lim.record(T0 + 10 * MIN)
    assert not lim.allow(T0 + 59 * MIN)
    assert lim.next_free_ms(T0 + 59 * MIN) == T0 + HOUR
    assert lim.allow(T0 + HOUR)  # the first one left the window
    assert lim.count(T0 + HOUR) == 1
    zero = SlidingWindowLimiter(0)
    assert not zero.allow(T0)


def test_cordon_patches_node_with_token_and_annotations(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a"], token="tok") as api:
        c, results, _ = make(api, tmp_path)
        r = c.process(rec("node-a"))
        assert r.outcome == "cordoned" and results == [r]
        assert api.node("node-a")["spec"]["unschedulable"] is True
        patch = api.requests[-1]
        assert patch.method == "PATCH" and patch.path == "/api/v1/nodes/node-a"
        assert patch.headers["content-type"] == PATCH_CONTENT_TYPE
        assert patch.headers["authorization"] == "Bearer tok"
        body = patch.json()
        assert body["spec"] == {"unschedulable": True}
        ann = body["metadata"]["annotations"]
        assert (
            ann["gpupipe.io/cordon-alert-id"] == "a1" and ann["gpupipe.io/cordoned-by"] == "gpupipe-alerts/i1"
        )
        assert api.requests[0].method == "GET"


def test_rate_limit_caps_cordons_per_hour(tmp_path: Path) -> None:
    nodes = [f"node-{i}" for i in range(5)]
    with FakeKubeApi(nodes, token="tok") as api:
        c, _, clock = make(api, tmp_path, limit=2)
        outcomes = []
        for n in nodes[:3]:
            clock.ms += MIN
            outcomes.append(c.process(rec(n)).outcome)
        assert outcomes == ["cordoned", "cordoned", "rate_limited"]
        assert len(api.patches()) == 2 and "unschedulable" not in api.node("node-2")["spec"]
        clock.ms = T0 + HOUR + MIN  # the first cordon left the window
        assert c.process(rec("node-3")).outcome == "cordoned"
        assert c.process(rec("node-4")).outcome == "rate_limited"


def test_already_cordoned_is_not_counted(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a", "node-b"], token="tok") as api:
        api.set_unschedulable("node-a")
        c, _, _ = make(api, tmp_path, limit=1)
        assert c.process(rec("node-a")).outcome == "already_cordoned"
        assert api.patches() == []
        assert c.process(rec("node-b")).outcome == "cordoned"


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda api: api.fail_next(500), "500"),
        (lambda api: api.fail_next(403), "403"),
        (lambda api: None, "404"),  # unknown node
    ],
)
def test_api_failures_are_results_not_crashes(tmp_path: Path, setup: Any, needle: str) -> None:
    with FakeKubeApi(["node-a"], token="tok") as api:
        setup(api)
        c, _, clock = make(api, tmp_path)
        node = "node-a" if needle != "404" else "ghost"
        r = c.process(rec(node))
        assert r.outcome == "failed" and needle in r.detail
        assert c.limiter.count(T0) == 0
        assert not c.request(rec(node))  # backing off (5 s, doubling)
        clock.ms += 5_000
        assert c.request(rec(node))  # then retried (the reconcile asks again for every open drain alert)


def test_wrong_token_and_timeout_fail(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a"], token="right") as api:
        c, _, _ = make(api, tmp_path, token="wrong")
        r = c.process(rec("node-a"))
        assert r.outcome == "failed" and "401" in r.detail
        c2, _, _ = make(api, tmp_path, token="right")
        api.set_delay(2.0)
        r2 = c2.process(rec("node-a"))
        assert r2.outcome == "failed" and "timed out" in r2.detail


def test_dry_run_never_calls_the_api_and_applies_the_limit(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a"], token="tok") as api:
        c, results, _ = make(None, tmp_path, dry_run=True, limit=1)
        assert c.process(rec("node-a")).outcome == "dry_run"
        assert c.process(rec("node-b")).outcome == "rate_limited"
        assert all(r.dry_run for r in results)
        assert api.requests == []


def test_request_dedupes_per_node_and_worker_processes(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a", "node-b"], token="tok") as api:
        c, results, _ = make(api, tmp_path, limit=5)
        c.start()
        try:
            assert c.request(rec("node-a", "x1"))
            c.request(rec("node-a", "x2"))  # queued or decided already: not a second cordon
            assert c.request(rec("node-b", "x3"))
            assert api.wait_for(lambda: len(results) == 2 and c.idle())
            assert not c.request(rec("node-a", "x4"))
        finally:
            c.stop()
        assert sorted(r.node for r in results) == ["node-a", "node-b"]
        assert len(api.patches("node-a")) == 1


def test_restore_ledger_from_action_records(tmp_path: Path) -> None:
    c, _, _ = make(None, tmp_path, dry_run=True, limit=2)

    def act(node: str, outcome: str, at: int, dry: bool = True) -> dict[str, Any]:
        return {
            "status": "action",
            "remediation": {"kind": "cordon", "outcome": outcome, "node": node, "dry_run": dry, "at_ms": at},
        }

    counted = c.restore(
        [
            act("n1", "dry_run", T0 - 10 * MIN),
            act("n2", "dry_run", T0 - 2 * HOUR),  # outside the window
            act("n3", "cordoned", T0 - MIN, dry=False),  # a real run's record: not ours
            act("n4", "rate_limited", T0 - MIN),
            {"status": "firing"},
        ],
        now_ms=T0,
    )
    assert counted == 1 and c.limiter.count(T0) == 1
    assert not c.request(rec("n1")) and not c.request(rec("n4"))
    assert c.process(rec("n5")).outcome == "dry_run"
    assert c.process(rec("n6")).outcome == "rate_limited"


def test_fake_rejects_non_patch_content_type() -> None:
    import urllib.error
    import urllib.request

    with FakeKubeApi(["n"]) as api:
        req = urllib.request.Request(
            api.url + "/api/v1/nodes/n", data=b"{}", method="PATCH", headers={"Content-Type": "text/plain"}
        )
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=2)
        assert exc.value.code == 415


def test_a_patch_answered_too_late_counts_against_the_limit(tmp_path: Path) -> None:
    # The API server applies each PATCH but answers after the client gave up: the attempts count.
    nodes = [f"cn-{i:02}" for i in range(8)]
    with FakeKubeApi(nodes, token="tok") as api:
        api.set_late_answer(1.0)
        c, results, _ = make(api, tmp_path, limit=2)
        for i, node in enumerate(nodes):
            c.process(rec(node, f"a{i}"))
        for node in nodes:  # the retries after the timeouts
            c.process(rec(node, "again"))
        cordoned = [n for n in nodes if api.node(n)["spec"].get("unschedulable")]
        assert len(cordoned) == 2, cordoned
        assert len(api.patches()) == 2
        assert [r.outcome for r in results[:2]] == ["failed", "failed"]
        assert all("may have taken effect" in r.detail for r in results[:2])
        assert {r.outcome for r in results[2:8]} == {"rate_limited"}


def test_a_patch_the_server_refused_gives_its_slot_back(tmp_path: Path) -> None:
    with FakeKubeApi(["node-a", "node-b"], token="tok") as api:
        c, results, _ = make(api, tmp_path, limit=1)
        api.refuse_patches(422)
        c.process(rec("node-a", "a1"))
        assert results[-1].outcome == "failed" and "may have taken effect" not in results[-1].detail
        assert not api.node("node-a")["spec"].get("unschedulable")
        api.refuse_patches(None)
        c.process(rec("node-b", "a2"))  # the refused attempt left its slot free
        assert results[-1].outcome == "cordoned"


def test_the_double_count_guard_forgets_what_left_the_window(tmp_path: Path) -> None:
    """Months of cordons keep a few hours' worth of (node, time) pairs, not one per cordon."""
    c, _, clock = make(None, tmp_path, dry_run=True, limit=2)
    for h in range(2000):
        clock.ms = T0 + h * HOUR
        assert c.process(rec(f"n{h}")).outcome == "dry_run"
    assert len(c._counted) <= 16
    assert c.limiter.count(clock.ms) == 1
    # a replay of the latest decision is still not counted twice
    assert c.restore([_action(f"n{h}", clock.ms)], now_ms=clock.ms) == 0


def _action(node: str, at: int) -> dict[str, Any]:
    return {
        "status": "action",
        "remediation": {"kind": "cordon", "outcome": "dry_run", "node": node, "dry_run": True, "at_ms": at},
    }
