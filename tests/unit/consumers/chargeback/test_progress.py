"""W1: the progress publisher commits true positions to <group>.progress, at most every interval,
polls its requests from the caller's thread, and waits for them (bounded) when it closes."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from gpupipe_consumers.chargeback.progress import ProgressPublisher


class FakeAdmin:
    """alter_consumer_group_offsets with the client's shapes: {request: Future}."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.futures: list[Future] = []

    def alter_consumer_group_offsets(self, reqs: list[Any]) -> dict[Any, Future]:
        fut: Future = Future()
        self.requests.append(reqs[0])
        self.futures.append(fut)
        return {reqs[0]: fut}


def test_publishes_changed_positions_at_most_every_interval() -> None:
    now = [0.0]
    admin = FakeAdmin()
    pub = ProgressPublisher(admin, "g.progress", "in", interval_s=5.0, clock=lambda: now[0])
    pub.maybe_publish({0: 10, 1: 20})
    (req,) = admin.requests
    assert req.group_id == "g.progress"
    assert [(tp.topic, tp.partition, tp.offset) for tp in req.topic_partitions] == [
        ("in", 0, 10),
        ("in", 1, 20),
    ]
    now[0] = 1.0
    pub.maybe_publish({0: 11, 1: 20})
    assert len(admin.requests) == 1  # within the interval
    admin.futures[0].set_result(None)
    now[0] = 6.0
    pub.maybe_publish({0: 11, 1: 20})
    assert [(tp.partition, tp.offset) for tp in admin.requests[1].topic_partitions] == [
        (0, 11)
    ]  # changed only


def test_a_failed_request_publishes_everything_again_and_close_waits() -> None:
    admin = FakeAdmin()
    pub = ProgressPublisher(admin, "g.progress", "in", interval_s=0.0)
    pub.maybe_publish({0: 10})
    admin.futures[0].set_exception(RuntimeError("coordinator not available"))
    pub.maybe_publish({0: 10})
    assert pub.failures == 1 and len(admin.requests) == 2
    pub.close(timeout_s=0.01)  # the second is still in flight: bounded wait, then let go
    assert pub.admin is None and pub.pending == []
