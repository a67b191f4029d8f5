"""Read kernel-log lines from ``/dev/kmsg``, a text file (optionally followed like ``tail -f``) or stdin.

:class:`KmsgReader` is an iterator of ``str`` lines, rendered as ``dmesg`` prints them, ready for
:class:`gpupipe_producer.xid.kmsg_parse.KmsgParser`; FIFOs and the relay's unix socket are read too.
It blocks in ``poll(2)`` with the stop event's descriptor (an idle node never wakes it, ``stop()`` ends
it at once), skips records up to ``after_seq`` and reports ``last_seq`` for the cursor.
More: docs/producer.md, "The kernel-log reader".
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from gpupipe_producer.xid.kmsg_parse import split_kmsg_record, unescape_kmsg
from gpupipe_producer.xid.wake import WakeEvent

__all__ = [
    "DEFAULT_KMSG_PATH",
    "KmsgReader",
    "KmsgReaderStats",
    "KmsgRecord",
    "decode_kmsg_record",
    "iter_kmsg_records",
    "kmsg_record_lines",
    "kmsg_records_to_lines",
]

DEFAULT_KMSG_PATH = "/dev/kmsg"
#: /dev/kmsg returns EINVAL when the buffer is smaller than the record; records are < 8 KiB
#: (CONSOLE_EXT_LOG_MAX), so start there and grow on EINVAL up to _KMSG_MAX_BUF.
_KMSG_BUF = 16384
#: The kernel's own facility; devkmsg_write() gives userspace writes LOG_USER unless told another
#: non-zero facility, never this one.
KERNEL_FACILITY = 0
_KMSG_MAX_BUF = 1 << 20
_CHUNK = 65536


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One decoded ``/dev/kmsg`` record."""

    priority: int
    seq: int
    ts_usec: int
    #: ``"-"`` normal, ``"c"`` / ``"+"`` fragment hints.
    flags: str
    #: Unescaped message; may contain ``"\\n"``.
    message: str
    #: Dictionary entries (`` KEY=value`` lines), unescaped, in record order.
    fields: tuple[tuple[str, str], ...] = ()

    @property
    def facility(self) -> int:
        return self.priority >> 3

    @property
    def level(self) -> int:
        return self.priority & 7

    @property
    def time_s(self) -> float:
        return self.ts_usec / 1_000_000


@dataclass(slots=True)
class KmsgReaderStats:
    lines: int = 0
    records: int = 0
    #: ``EPIPE`` results: the ring buffer overwrote records before they were read.
    overrun: int = 0
    #: Records whose header could not be decoded (skipped).
    malformed: int = 0
    #: Lines longer than ``max_line_bytes`` (cut).
    truncated: int = 0
    #: Times a followed file was re-opened after rotation/truncation.
    reopened: int = 0
    #: Records skipped because their sequence number was at or below the cursor (``after_seq``).
    skipped: int = 0
    #: Waits for input that returned (data, an idle tick, a stop): the thread's wake-ups.
    wakeups: int = 0
    #: Records of a facility other than the kernel's, dropped: userspace may write to /dev/kmsg
    #: (root, a privileged container), but never as facility 0, so a forged Xid line is not one.
    not_kernel: int = 0


