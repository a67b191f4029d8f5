"""``gpupipe xid parse``: kernel-log lines on stdin, one JSON object per Xid/SXid line on stdout.

Each output line is ``json.dumps(to_json_dict(event))``: the keys ``kind``, ``xid``, ``pci_bus_id``,
``pid``, ``process_name``, ``message``, ``gpu_instance_id``, ``compute_instance_id``, in that order.
Continuation lines (indented, as ``dmesg``/``journalctl`` print multi-line records) are joined onto
the Xid they follow. ``GPU has fallen off the bus`` reports without an Xid are not Xids and are not
printed; a note goes to stderr instead.

Input may be anything ``dmesg``, ``dmesg -T``, ``journalctl -k`` (any ``-o short*``), syslog files or
``cat /dev/kmsg`` produce. Undecodable bytes become U+FFFD, lines longer than 64 KiB are cut, binary
garbage yields nothing; the command never fails on its input. When stdin is a pipe that goes quiet
(``dmesg -w | gpupipe xid parse``) a held-back Xid is printed after 0.2 s instead of waiting for the next
kernel line.

Exit status: 0, or 1 when stdout is closed early (e.g. ``| head``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TextIO

from gpupipe_producer.xid.kmsg_parse import Event, FallenOffBus, KmsgParser, to_json_dict
from gpupipe_producer.xid.kmsg_reader import KmsgReader

__all__ = ["MAX_INPUT_LINE", "run_xid_parse"]

#: Longest input line looked at (bytes for byte streams, characters for text streams).
MAX_INPUT_LINE = 65536
_IDLE_FLUSH_S = 0.2


def run_xid_parse(stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Read kernel-log lines from ``stdin`` until end of file; write Xid JSON lines to ``stdout``."""
    parser = KmsgParser()
    try:
        for line in _input_lines(stdin):
            for ev in parser.feed(line):
                _emit(ev, stdout, stderr)
        for ev in parser.flush():
            _emit(ev, stdout, stderr)
        stdout.flush()
    except BrokenPipeError:
        return 1
    return 0


def _emit(ev: Event, stdout: TextIO, stderr: TextIO) -> None:
    if isinstance(ev, FallenOffBus):
        stderr.write(f"note: GPU {ev.pci_bus_id} has fallen off the bus (no Xid on that line; not printed)\n")
        return
    stdout.write(json.dumps(to_json_dict(ev)) + "\n")
    stdout.flush()


def _input_lines(stdin: TextIO) -> Iterator[str]:
    buffer = getattr(stdin, "buffer", None)
    if buffer is not None:
        try:
            buffer.fileno()
        except (AttributeError, OSError, ValueError):
            pass
        else:
            yield from KmsgReader(
                "-",
                follow=False,
                stream=buffer,
                idle_ticks=True,
                poll_interval_s=_IDLE_FLUSH_S,
                max_line_bytes=MAX_INPUT_LINE,
            )
            return
    yield from _text_lines(stdin)


def _text_lines(stdin: TextIO) -> Iterator[str]:
    """Lines of a text stream without a usable file descriptor, cut at ``MAX_INPUT_LINE`` characters."""
    discarding = False
    while True:
        chunk = stdin.readline(MAX_INPUT_LINE + 1)
        if not chunk:
            return
        if isinstance(chunk, bytes):
            chunk = chunk.decode("utf-8", "replace")
        complete = chunk.endswith("\n")
        if discarding:
            discarding = not complete
            continue
        body = chunk[:-1] if complete else chunk
        if len(body) > MAX_INPUT_LINE:
            body = body[:MAX_INPUT_LINE]
            discarding = True
        yield _sanitize(body.rstrip("\r"))


def _sanitize(line: str) -> str:
    """Replace lone surrogates (from ``surrogateescape``-decoded input) so the JSON is valid UTF-8."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:
            return line.encode("utf-8", "replace").decode("utf-8")
    return line
