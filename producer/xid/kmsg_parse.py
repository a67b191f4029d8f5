"""Parse NVIDIA ``Xid`` / ``SXid`` kernel-log lines into events (pure: no I/O).

``parse_line`` handles one line, whatever its prefix (``/dev/kmsg``, ``dmesg``, syslog, journalctl);
:class:`KmsgParser` is the streaming form that also joins continuation lines onto the previous Xid,
reports "fallen off the bus" and, with ``driver_loads=True``, the driver's load line
(:class:`DriverLoaded`). A line with no Xid, NVRM or "fallen off" costs three substring tests.
More: docs/producer.md, "Parsing kernel-log lines".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "MAX_LINE_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_RAW_CHARS",
    "DriverLoaded",
    "Event",
    "FallenOffBus",
    "KernelXid",
    "KmsgParser",
    "containment_flags",
    "parse_driver_load",
    "parse_line",
    "split_kmsg_record",
    "to_json_dict",
    "unescape_kmsg",
]

XidKind = Literal["xid", "sxid"]

#: Longest line looked at; anything after is dropped (the driver's lines are < 1 KiB).
MAX_LINE_CHARS = 16384
#: Longest ``message`` kept, continuations included.
MAX_MESSAGE_CHARS = 4096
#: Longest ``raw`` kept when continuation or coalesced lines are joined.
MAX_RAW_CHARS = 65536
#: A ``KernelXid`` takes at most this many continuation lines (guards against runaway indented output).
MAX_CONTINUATION_LINES = 16


@dataclass(frozen=True, slots=True)
class KernelXid:
    """One ``Xid``/``SXid`` report from the kernel log."""

    kind: XidKind
    xid: int
    #: As printed: ``"0000:3b:00"`` for GPUs, ``"0000:05:00.0"`` for NVSwitches.
    pci_bus_id: str
    pid: int | None
    process_name: str | None
    #: The text after ``pid=``/``name=`` (or after the code when those are absent), stripped.
    message: str
    gpu_instance_id: int | None
    compute_instance_id: int | None
    #: Seconds since boot, from a ``dmesg`` ``[123.456789]`` stamp or a ``/dev/kmsg`` record header.
    kernel_time_s: float | None
    #: The wall-clock stamp text of a syslog/journal/``dmesg -T`` prefix, verbatim.
    wall_time: str | None
    #: The line(s) this event was parsed from (continuations joined with ``"\\n"``).
    raw: str


@dataclass(frozen=True, slots=True)
class FallenOffBus:
    """``GPU has fallen off the bus`` reported *without* an Xid on the same line."""

    pci_bus_id: str
    kernel_time_s: float | None
    raw: str


@dataclass(frozen=True, slots=True)
class DriverLoaded:
    """The NVIDIA kernel module was loaded (``NVRM: loading NVIDIA UNIX ... Kernel Module <version>``):
    every GPU of the node was (re-)initialised. Node-wide: the line names no GPU."""

    driver_version: str
    #: The driver's text from ``NVRM: loading`` on (the time prefix stripped).
    text: str
    kernel_time_s: float | None
    wall_time: str | None
    raw: str


Event = KernelXid | FallenOffBus | DriverLoaded

_JSON_KEYS = (
    "kind",
    "xid",
    "pci_bus_id",
    "pid",
    "process_name",
    "message",
    "gpu_instance_id",
    "compute_instance_id",
)


def to_json_dict(ev: KernelXid) -> dict[str, object]:
    """The CLI/wire form of an Xid: exactly the keys in ``_JSON_KEYS``, in that order."""
    return {
        "kind": ev.kind,
        "xid": ev.xid,
        "pci_bus_id": ev.pci_bus_id,
        "pid": ev.pid,
        "process_name": ev.process_name,
        "message": ev.message,
        "gpu_instance_id": ev.gpu_instance_id,
        "compute_instance_id": ev.compute_instance_id,
    }


# --------------------------------------------------------------------------------------------------
# regular expressions (used only after the cheap substring pre-checks)

_PCI = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"

# Applied with .match() at the position of "Xid (" / "SXid (".
_BODY_RE = re.compile(
    r"S?Xid \((?:PCI:)?(" + _PCI + r")([^)]*)\):[ \t]*(\d{1,6})(?:(?:,[ \t]*|[ \t]+)(.*))?$",
    re.DOTALL,
)
_GI_RE = re.compile(r"GPU-I:[ \t]*(\d+)")
_CI_RE = re.compile(r"GPU-CI:[ \t]*(\d+)")

_KMSG_HDR_RE = re.compile(r"(\d{1,4}),(\d{1,20}),(\d{1,20}),([^;]*);")
_MONO_RE = re.compile(r"\[[ \t]*(\d{1,12}\.\d{1,9})\]")
_CTIME_RE = re.compile(
    r"\[((?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) "
    r"[ \d]\d \d\d:\d\d:\d\d \d{4})\]"
)
_ISO_RE = re.compile(
    r"(?<!\d)(\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d(?::?\d\d)?)?)(?![\d:])"
)
_BSD_RE = re.compile(r"[ \t]*([A-Za-z]{3} [ \d]\d \d\d:\d\d:\d\d(?:\.\d{1,9})?)(?![\d:])")

_ANY_PCI_RE = re.compile(r"(?<![0-9A-Fa-f])(" + _PCI + r")(?![0-9A-Fa-f])")
_THE_GPU_RE = re.compile(r"The NVIDIA GPU (" + _PCI + r")")
_KMSG_DICT_RE = re.compile(r"[A-Z][A-Z0-9_]*=")
# An indented line that starts like this is a new record (e.g. a whole log pasted with indentation),
# not a continuation: a dmesg/kmsg stamp, a syslog/journal/ISO stamp.
_NEW_RECORD_RE = re.compile(
    r"\[[ \t]*\d+\.\d+\]|\[[A-Z][a-z]{2} [A-Z][a-z]{2} |\d{1,4},\d+,\d+,[^;]*;"
    r"|[A-Za-z]{3} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\d[T ]\d\d:"
)
_KMSG_ESC_RE = re.compile(r"\\x([0-9A-Fa-f]{2})")
# "NVIDIA UNIX x86_64 Kernel Module  <v>" (proprietary) / "NVIDIA UNIX Open Kernel Module for <arch>  <v>"
_DRIVER_LOAD_RE = re.compile(
    r"NVRM: loading NVIDIA UNIX (?:Open Kernel Module for \S+|\S+ Kernel Module)[ \t]+(\d[\w.-]*)"
)
_CONTAINMENT_RE = re.compile(r"\bRST: (Yes|No), D-RST: (Yes|No)")

_WS = (" ", "\t")
_UNKNOWN = ("<unknown>", "'<unknown>'", "")


def unescape_kmsg(text: str) -> str:
    r"""Undo ``/dev/kmsg`` escaping: the kernel prints control bytes, bytes >= 0x7f and ``\`` as ``\xNN``.

    Escaped bytes are reassembled and decoded as UTF-8 (invalid sequences become U+FFFD).
    """
    if "\\x" not in text:
        return text
    raw = _KMSG_ESC_RE.sub(lambda m: chr(int(m.group(1), 16)), text)
    try:
        return raw.encode("latin-1").decode("utf-8", "replace")
    except UnicodeEncodeError:  # text already held non-Latin-1 characters: keep the substitution as is
        return raw


def split_kmsg_record(text: str) -> tuple[int, int, int, str, str] | None:
    """Split a ``/dev/kmsg`` record ``pri,seq,ts_usec,flags[,...];message`` (first line only).

    Returns ``(priority, seq, ts_usec, flag, message)`` with ``flag`` one character (``"-"`` if empty),
    ``message`` still escaped; ``None`` when ``text`` does not start with such a header.
    """
    m = _KMSG_HDR_RE.match(text)
    if m is None:
        return None
    flags = m.group(4)
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), (flags[:1] or "-"), text[m.end() :]


def containment_flags(message: str) -> tuple[bool, bool] | None:
    """``(RST, D-RST)`` from an Xid 94/95 message (``... RST: No, D-RST: No``), else ``None``.

    ``RST: Yes`` means a GPU reset is required, ``D-RST: Yes`` a drain-and-reset.
    """
    m = _CONTAINMENT_RE.search(message)
    if m is None:
        return None
    return m.group(1) == "Yes", m.group(2) == "Yes"


def _prefix_times(prefix: str) -> tuple[float | None, str | None]:
    """(kernel_time_s, wall_time) found in the text before the Xid token."""
    kernel_time_s: float | None = None
    wall_time: str | None = None
    if not prefix:
        return None, None
    hdr = _KMSG_HDR_RE.match(prefix)
    if hdr is not None:
        kernel_time_s = int(hdr.group(3)) / 1_000_000
        prefix = prefix[hdr.end() :]
    m = _BSD_RE.match(prefix)
    if m is not None:
        wall_time = m.group(1)
    else:
        m = _ISO_RE.search(prefix)
        if m is not None:
            wall_time = m.group(1)
        else:
            m = _CTIME_RE.search(prefix)
            if m is not None:
                wall_time = m.group(1)
    if kernel_time_s is None:
        m = _MONO_RE.search(prefix)
        if m is not None:
            kernel_time_s = float(m.group(1))
    return kernel_time_s, wall_time


def _split_pid_name(rest: str) -> tuple[int | None, str | None, str]:
    """``pid=..., name=..., message`` -> (pid, name, message); either field may be absent."""
    if not rest.startswith("pid="):
        return None, None, rest.strip()
    comma = rest.find(",", 4)
    if comma < 0:
        tok, rest = rest[4:], ""
    else:
        tok, rest = rest[4:comma], rest[comma + 1 :].lstrip()
    tok = tok.strip()
    pid = int(tok) if tok.isdigit() else None
    name: str | None = None
    if rest.startswith("name="):
        sep = rest.find(", ", 5)
        if sep < 0:
            tok, rest = rest[5:], ""
        else:
            tok, rest = rest[5:sep], rest[sep + 2 :]
        tok = tok.strip().rstrip(",")
        name = None if tok in _UNKNOWN else tok
    return pid, name, rest.strip()


def _parse_xid_at(line: str, pos: int) -> KernelXid | None:
    """Parse the Xid/SXid body that starts at ``line[pos]`` (the ``S`` of SXid or the ``X`` of Xid)."""
    if pos > 0 and line[pos - 1].isalnum():
        return None
    m = _BODY_RE.match(line, pos)
    if m is None:
        return None
    pci, attr, code, rest = m.group(1), m.group(2), m.group(3), m.group(4) or ""
    gi = ci = None
    if attr:
        g = _GI_RE.search(attr)
        if g is not None:
            gi = int(g.group(1))
        c = _CI_RE.search(attr)
        if c is not None:
            ci = int(c.group(1))
    kernel_time_s, wall_time = _prefix_times(line[:pos])
    if "\\x" in rest and _KMSG_HDR_RE.match(line) is not None:
        rest = unescape_kmsg(rest)
    pid, name, message = _split_pid_name(rest)
    return KernelXid(
        kind="sxid" if line.startswith("S", pos) else "xid",
        xid=int(code),
        pci_bus_id=pci,
        pid=pid,
        process_name=name,
        message=message[:MAX_MESSAGE_CHARS],
        gpu_instance_id=gi,
        compute_instance_id=ci,
        kernel_time_s=kernel_time_s,
        wall_time=wall_time,
        raw=line,
    )


def _find_xid(line: str) -> KernelXid | None:
    i = line.find("Xid (")
    while i >= 0:
        pos = i - 1 if i > 0 and line[i - 1] == "S" else i
        ev = _parse_xid_at(line, pos)
        if ev is not None:
            return ev
        i = line.find("Xid (", i + 5)
    return None


def _fallen_pci(line: str) -> str | None:
    """The bus id named on a ``fallen off the bus`` line, after any time prefix."""
    hdr = _KMSG_HDR_RE.match(line)
    start = hdr.end() if hdr is not None else 0
    m = _ANY_PCI_RE.search(line, start)
    return m.group(1) if m is not None else None


def _line_kernel_time(line: str) -> float | None:
    hdr = _KMSG_HDR_RE.match(line)
    if hdr is not None:
        return int(hdr.group(3)) / 1_000_000
    m = _MONO_RE.search(line, 0, 64)
    return float(m.group(1)) if m is not None else None


def _clean(line: str) -> str:
    if len(line) > MAX_LINE_CHARS:
        line = line[:MAX_LINE_CHARS]
    return line.rstrip("\r\n")


def parse_line(line: str) -> KernelXid | FallenOffBus | None:
    """Parse one kernel-log line; ``None`` for anything that is not an Xid/SXid or fallen-off report.

    Single-line only: the multi-line ``The NVIDIA GPU ... fallen off the bus`` report and continuation
    lines need :class:`KmsgParser`.
    """
    if "Xid" not in line and "fallen off" not in line:
        return None
    line = _clean(line)
    if "Xid (" in line:
        ev = _find_xid(line)
        if ev is not None:
            return ev
    if "fallen off the bus" in line:
        pci = _fallen_pci(line)
        if pci is not None:
            return FallenOffBus(pci_bus_id=pci, kernel_time_s=_line_kernel_time(line), raw=line)
    return None


def parse_driver_load(line: str) -> DriverLoaded | None:
    """The driver's load line (see module doc), else ``None``."""
    if "NVRM: loading" not in line:
        return None
    line = _clean(line)
    m = _DRIVER_LOAD_RE.search(line)
    if m is None:
        return None
    kernel_time_s, wall_time = _prefix_times(line[: m.start()])
    return DriverLoaded(
        driver_version=m.group(1),
        text=line[m.start() :].strip()[:MAX_MESSAGE_CHARS],
        kernel_time_s=kernel_time_s,
        wall_time=wall_time,
        raw=line,
    )


