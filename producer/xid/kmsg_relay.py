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
library only, one thread and ``poll(2)``, because the sidecar's memory limit is small. A reader that
does not take its data within ``--send-timeout`` is disconnected (it reconnects and gets the backlog
again); more than ``--max-readers`` at once are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
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
#: Bytes gathered before one send (the backlog of a fresh connection is sent in chunks of this).
_CHUNK = 65536


class _Reader:
    """One connection and its own open description of the device."""

    def __init__(self, conn: socket.socket, device: str, send_timeout_s: float) -> None:
        self.conn = conn
        self.fd = os.open(device, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)
        self.size = _RECORD_BUF
        self.send_timeout_s = send_timeout_s
        conn.setblocking(False)

    def close(self) -> None:
        os.close(self.fd)
        self.conn.close()

    def pump(self) -> bool:
        """Send what the device has now; False when the connection is to be closed."""
        out = bytearray()
        while True:
            try:
                data = os.read(self.fd, _CHUNK if self.regular else self.size)
            except BlockingIOError:
                break
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
                break  # end of a regular file: followed, looked at again after the poll interval
            out += data
            if len(out) >= _CHUNK and not self._send(out):
                return False
        return self._send(out)

    def _send(self, out: bytearray) -> bool:
        """Send ``out`` whole; False when the reader went away or took nothing within the timeout."""
        view = memoryview(out)
        deadline = time.monotonic() + self.send_timeout_s
        poller = select.poll()
        poller.register(self.conn, select.POLLOUT)
        try:
            while view:
                try:
                    view = view[self.conn.send(view) :]
                except (BlockingIOError, InterruptedError):
                    left = deadline - time.monotonic()
                    if left <= 0 or not poller.poll(max(1, round(left * 1000))):
                        return False
                except OSError:
                    return False
        finally:
            view.release()
        out.clear()
        return True


class Relay:
    """Serve ``device`` on the unix socket ``path`` until the process is stopped (see module doc)."""

    def __init__(
        self,
        device: str,
        path: str,
        *,
        max_readers: int = 4,
        send_timeout_s: float = 30.0,
        file_poll_s: float = 0.1,
    ) -> None:
        self.device = device
        self.path = path
        self.max_readers = max_readers
        self.send_timeout_s = send_timeout_s
        self.file_poll_s = file_poll_s
        self.readers: dict[int, _Reader] = {}  # by the connection's descriptor

    def listen(self) -> socket.socket:
        """Bind the socket, owner-only from its creation; a stale socket of an earlier run is replaced."""
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise FileExistsError(errno.EEXIST, "exists and is not a socket", self.path)
            os.unlink(self.path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            srv.bind(self.path)
        finally:
            os.umask(old)
        srv.listen(8)
        return srv

    def serve(self, srv: socket.socket) -> None:
        poller = select.poll()
        poller.register(srv, select.POLLIN)
        while True:
            files = [r for r in self.readers.values() if r.regular]
            events = poller.poll(round(self.file_poll_s * 1000) if files else None)
            due: set[int] = {r.conn.fileno() for r in files}
            for fd, _ in events:
                if fd == srv.fileno():
                    self._accept(srv, poller)
                elif fd in self.readers:
                    due.add(fd)  # the reader hung up or sent something: looked at below
                else:
                    due.update(c for c, r in self.readers.items() if r.fd == fd)
            for cfd in due:
                r = self.readers.get(cfd)
                if r is not None and not (self._alive(r) and r.pump()):
                    self._drop(cfd, poller)

    def _accept(self, srv: socket.socket, poller: select.poll) -> None:
        conn, _ = srv.accept()
        if len(self.readers) >= self.max_readers:
            log.warning("refused a kernel-log reader: %d already connected", len(self.readers))
            conn.close()
            return
        try:
            r = _Reader(conn, self.device, self.send_timeout_s)
        except OSError as exc:
            log.error("cannot open %s for a reader: %s", self.device, exc)
            conn.close()
            return
        self.readers[conn.fileno()] = r
        poller.register(conn, select.POLLIN)
        if not r.regular:
            poller.register(r.fd, select.POLLIN | select.POLLPRI)
        if not r.pump():  # the backlog, at once
            self._drop(conn.fileno(), poller)

    def _alive(self, r: _Reader) -> bool:
        """False once the reader closed its end (readers send nothing; what they send is dropped)."""
        try:
            return r.conn.recv(4096, socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _drop(self, cfd: int, poller: select.poll) -> None:
        r = self.readers.pop(cfd)
        poller.unregister(cfd)
        if not r.regular:
            poller.unregister(r.fd)
        r.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpupipe-kmsg-relay",
        description="Serve the kernel log on a unix socket; every reader gets it from its oldest record.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="/dev/kmsg", help="the kernel log device (or a regular file) to serve")
    p.add_argument("--socket", required=True, help="path of the unix socket to create (mode 0600)")
    p.add_argument("--max-readers", type=int, default=4, help="connections served at once")
    p.add_argument("--send-timeout", type=float, default=30.0, help="seconds a reader may leave data untaken")
    args = p.parse_args(argv)
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
