"""kill -9 of the alerts service before it committed: the restart replays what it had counted.

Found by the 30 s outage drill (bench/bench_outage_drill.py): after the broker came back, its group
coordinator was away for 45 s; the alerts service kept consuming and publishing, committed nothing,
and its restart replayed that minute of XIDs on top of the restored counts. Here the same gap is
made certain: auto-commits are spaced 10 minutes apart and the process is killed, so it never
commits; the restarted instance must count each XID once and never publish an (alert_id,
sequence) twice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gpupipe.kafka import topics
from tests.integration.consumers.alerts.test_service import (
    AlertsProcess,
    TopicReader,
    _topics,
    produce,
    wait_until,
    xid_event,
)

T0 = 1_800_000_000_000
BUS = "0000:18:00"


def test_a_killed_instance_s_uncommitted_input_is_not_counted_twice(
    kafka: str, topic_prefix: str, tmp_path: Path
) -> None:
    t = _topics(kafka, topic_prefix)
    xids = [xid_event("node-a", BUS, 79, T0 + i * 1000) for i in range(7)]
    produce(kafka, t[topics.XID], "XidEvent", xids[:5])
    reader = TopicReader(kafka, t[topics.ALERTS])
    flags = (
        *("--kafka-config", "auto.commit.interval.ms=600000"),  # no commit before it is killed
        *("--kafka-config", "session.timeout.ms=6000"),  # the killed member leaves the group soon
        *("--update-interval", "0s"),  # every count goes out at once
    )
    first = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
    try:

        def gpu_alert(code: int, n: int) -> dict | None:
            for r in reader.latest().values():
                if r["xid_codes"][:1] == [code] and r["occurrences"] >= n:
                    return r
            return None

        wait_until(lambda: gpu_alert(79, 5), 60, "the Xid 79 alert with 5 occurrences")
        assert first.proc is not None
        first.proc.kill()  # SIGKILL: no close, no commit
        first.proc.wait(10)
    finally:
        first.stop()
    second = AlertsProcess(kafka, topic_prefix, tmp_path, *flags).start()
    try:
        # 2 more, then a marker on the same GPU (same key, same partition: processed after them)
        marker = xid_event("node-a", BUS, 13, T0 + 10_000)
        produce(kafka, t[topics.XID], "XidEvent", [*xids[5:], marker])
        wait_until(lambda: gpu_alert(13, 1), 60, "the marker's alert")
        alert = gpu_alert(79, 1)
        assert alert is not None and alert["occurrences"] == 7, alert and alert["occurrences"]  # was 10
        twice = [
            k for k, n in Counter((r["alert_id"], r["sequence"]) for r in reader.records).items() if n > 1
        ]
        assert twice == []
        assert "alerts restored" in second.log_text()
    finally:
        assert second.stop() == 0, second.log_text()[-3000:]
        reader.close()
