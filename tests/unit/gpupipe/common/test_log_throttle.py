"""gpupipe.common.log_throttle: a reconnect storm is one line and a count."""

from __future__ import annotations

from gpupipe.common import log_throttle


def test_repeat_throttle_holds_back_a_reconnect_storm() -> None:
    import logging

    now = [0.0]
    f = log_throttle.RepeatThrottle(every_s=10.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("gpupipe.kafka", logging.ERROR, __file__, 1, msg, (), None)

    storm = [f"Connect to ipv4#127.0.0.1:9092 failed (after {i}ms in state CONNECT)" for i in range(50)]
    passed = [r for r in (rec(m) for m in storm) if f.filter(r)]
    assert len(passed) == 1
    assert f.filter(rec("a different message"))
    now[0] = 10.5
    later = rec("Connect to ipv4#127.0.0.1:9092 failed (after 3ms in state CONNECT)")
    assert f.filter(later)
    assert later.getMessage().endswith("(49 similar lines held back)")
