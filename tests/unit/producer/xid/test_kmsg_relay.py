"""The kernel-log relay (``gpupipe-kmsg-relay``, a process here as in the DaemonSet) and the agent's
reader of its socket.

* Every connection gets the kernel log from its oldest record: the real ``/dev/kmsg`` of this
  machine (read only), and a followed file of records.
* The agent's reader skips what its cursor covers, reconnects when the relay restarts, and yields
  every later record once.
* Each reader is served on its own: a client that never reads, or that writes at the relay, delays
  no other reader's records (the relay's send timeout is set far above what the tests wait).
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpupipe_producer.xid import kmsg_relay
from gpupipe_producer.xid.kmsg_input import KmsgInput
from gpupipe_producer.xid.kmsg_reader import KmsgReader, decode_kmsg_record
from gpupipe_producer.xid.wake import WakeEvent
from tests.agent_harness import wait_for
from tests.kmsg_relay_proc import MANIFEST, RelayProcess
from tests.unit.producer.agent.test_node_agent_resilience import XID48, XID79, record


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[tuple[Path, RelayProcess]]:
    dev = tmp_path / "ring"
    dev.write_text(record(1, "Linux version 6.8.0") + record(2, XID79))
    relay = RelayProcess(dev, tmp_path / "kmsg.sock").start()
    try:
        yield dev, relay
    finally:
        relay.stop()


def _memory_limit() -> int:
    """The kmsg-relay sidecar's memory limit in the shipped DaemonSet, in bytes."""
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    (c,) = [c for c in doc["spec"]["template"]["spec"]["initContainers"] if c["name"] == "kmsg-relay"]
    return int(c["resources"]["limits"]["memory"].removesuffix("Mi")) << 20


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


def test_a_reader_that_hangs_up_frees_its_place(ring: tuple[Path, RelayProcess]) -> None:
    _, relay = ring
    for _ in range(6):  # more than --max-readers, one after the other
        assert _records(relay.sock, 2) == [1, 2]


def test_the_socket_is_listening_once_there_and_replaces_only_a_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.sock"
    relay = kmsg_relay.Relay(str(tmp_path / "ring"), str(path))
    relay.listen().close()  # a relay that died: its socket file stays
    with relay.listen() as srv, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(path))  # the startup probe's `test -S` passing means this succeeds
        srv.accept()[0].close()
    assert path.stat().st_mode & 0o777 == 0o600 and sorted(tmp_path.iterdir()) == [path]
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(FileExistsError):
        relay.listen()
    assert path.read_text() == "not a socket"


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
    limit = _memory_limit()
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


# -- each reader on its own ----------------------------------------------------------------------
#: Far above every wait below: a relay that let one client hold the others would fail each test.
_SEND_TIMEOUT = "--send-timeout=20"
_BACKLOG = 10_000  # records of ~110 bytes: about 1 MiB, more than a socket's buffers hold


@pytest.fixture
def big_ring(tmp_path: Path) -> Path:
    dev = tmp_path / "ring"
    dev.write_text("".join(record(i, "x" * 90 + f" backlog {i}") for i in range(1, _BACKLOG + 1)))
    return dev


def _mark(dev: Path, seq: int) -> bytes:
    with dev.open("a") as f:
        f.write(record(seq, f"MARK {seq}"))
    return f"MARK {seq}".encode()


class _Agent:
    """A reader that takes everything at once, as the agent does; it keeps the lines with a mark."""

    def __init__(self, sock: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(sock))
        self.lines = 0
        self.marks: list[bytes] = []
        self._thread = threading.Thread(target=self._run, name="kmsg-agent")
        self._thread.start()

    def _run(self) -> None:
        buf = b""
        while chunk := self.sock.recv(65536):
            *lines, buf = (buf + chunk).split(b"\n")
            self.lines += len(lines)
            self.marks += [line for line in lines if b"MARK " in line or b"injected" in line]

    def saw(self, mark: bytes) -> bool:
        return any(line.endswith(mark) for line in self.marks)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # ends the thread's recv
        self._thread.join(10)
        self.sock.close()


