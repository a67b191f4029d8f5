"""The sample queue: bounded, oldest dropped first, handed over only below the in-flight limit."""

from gpupipe_producer.samples.queue import SampleQueue


def test_sample_queue_drops_oldest_and_respects_in_flight() -> None:
    sent: list[bytes] = []
    in_flight = {"n": 0}
    q = SampleQueue(lambda t, k, v: sent.append(v), lambda: in_flight["n"], maxlen=3, in_flight_limit=2)
    for i in range(5):
        q.put("t", b"k", str(i).encode())
    assert q.dropped == 2 and len(q) == 3
    assert q.pump() == 2 and sent == [b"2", b"3"]
    in_flight["n"] = 2
    assert q.pump() == 0
    in_flight["n"] = 0
    assert q.pump() == 1 and sent == [b"2", b"3", b"4"]
