"""The node agent's kernel-log relay: ``/dev/kmsg`` on a unix socket, from its oldest record for every reader.

Why: an unprivileged container cannot open ``/dev/kmsg``, so the DaemonSet runs this relay in a
privileged sidecar and the agent reads its socket (``--kmsg-path``). Every connection opens the
device anew and so starts with the oldest record the kernel still holds, as any new reader of
``/dev/kmsg`` does; the agent's cursor (boot id + seq) skips what it has handled. A restarted agent
therefore gets again an XID it had read but not yet spooled. A FIFO fed by ``cat /dev/kmsg`` cannot
do that: ``cat`` re-sends the backlog only once it dies of EPIPE, which takes a kernel line while
no agent holds the FIFO, so the record the dead agent had read was gone.

The bytes sent are the device's records as they come (what ``cat /dev/kmsg`` writes). A regular
file given as the device (a saved kernel log, tests) is read from its start and followed. Standard
library only, one thread and ``poll(2)``, because the sidecar's memory limit is small.

Each reader is served on its own, so that no client can delay another's records: its socket is
non-blocking and the loop only sends what the socket takes now. The device is read for a reader only
while less than ``_HIGH_WATER`` (64 KiB) of its data waits to be sent, so a reader that does not
read costs at most that plus one read (64 KiB, or one record) and leaves the rest in the kernel's
ring, as any slow reader of ``/dev/kmsg`` does: at most 128 KiB a reader, 512 KiB for the default
``--max-readers`` (4) and 8 MiB for its largest value (64), within the sidecar's 32 MiB with the
interpreter's 15 MiB. A reader that takes no byte for ``--send-timeout`` while data waits for it is
disconnected (one line, with the count so far; it may reconnect and gets the backlog again); more
than ``--max-readers`` at once are refused. Readers send nothing: the relay shuts its end of each
connection for reading, so what a client writes fails there (EPIPE) and costs the relay nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Sequence

log = logging.getLogger("gpupipe.kmsg_relay")

#: /dev/kmsg fails a read into a buffer smaller than the record (EINVAL); records are < 8 KiB.
_RECORD_BUF = 16384
_MAX_RECORD_BUF = 1 << 20
#: What one read of a regular file takes.
_CHUNK = 65536
#: A reader's untaken bytes below which the device is read for it (the bound of its buffer, less one read).
_HIGH_WATER = 65536
MAX_READERS = 4
#: The most ``--max-readers`` may be: times 128 KiB, what the sidecar's memory limit has room for.
MAX_READERS_CAP = 64
SEND_TIMEOUT_S = 30.0


class _Reader:
    """One connection, its own open description of the device, and the bytes read but not yet sent."""

    def __init__(self, conn: socket.socket, device: str) -> None:
        self.conn = conn
        self.fd = os.open(device, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)
        self.size = _RECORD_BUF
        self.out = bytearray()
        #: False when the last fill stopped for want of room, not for want of data
        self.at_end = False
        #: since when bytes wait that the socket does not take (the send timeout counts from it)
        self.stalled_since: float | None = None
        conn.setblocking(False)
        with contextlib.suppress(OSError):  # a client already gone: its hangup drops it
            conn.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        os.close(self.fd)
        self.conn.close()

    def room(self) -> bool:
        return len(self.out) < _HIGH_WATER

    def fill(self) -> None:
        """Read what the device has now, while the reader's buffer has room."""
        self.at_end = False
        while self.room():
            try:
                data = os.read(self.fd, _CHUNK if self.regular else self.size)
            except BlockingIOError:
                self.at_end = True
                return
            except BrokenPipeError:
                continue  # the ring overwrote records before they were read: go on with the oldest left
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.size < _MAX_RECORD_BUF:
                    self.size *= 4
                    continue
                raise
            if not data:
                self.at_end = True
                return  # end of a regular file: followed, looked at again after the poll interval
            self.out += data

    def flush(self, now: float) -> bool:
        """Send what the socket takes now; False when the reader went away."""
        took = False
        while self.out:
            try:
                sent = self.conn.send(self.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return False
            del self.out[:sent]
            took = True
        if not self.out:
            self.stalled_since = None
        elif took or self.stalled_since is None:
            self.stalled_since = now
        return True


class Relay:
    """Serve ``device`` on the unix socket ``path`` until the process is stopped (see module doc)."""

    def __init__(
        self,
        device: str,
        path: str,
        *,
        max_readers: int = MAX_READERS,
        send_timeout_s: float = SEND_TIMEOUT_S,
        file_poll_s: float = 0.1,
    ) -> None:
        self.device = device
        self.path = path
        self.max_readers = max_readers
        self.send_timeout_s = send_timeout_s
        self.file_poll_s = file_poll_s
        self.readers: dict[int, _Reader] = {}  # by the connection's descriptor
        self.dropped = 0  # readers disconnected for taking nothing within the send timeout

    def listen(self) -> socket.socket:
        """Bind the socket, owner-only from its creation; a stale socket of an earlier run is replaced.

        The path appears only once the socket listens (bound under a temporary name, then renamed),
        so a reader, or the startup probe's ``test -S``, never finds a socket that refuses it."""
        tmp = self.path + ".new"
        for name in (self.path, tmp):
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISSOCK(os.lstat(name).st_mode):
                    raise FileExistsError(errno.EEXIST, "exists and is not a socket", name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            srv.bind(tmp)
        finally:
            os.umask(old)
        srv.listen(8)
        srv.setblocking(False)
        os.rename(tmp, self.path)
        return srv

    def serve(self, srv: socket.socket) -> None:
        while True:
            self.step(srv)

    def step(self, srv: socket.socket) -> None:
        """Wait for what can be done without blocking (a connection, a record, room in a reader's
        socket, a hangup, a deadline), then do it for every reader."""
        poller = select.poll()
        poller.register(srv, select.POLLIN)
        for cfd, r in self.readers.items():
            # POLLHUP and POLLERR come unasked: a reader that went away is always seen
            poller.register(cfd, select.POLLOUT if r.out else 0)
            if not r.regular and r.room():
                poller.register(r.fd, select.POLLIN | select.POLLPRI)
        events = dict(poller.poll(self._wait_ms()))
        now = time.monotonic()
        for cfd, r in list(self.readers.items()):
            if events.get(cfd, 0) & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                self._drop(cfd)
                continue
            r.fill()
            if not r.flush(now):
                self._drop(cfd)
            elif r.stalled_since is not None and now - r.stalled_since >= self.send_timeout_s:
                self.dropped += 1
                log.warning(
                    "dropped a kernel-log reader that took nothing for %gs (%d so far)",
                    self.send_timeout_s,
                    self.dropped,
                )
                self._drop(cfd)
        if srv.fileno() in events:  # after the hangups: a reader that reconnects finds its place free
            self._accept(srv)

    def _wait_ms(self) -> int | None:
        """Until the next deadline: a followed file's next look, a stalled reader's send timeout."""
        if any(r.room() and not r.at_end for r in self.readers.values()):
            return 0  # the device has more for a reader whose socket took what it had
        waits = [self.file_poll_s for r in self.readers.values() if r.regular and r.room()]
        now = time.monotonic()
        waits += [
            r.stalled_since + self.send_timeout_s - now
            for r in self.readers.values()
            if r.stalled_since is not None
        ]
        return max(0, math.ceil(min(waits) * 1000)) if waits else None

    def _accept(self, srv: socket.socket) -> None:
        try:
            conn, _ = srv.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        if len(self.readers) >= self.max_readers:
            log.warning("refused a kernel-log reader: %d already connected", len(self.readers))
            conn.close()
            return
        try:
            r = _Reader(conn, self.device)
        except OSError as exc:
            log.error("cannot open %s for a reader: %s", self.device, exc)
            conn.close()
            return
        self.readers[conn.fileno()] = r  # its backlog is read and sent by the loop, like any record

    def _drop(self, cfd: int) -> None:
        self.readers.pop(cfd).close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpupipe-kmsg-relay",
        description="Serve the kernel log on a unix socket; every reader gets it from its oldest record.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="/dev/kmsg", help="the kernel log device (or a regular file) to serve")
    p.add_argument("--socket", required=True, help="path of the unix socket to create (mode 0600)")
    p.add_argument(
        "--max-readers",
        type=int,
        default=MAX_READERS,
        help=f"connections served at once (1 to {MAX_READERS_CAP})",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=SEND_TIMEOUT_S,
        help="seconds a reader may take nothing while data waits for it; then it is disconnected",
    )
    args = p.parse_args(argv)
    if not 1 <= args.max_readers <= MAX_READERS_CAP:
        p.error(f"--max-readers must be 1 to {MAX_READERS_CAP}, not {args.max_readers}")
    if not 0 < args.send_timeout < math.inf:
        p.error(f"--send-timeout must be a positive number of seconds, not {args.send_timeout}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    relay = Relay(args.device, args.socket, max_readers=args.max_readers, send_timeout_s=args.send_timeout)
    try:
        srv = relay.listen()
    except OSError as exc:
        log.error("cannot listen on %s: %s", args.socket, exc)
        return 1
    log.info("serving %s on %s", args.device, args.socket)
    try:
        relay.serve(srv)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