def _silent(sock: Path) -> socket.socket:
    """A client that never reads, once the relay has begun to send it the backlog."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    assert select.select([s], [], [], 20)[0], "the relay sent a new client nothing"
    return s


def test_a_client_that_never_reads_delays_no_other_reader(big_ring: Path, tmp_path: Path) -> None:
    relay = RelayProcess(big_ring, tmp_path / "kmsg.sock", _SEND_TIMEOUT).start()
    agent = _Agent(relay.sock)
    silent: list[socket.socket] = []
    try:
        wait_for(lambda: agent.lines >= _BACKLOG, 20, "the agent's backlog")
        for seq in (_BACKLOG + 1, _BACKLOG + 2):
            # a client whose backlog fills its socket, the relay's data for it left untaken
            silent.append(_silent(relay.sock))
            mark = _mark(big_ring, seq)
            wait_for(lambda m=mark: agent.saw(m), 8, f"{mark!r} while {len(silent)} client(s) do not read")
        peak = relay.peak_rss_bytes()
    finally:
        agent.close()
        for s in silent:
            s.close()
        relay.stop()
    assert peak * 1.5 <= _memory_limit(), f"relay peak RSS {peak >> 20} MiB"


def test_a_client_that_never_reads_is_dropped_and_may_come_back(big_ring: Path, tmp_path: Path) -> None:
    log = tmp_path / "relay.log"
    relay = RelayProcess(big_ring, tmp_path / "kmsg.sock", "--send-timeout=0.5", log=log).start()
    agent = _Agent(relay.sock)
    try:
        for n in range(1, 3):
            s = _silent(relay.sock)
            with s:
                hangup = select.poll()
                hangup.register(s, 0)  # POLLHUP only: the relay closed its end; nothing is read
                assert hangup.poll(20_000), "the relay kept a client that took nothing"
            mark = _mark(big_ring, _BACKLOG + n)
            wait_for(lambda m=mark: agent.saw(m), 8, f"{mark!r} after client {n} was dropped")
    finally:
        agent.close()
        relay.stop()
    assert agent.lines == _BACKLOG + 2  # the agent, which read, was never dropped
    dropped = [line for line in log.read_text().splitlines() if "dropped a kernel-log reader" in line]
    assert len(dropped) == 2 and dropped[-1].endswith("(2 so far)"), dropped


def test_a_client_that_writes_at_the_relay_holds_no_reader(big_ring: Path, tmp_path: Path) -> None:
    relay = RelayProcess(big_ring, tmp_path / "kmsg.sock", _SEND_TIMEOUT).start()
    agent = _Agent(relay.sock)
    stop = threading.Event()
    ended: list[OSError] = []
    writer = _silent(relay.sock)
    writer.settimeout(0.2)

    def inject() -> None:  # forged kernel records at the relay, as fast as it takes them
        while not stop.is_set():
            try:
                writer.sendall(record(1, XID79 + " injected").encode() * 1000)
            except TimeoutError:
                continue
            except OSError as exc:
                ended.append(exc)
                return

    t = threading.Thread(target=inject, name="kmsg-injector")
    t.start()
    try:
        wait_for(lambda: agent.lines >= _BACKLOG, 20, "the agent's backlog")
        mark = _mark(big_ring, _BACKLOG + 1)
        wait_for(lambda: agent.saw(mark), 8, "a record while a client writes at the relay")
        wait_for(lambda: ended, 8, "the relay to refuse what the client writes")
    finally:
        stop.set()
        t.join(10)
        writer.close()
        agent.close()
        relay.stop()
    assert isinstance(ended[0], BrokenPipeError)
    # nothing the client wrote reached a reader
    assert [line.rsplit(b";", 1)[1] for line in agent.marks] == [mark]


@pytest.mark.parametrize(
    ("flag", "line"),
    [
        ("--max-readers=0", "--max-readers must be 1 to 64, not 0"),
        ("--max-readers=65", "--max-readers must be 1 to 64, not 65"),  # 64 x 128 KiB fit its 32 MiB
        ("--send-timeout=0", "--send-timeout must be a positive number of seconds, not 0.0"),
        ("--send-timeout=nan", "--send-timeout must be a positive number of seconds, not nan"),
    ],
)
def test_the_relay_refuses_bounds_it_cannot_keep_with_one_line(
    flag: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = tmp_path / "no-such-dir" / "kmsg.sock"  # a relay that took the flag fails, never serves
    with pytest.raises(SystemExit) as exit_:
        kmsg_relay.main(["--socket", str(sock), flag])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"gpupipe-kmsg-relay: error: {line}"
