"""The kernel-log relay (``gpupipe-kmsg-relay``, a process here as in the DaemonSet) and the agent's
reader of its socket.

* Every connection gets the kernel log from its oldest record: the real ``/dev/kmsg`` of this
  machine (read only), and a followed file of records.
* The agent's reader skips what its cursor covers, reconnects when the relay restarts, and yields
  every later record once.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupipe_producer.kmsg_input import KmsgInput
from gpupipe_producer.xid.kmsg_reader import KmsgReader, decode_kmsg_record
from gpupipe_producer.xid.wake import WakeEvent
from tests.agent_harness import wait_for
from tests.kmsg_relay_proc import MANIFEST, RelayProcess
from tests.unit.producer.test_node_agent_resilience import XID48, XID79, record


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[Path, RelayProcess]]:
    dev = tmp_path / "ring"
    dev.write_text(record(1, "Linux version 6.8.0") + record(2, XID79))
    relay = RelayProcess(dev, tmp_path / "kmsg.sock").start()
    try:
        yield dev, relay
    finally:
        relay.stop()


def _records(sock_path: Path, n: int, timeout_s: float = 10.0) -> list[int]:
    """The sequence numbers of the first ``n`` records a new connection gets."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(sock_path))
        buf = b""
        seqs: list[int] = []
        while len(seqs) < n:
            chunk = s.recv(65536)
            assert chunk, f"the relay closed after {seqs}"
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                rec = decode_kmsg_record(line)
                if rec is not None:
                    seqs.append(rec.seq)
        return seqs[:n]


def test_every_connection_gets_the_log_from_its_oldest_record(ring: tuple[Path, RelayProcess]) -> None:
    dev, relay = ring
    assert _records(relay.sock, 2) == [1, 2]
    with dev.open("a") as f:
        f.write(record(3, XID48))
    assert _records(relay.sock, 3) == [1, 2, 3]  # a second reader: the backlog again, then what came
    assert relay.sock.stat().st_mode & 0o777 == 0o600


def test_the_real_kernel_log_is_served_from_its_oldest_record_to_each_reader(tmp_path: Path) -> None:
    # This machine's /dev/kmsg, read only: what the DaemonSet's relay serves.
    with open("/dev/kmsg", "rb", buffering=0) as dev:
        oldest = decode_kmsg_record(dev.read(16384))
    assert oldest is not None
    relay = RelayProcess("/dev/kmsg", tmp_path / "kmsg.sock").start()
    try:
        first, second = _records(relay.sock, 3), _records(relay.sock, 3)
        peak = relay.peak_rss_bytes()
    finally:
        relay.stop()
    # The sidecar's memory limit holds the relay with room to spare.
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    (c,) = [c for c in doc["spec"]["template"]["spec"]["initContainers"] if c["name"] == "kmsg-relay"]
    limit = int(c["resources"]["limits"]["memory"].removesuffix("Mi")) << 20
    assert peak * 1.5 <= limit, f"relay peak RSS {peak >> 20} MiB against a {limit >> 20} MiB limit"
    # The ring may have dropped its oldest records in between, never gained older ones.
    assert first[0] >= oldest.seq and second[0] >= oldest.seq
    assert first == sorted(first) and second[0] <= first[-1]


def test_a_reader_skips_its_cursor_and_the_relay_restart_repeats_nothing(
    ring: tuple[Path, RelayProcess],
) -> None:
    dev, relay = ring
    got: list[tuple[int, int | None]] = []
    stop = WakeEvent()

    def put(item: tuple[str, float, int, Any, int | None]) -> None:
        got.append((item[3].xid, item[4]))

    kin = KmsgInput(str(relay.sock), put, stop, after_seq=1, retry_s=0.2)
    t = threading.Thread(target=kin.run, name="kmsg-test")
    t.start()
    try:
        wait_for(lambda: got, 10, "the backlog's Xid 79")
        relay.stop()  # the sidecar restarts; meanwhile the GPU's memory fails
        with dev.open("a") as f:
            f.write(record(3, "eth0: link up") + record(4, XID48))
        relay.start()
        wait_for(lambda: len(got) >= 2, 10, "the Xid 48 logged while the relay was down")
        with dev.open("a") as f:
            f.write(record(5, XID79.replace("91:00", "b3:00")))
        wait_for(lambda: len(got) >= 3, 10, "a later Xid")
    finally:
        stop.set()
        t.join(10)
    assert got == [(79, 2), (48, 4), (79, 5)]  # record 1 under the cursor; nothing twice


def test_a_reader_of_a_relay_that_is_not_there_fails_to_its_caller(tmp_path: Path) -> None:
    sock = tmp_path / "kmsg.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))  # a socket file nobody listens on: a relay that died
    with pytest.raises(ConnectionRefusedError):
        list(KmsgReader(str(sock), follow=True))


def test_a_relay_that_cannot_open_its_device_makes_the_reader_fail_not_spin(tmp_path: Path) -> None:
    relay = RelayProcess(tmp_path / "no-such-device", tmp_path / "kmsg.sock").start()
    try:
        reader = KmsgReader(str(relay.sock), follow=True)
        with pytest.raises(ConnectionResetError):
            list(reader)
        assert reader.stats.reopened == 0  # one connection, not a loop of them
    finally:
        relay.stop()