def decode_kmsg_record(data: bytes | str) -> KmsgRecord | None:
    """Decode one ``/dev/kmsg`` record (pure). ``None`` if the header is not ``pri,seq,ts,flags;``."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes | bytearray) else data
    first, _, rest = text.partition("\n")
    parts = split_kmsg_record(first)
    if parts is None:
        return None
    priority, seq, ts_usec, flag, message = parts
    fields: list[tuple[str, str]] = []
    for extra in rest.split("\n"):
        if extra.startswith(" ") and "=" in extra:
            key, _, value = extra[1:].partition("=")
            fields.append((key, unescape_kmsg(value)))
    return KmsgRecord(
        priority=priority,
        seq=seq,
        ts_usec=ts_usec,
        flags=flag,
        message=unescape_kmsg(message.rstrip("\n")),
        fields=tuple(fields),
    )


def kmsg_record_lines(record: KmsgRecord, *, continues_previous: bool = False) -> list[str]:
    """Render a record as ``dmesg`` does: ``[%5d.%06d] text``, further lines indented to match.

    With ``continues_previous`` every line is indented (a continuation of the previous record's line).
    """
    texts = record.message.split("\n")
    if continues_previous:
        return ["  " + t for t in texts if t]
    sec, usec = divmod(record.ts_usec, 1_000_000)
    prefix = f"[{sec:5d}.{usec:06d}] "
    pad = " " * len(prefix)
    out = [prefix + texts[0]]
    out.extend(pad + t for t in texts[1:] if t)
    return out


def kmsg_records_to_lines(records: Iterable[KmsgRecord | None]) -> Iterator[str]:
    """Render a record stream as lines (pure): :func:`kmsg_record_lines` per record, ``""`` for ``None``.

    A record flagged ``+``, or flagged ``c`` right after a ``c``/``+`` record, continues the previous
    record's line: the kernel's fragment hints, which Documentation/ABI/testing/dev-kmsg calls
    best-effort. Such a record is rendered indented, so :class:`~gpupipe_producer.xid.kmsg_parse.KmsgParser`
    appends it to the Xid before it.
    """
    prev_flag = "-"
    for rec in records:
        if rec is None:
            yield ""
            continue
        cont = rec.flags == "+" or (rec.flags == "c" and prev_flag in ("c", "+"))
        prev_flag = rec.flags
        yield from kmsg_record_lines(rec, continues_previous=cont)


def iter_kmsg_records(
    read: Callable[[int], bytes],
    wait: Callable[[], bool | None],
    *,
    follow: bool,
    stats: KmsgReaderStats,
    idle: bool = False,
) -> Iterator[KmsgRecord | None]:
    """The ``/dev/kmsg`` read loop, with the device calls injected (tests drive it with fakes).

    ``read(n)`` is a non-blocking ``os.read``: it returns one record, or raises ``BlockingIOError``
    (nothing new), ``BrokenPipeError`` (records were overwritten: counted in ``stats.overrun``, reading
    goes on) or ``OSError(EINVAL)`` (buffer too small: retried with a bigger one). ``wait()`` blocks
    until new data (``True``), an idle timeout (``None``) or a stop (``False``). Without ``follow``
    the loop ends at the first ``BlockingIOError``; with ``idle`` it yields ``None`` after each wait
    that ended without data (never before a record that is there: that could cut an Xid from its
    continuation lines).
    """
    size = _KMSG_BUF
    while True:
        try:
            data = read(size)
        except BlockingIOError:
            if not follow:
                return
            ready = wait()
            if ready is False:
                return
            if idle and ready is None:
                yield None
            continue
        except BrokenPipeError:
            stats.overrun += 1
            continue
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.EINVAL and size < _KMSG_MAX_BUF:
                size *= 4
                continue
            raise
        if not data:
            return
        rec = decode_kmsg_record(data)
        if rec is None:
            stats.malformed += 1
            continue
        stats.records += 1
        yield rec


class _LineSplitter:
    """Bytes in, complete lines out; over-long lines are cut at ``max_bytes``."""

    __slots__ = ("_buf", "_discard", "_max", "_stats")

    def __init__(self, max_bytes: int, stats: KmsgReaderStats) -> None:
        self._buf = bytearray()
        self._discard = False
        self._max = max_bytes
        self._stats = stats

    def feed(self, data: bytes) -> list[str]:
        out: list[str] = []
        buf = self._buf
        start = 0
        n = len(data)
        while start < n:
            nl = data.find(b"\n", start)
            end = n if nl < 0 else nl
            if self._discard:
                if nl >= 0:
                    self._discard = False
                start = end + 1
                continue
            room = self._max - len(buf)
            if end - start > room:
                buf += data[start : start + room]
                out.append(_decode_line(buf))
                buf.clear()
                self._stats.truncated += 1
                self._discard = nl < 0
                start = end + 1
                continue
            buf += data[start:end]
            if nl < 0:
                break
            out.append(_decode_line(buf))
            buf.clear()
            start = nl + 1
        return out

    def finish(self) -> list[str]:
        if self._buf and not self._discard:
            line = _decode_line(self._buf)
            self._buf.clear()
            return [line]
        self._buf.clear()
        self._discard = False
        return []


def _decode_line(buf: bytes | bytearray) -> str:
    return bytes(buf).decode("utf-8", "replace").rstrip("\r")


class KmsgReader:
    """Iterate kernel-log lines from ``path`` (``/dev/kmsg``, a text file, a FIFO, or ``"-"`` for stdin).

    ``follow``: keep waiting for new lines (``/dev/kmsg``, files); pipes always end at end of file.
    ``from_start``: read what is already there first; when false and following, start at the end.
    ``stream``: a binary stream to read instead of stdin when ``path`` is ``"-"``.
    ``stop_event``: share an existing event; :meth:`stop` sets it. Give a
    :class:`~gpupipe_producer.xid.wake.WakeEvent` (the node agent does) so that setting it from anywhere
    wakes a blocked reader; with a plain :class:`threading.Event` waits are bounded by
    ``poll_interval_s`` instead.
    ``tick_needed``: with ``idle_ticks``, idle ticks only while this returns True.
    """

    def __init__(
        self,
        path: str = DEFAULT_KMSG_PATH,
        follow: bool = True,
        from_start: bool = False,
        *,
        poll_interval_s: float = 0.1,
        idle_ticks: bool = False,
        stream: BinaryIO | None = None,
        max_line_bytes: int = 65536,
        stop_event: threading.Event | None = None,
        after_seq: int | None = None,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be >= 1")
        self.path = path
        self.follow = follow
        self.from_start = from_start
        self.poll_interval_s = poll_interval_s
        self.idle_ticks = idle_ticks
        self.max_line_bytes = max_line_bytes
        self.stats = KmsgReaderStats()
        self.after_seq = after_seq
        #: Sequence number of the newest kmsg record seen (None until one was).
        self.last_seq: int | None = None
        #: Sequence number of the record the line just yielded came from (None for plain text).
        self.line_seq: int | None = None
        self._stream = stream
        self._stop: threading.Event = stop_event if stop_event is not None else WakeEvent()
        self._wake_fd: int | None = self._stop.fileno() if isinstance(self._stop, WakeEvent) else None
        #: With ``idle_ticks``: idle ticks only while this returns True (None: always).
        self.tick_needed: Callable[[], bool] | None = None
        #: True while the reader is blocked waiting for input (an idle reader is not a stuck one).
        self.waiting = False
        #: Called each time the reader is about to wait for input: it has read all there was (the
        #: backlog at start), so the consumer may say it is positioned without a line coming.
        self.on_wait: Callable[[], None] | None = None

    # ---------------------------------------------------------------- control
    def stop(self) -> None:
        """Ask the iteration to end: at once with a WakeEvent, else within ``poll_interval_s``."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def mode(self) -> str:
        """``"kmsg"``, ``"file"``, ``"socket"`` or ``"stream"``: how ``path`` will be read."""
        if self._stream is not None or self.path == "-":
            return "stream"
        st = os.stat(self.path)
        if stat.S_ISCHR(st.st_mode):
            if os.path.basename(self.path) == "kmsg" or st.st_rdev == os.makedev(1, 11):
                return "kmsg"
            return "stream"
        if stat.S_ISREG(st.st_mode):
            return "file"
        if stat.S_ISSOCK(st.st_mode):
            return "socket"
        return "stream"

    def __iter__(self) -> Iterator[str]:
        mode = self.mode()
        if mode == "kmsg":
            gen = self._iter_kmsg()
        elif mode == "file":
            gen = self._relayed(self._iter_file())
        elif mode == "socket":
            gen = self._relayed(self._iter_socket())
        else:
            gen = self._relayed(self._iter_stream())
        for line in gen:
            if line:
                self.stats.lines += 1
            yield line

    # ---------------------------------------------------------------- helpers
    def _timeout(self) -> float | None:
        """How long one wait may block: for ever unless an idle tick is due or stop has no fd."""
        if self.idle_ticks and (self.tick_needed is None or self.tick_needed()):
            return self.poll_interval_s
        return None if self._wake_fd is not None else self.poll_interval_s

    def _wait_fd(self, fd: int) -> bool | None:
        """Wait for ``fd`` (see :meth:`_timeout`): True readable, None timeout, False stopped."""
        if self._stop.is_set():
            return False
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        if self._wake_fd is not None:
            poller.register(self._wake_fd, select.POLLIN)
        timeout = self._timeout()
        if self.on_wait is not None:
            self.on_wait()
        self.waiting = True
        try:
            events = poller.poll(None if timeout is None else max(1, round(timeout * 1000)))
        except InterruptedError:
            events = []
        finally:
            self.waiting = False
            self.stats.wakeups += 1
        if self._stop.is_set():
            return False
        return True if any(f == fd for f, _ in events) else None

    def _sleep(self) -> bool:
        """Sleep one poll interval (a followed regular file); False when stopped."""
        if self.on_wait is not None:
            self.on_wait()
        self.waiting = True
        try:
            stopped = self._stop.wait(self.poll_interval_s)
        finally:
            self.waiting = False
            self.stats.wakeups += 1
        return not stopped

    # ---------------------------------------------------------------- /dev/kmsg
    def _iter_kmsg(self) -> Iterator[str]:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if self.follow and not self.from_start:
                os.lseek(fd, 0, os.SEEK_END)

            def wait() -> bool | None:
                return self._wait_fd(fd)

            records = iter_kmsg_records(
                lambda n: os.read(fd, n), wait, follow=self.follow, stats=self.stats, idle=self.idle_ticks
            )
            for line in self._render(self._after_cursor(records)):
                yield line
                if self._stop.is_set():
                    return
        finally:
            os.close(fd)

    def _seen(self, seq: int) -> bool:
        """True when record ``seq`` was handled already: at or below the cursor, or at or below the
        newest record this reader yielded (a relay that restarts re-sends the kernel's backlog)."""
        floor = self.after_seq
        if self.last_seq is not None and (floor is None or self.last_seq > floor):
            floor = self.last_seq
        if floor is not None and seq <= floor:
            self.stats.skipped += 1
            return True
        self.last_seq = seq
        return False

    def _after_cursor(self, records: Iterable[KmsgRecord | None]) -> Iterator[KmsgRecord | None]:
        for rec in records:
            if rec is not None and self._seen(rec.seq):
                continue
            yield rec

    def _render(self, records: Iterable[KmsgRecord | None]) -> Iterator[str]:
        """kmsg_records_to_lines, noting which record each line came from in ``line_seq``."""
        prev_flag = "-"
        for rec in records:
            if rec is None:
                yield ""
                continue
            if rec.facility != KERNEL_FACILITY:
                self.stats.not_kernel += 1
                continue
            cont = rec.flags == "+" or (rec.flags == "c" and prev_flag in ("c", "+"))
            prev_flag = rec.flags
            self.line_seq = rec.seq
            yield from kmsg_record_lines(rec, continues_previous=cont)

    def _relayed(self, lines: Iterable[str]) -> Iterator[str]:
        """Text lines as they are; raw kmsg records (a relay) decoded and rendered, with the cursor."""
        in_record = False
        prev_flag = "-"
        for line in lines:
            if in_record and line.startswith(" ") and "=" in line:
                continue  # a kmsg dictionary line (`` SUBSYSTEM=pci``)
            rec = decode_kmsg_record(line) if line[:1].isdigit() else None
            if rec is None:
                in_record = False
                self.line_seq = None
                yield line
                continue
            in_record = True
            self.stats.records += 1
            if self._seen(rec.seq):
                continue
            if rec.facility != KERNEL_FACILITY:
                self.stats.not_kernel += 1
                continue
            cont = rec.flags == "+" or (rec.flags == "c" and prev_flag in ("c", "+"))
            prev_flag = rec.flags
            self.line_seq = rec.seq
            yield from kmsg_record_lines(rec, continues_previous=cont)

    # ---------------------------------------------------------------- regular files
    def _iter_file(self) -> Iterator[str]:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if self.follow and not self.from_start:
                os.lseek(fd, 0, os.SEEK_END)
            splitter = _LineSplitter(self.max_line_bytes, self.stats)
            while not self._stop.is_set():
                data = os.read(fd, _CHUNK)
                if data:
                    yield from splitter.feed(data)
                    continue
                if not self.follow:
                    yield from splitter.finish()
                    return
                if self.idle_ticks and (self.tick_needed is None or self.tick_needed()):
                    yield ""
                if not self._sleep():
                    return
                new_fd = self._reopen_if_rotated(fd)
                if new_fd is not None:
                    yield from splitter.finish()
                    os.close(fd)
                    fd = new_fd
        finally:
            os.close(fd)

    def _reopen_if_rotated(self, fd: int) -> int | None:
        try:
            st_path = os.stat(self.path)
        except FileNotFoundError:
            return None  # being rotated; try again next time
        st_fd = os.fstat(fd)
        pos = os.lseek(fd, 0, os.SEEK_CUR)
        if (st_path.st_ino, st_path.st_dev) != (st_fd.st_ino, st_fd.st_dev) or st_path.st_size < pos:
            try:
                new_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            self.stats.reopened += 1
            return new_fd
        return None

    # ---------------------------------------------------------------- stdin / pipes / FIFOs
    def _iter_stream(self) -> Iterator[str]:
        opened_fd: int | None = None
        stream = self._stream
        if stream is None and self.path == "-":
            stream = sys.stdin.buffer
        fd: int | None
        if stream is not None:
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):
                fd = None
            if fd is None:
                yield from self._iter_unselectable(stream)
                return
        else:
            # A followed FIFO is opened read-write: holding a writer end ourselves, it never reads as
            # end of file (nor polls readable) while the relay that feeds it is (re)starting, so the
            # reader blocks until the next writer writes instead of polling for it.
            is_fifo = stat.S_ISFIFO(os.stat(self.path).st_mode)
            mode = os.O_RDWR if self.follow and is_fifo else os.O_RDONLY
            opened_fd = os.open(self.path, mode | os.O_NONBLOCK | os.O_CLOEXEC)
            fd = opened_fd
        # A FIFO opened read-only without a writer reads as end of file (and polls readable):
        # wait for the writer instead of ending (a FIFO given as a stream, e.g. stdin).
        fifo = opened_fd is not None and self.follow and stat.S_ISFIFO(os.fstat(fd).st_mode)
        splitter = _LineSplitter(self.max_line_bytes, self.stats)
        try:
            while True:
                ready = self._wait_fd(fd)
                if ready is False:
                    return
                if ready is None:
                    if self.idle_ticks:
                        yield ""
                    continue
                try:
                    data = os.read(fd, _CHUNK)
                except (BlockingIOError, InterruptedError):
                    continue
                if not data:
                    yield from splitter.finish()
                    if fifo:
                        if self.idle_ticks:
                            yield ""
                        if not self._sleep():
                            return
                        continue
                    return
                yield from splitter.feed(data)
        finally:
            if opened_fd is not None:
                os.close(opened_fd)

    def _iter_socket(self) -> Iterator[str]:
        """A relay's unix socket (:mod:`gpupipe_producer.xid.kmsg_relay`): every connection starts with the
        kernel's backlog, and what this reader or its cursor already had is skipped (``_seen``).

        When the relay closes a connection that brought data (it restarts), the reader connects again
        at once; a failed connect, or a connection closed before any data (a relay that cannot open
        the device, or has enough readers), raises for the caller to retry later. A record cut by
        the closing is dropped, not yielded: the next connection sends it whole.
        """
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            got = False
            try:
                sock.connect(self.path)
                sock.setblocking(False)
                fd = sock.fileno()
                splitter = _LineSplitter(self.max_line_bytes, self.stats)
                while True:
                    ready = self._wait_fd(fd)
                    if ready is False:
                        return
                    if ready is None:
                        if self.idle_ticks:
                            yield ""
                        continue
                    try:
                        data = sock.recv(_CHUNK)
                    except (BlockingIOError, InterruptedError):
                        continue
                    if not data:
                        break
                    got = True
                    yield from splitter.feed(data)
            finally:
                sock.close()
            if not self.follow:
                return
            if not got:
                raise ConnectionResetError(errno.ECONNRESET, "closed by the relay before any data", self.path)
            self.stats.reopened += 1

    def _iter_unselectable(self, stream: BinaryIO) -> Iterator[str]:
        """Streams without a file descriptor (``io.BytesIO``): plain blocking ``readline``."""
        limit = self.max_line_bytes
        discarding = False
        while not self._stop.is_set():
            chunk = stream.readline(limit + 1)
            if not chunk:
                return
            if isinstance(chunk, str):  # a text stream slipped in: accept it
                chunk = chunk.encode("utf-8", "surrogateescape")
            complete = chunk.endswith(b"\n")
            if discarding:
                discarding = not complete
                continue
            body = chunk[:-1] if complete else chunk
            if len(body) > limit:
                body = body[:limit]
                self.stats.truncated += 1
                discarding = True
            yield _decode_line(body)