def _same_burst(a: KernelXid, b: KernelXid) -> bool:
    if (
        a.kind != b.kind
        or a.xid != b.xid
        or a.pci_bus_id != b.pci_bus_id
        or a.pid != b.pid
        or a.process_name != b.process_name
        or a.gpu_instance_id != b.gpu_instance_id
        or a.compute_instance_id != b.compute_instance_id
    ):
        return False
    if a.kernel_time_s is not None and b.kernel_time_s is not None:
        return abs(b.kernel_time_s - a.kernel_time_s) <= 0.05
    return a.wall_time is not None and a.wall_time == b.wall_time


class KmsgParser:
    """Streaming parser: ``feed`` one line at a time, ``flush`` at end of input (or when idle).

    An Xid is held back until the next line shows whether it continues the Xid's record (a line that
    starts with white space: its text, minus a leading ``NVRM: ``, is appended to the message after a
    space, and its raw text to ``raw`` after a newline; an indented line that holds an ``Xid (`` token or
    starts with a time stamp is a new record instead). Any other line, including an empty one, ends
    the record; a live reader should therefore feed ``""`` (or call :meth:`flush`) when its source goes
    quiet, so the last Xid is not held until the next kernel message. Continuation lines that look like
    ``/dev/kmsg`` dictionary entries (`` SUBSYSTEM=pci``) are ignored.

    ``coalesce_repeats=True`` also folds an Xid into the held one when it has the same kind, code, bus
    id, process and MIG ids and (nearly) the same time stamp (within 50 ms of kernel time, or the same
    wall-time text): the driver prints e.g. Xid 13 (``Graphics SM Warp Exception``, ``Graphics SM Global
    Exception``, ``Graphics Exception: ESR ...``) and SXid 20034 (``Fatal``, ``Severity``, ``Data``) as
    several lines for one fault; the messages are joined with ``"; "``. Off by default: each Xid line is
    then its own event, as ``gpupipe xid parse`` promises.

    ``FallenOffBus`` is emitted for a ``fallen off the bus`` line that has no Xid; its bus id comes from
    the same line, or from an ``NVRM: The NVIDIA GPU <bus id>`` line up to three lines earlier. The
    driver normally prints an Xid 79 too; telling the two apart (or de-duplicating) is the caller's job.

    ``driver_loads=True`` also emits :class:`DriverLoaded` for the driver's load line (the node agent
    publishes it as recovery evidence; ``gpupipe xid parse`` reports Xids only and leaves it off).
    """

    __slots__ = (
        "_coalesce",
        "_driver_loads",
        "_gpu_block",
        "_gpu_line_no",
        "_gpu_pci",
        "_line_no",
        "_n_cont",
        "_pending",
    )

    def __init__(self, *, coalesce_repeats: bool = False, driver_loads: bool = False) -> None:
        self._coalesce = coalesce_repeats
        self._driver_loads = driver_loads
        self._pending: KernelXid | None = None
        self._n_cont = 0
        self._line_no = 0
        self._gpu_line_no = -10
        self._gpu_pci = ""
        self._gpu_block: tuple[str, ...] = ()

    @property
    def pending(self) -> KernelXid | None:
        """The Xid held back waiting for possible continuation lines."""
        return self._pending

    def feed(self, line: str) -> list[Event]:
        self._line_no += 1
        pending = self._pending
        if pending is not None and line[:1] in _WS:
            text = line.lstrip()
            if "Xid (" not in text and _NEW_RECORD_RE.match(text) is None:
                self._continue(pending, line)
                return []
        if "Xid" not in line and "NVRM" not in line and "fallen off" not in line:
            if pending is None:
                return []
            self._pending = None
            return [pending]
        ev = self._slow(line)
        if pending is None:
            if ev is None:
                return []
            if type(ev) is KernelXid:
                self._pending = ev
                self._n_cont = 0
                return []
            return [ev]
        if ev is None:
            self._pending = None
            return [pending]
        if type(ev) is KernelXid:
            if self._coalesce and _same_burst(pending, ev):
                self._pending = replace(
                    pending,
                    message=(pending.message + "; " + ev.message)[:MAX_MESSAGE_CHARS],
                    raw=(pending.raw + "\n" + ev.raw)[:MAX_RAW_CHARS],
                )
                return []
            self._pending = ev
            self._n_cont = 0
            return [pending]
        self._pending = None
        return [pending, ev]

    def flush(self) -> list[Event]:
        """Emit the held Xid, if any (end of input, or the source has been idle)."""
        pending = self._pending
        self._pending = None
        return [] if pending is None else [pending]

    def _continue(self, pending: KernelXid, line: str) -> None:
        line = _clean(line)
        text = line.strip()
        if not text or _KMSG_DICT_RE.match(text) is not None:
            return
        if self._n_cont >= MAX_CONTINUATION_LINES:
            return
        self._n_cont += 1
        if text.startswith("NVRM: "):
            text = text[6:].lstrip()
        message = (pending.message + " " + text if pending.message else text)[:MAX_MESSAGE_CHARS]
        self._pending = replace(pending, message=message, raw=(pending.raw + "\n" + line)[:MAX_RAW_CHARS])

    def _slow(self, line: str) -> Event | None:
        line = _clean(line)
        if "Xid (" in line:
            ev = _find_xid(line)
            if ev is not None:
                return ev
        recent = self._line_no - self._gpu_line_no <= 3
        if "fallen off the bus" in line:
            pci = _fallen_pci(line)
            raw = line
            kernel_time_s = _line_kernel_time(line)
            if pci is None and recent:
                pci = self._gpu_pci
                raw = "\n".join((*self._gpu_block, line))
                if kernel_time_s is None:
                    kernel_time_s = _line_kernel_time(self._gpu_block[0])
            if pci:
                self._gpu_line_no = -10
                self._gpu_block = ()
                return FallenOffBus(pci_bus_id=pci, kernel_time_s=kernel_time_s, raw=raw)
            return None
        if self._driver_loads and "NVRM: loading" in line:
            loaded = parse_driver_load(line)
            if loaded is not None:
                return loaded
        if "The NVIDIA GPU " in line:
            m = _THE_GPU_RE.search(line)
            if m is not None:
                self._gpu_pci = m.group(1)
                self._gpu_line_no = self._line_no
                self._gpu_block = (line,)
                return None
        if recent and len(self._gpu_block) < 3:
            self._gpu_block = (*self._gpu_block, line)
        return None
