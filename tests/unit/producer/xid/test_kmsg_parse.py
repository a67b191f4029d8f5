"""Tests for gpupipe_producer.xid.kmsg_parse and gpupipe_producer.xid.parse_cli (pure, no devices)."""

from __future__ import annotations

import io
import json
import os
import random
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

from gpupipe_producer.xid.kmsg_parse import (
    MAX_MESSAGE_CHARS,
    FallenOffBus,
    KernelXid,
    KmsgParser,
    containment_flags,
    parse_line,
    split_kmsg_record,
    to_json_dict,
    unescape_kmsg,
)
from gpupipe_producer.xid.parse_cli import run_xid_parse
from tests.paths import REPO, TESTS

FIXTURES = TESTS / "fixtures" / "kmsg"
REPO = REPO


def _lines(name: str, *, keep_blank: bool = False) -> list[str]:
    out = []
    for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or (not line.strip() and not keep_blank):
            continue
        out.append(line)
    return out


def _shared(name: str) -> Path:
    """The shared corpus, copied into tests/fixtures/reference (sources named in its README)."""
    return REPO / "tests" / "fixtures" / "reference" / name


class X(NamedTuple):
    kind: str
    xid: int
    pci: str
    pid: int | None
    name: str | None
    message: str
    gi: int | None = None
    ci: int | None = None
    kt: float | None = None
    wt: str | None = None


U = None  # pid / name printed as '<unknown>' or absent

# Hand-written expectations for tests/fixtures/kmsg/xid_real.txt, line by line.
EXPECTED_REAL: list[X] = [
    # shared corpus
    X("xid", 63, "0000:10:1c", 1896, U, "Row Remapper: New row marked for remapping, reset gpu to activate."),
    X("xid", 79, "0000:91:00", U, U, "GPU has fallen off the bus.", kt=6781741.548779),
    X("sxid", 20034, "0000:06:00.0", U, U, "Fatal, Link 48 LTSSM Fault Up", kt=6781753.400584),
    X(
        "sxid",
        20034,
        "0000:07:00.0",
        U,
        U,
        "Severity 1 Engine instance 60 Sub-engine instance 00",
        kt=6781753.404848,
    ),
    X(
        "sxid",
        20034,
        "0000:05:00.0",
        U,
        U,
        "Data {0x10000000, 0x10000000, 0x00000000, 0x10000000, 0x00000000, 0x00000000, 0x00000000, "
        "0x00000000, 0x00000000}",
        kt=6781753.406566,
    ),
    X(
        "xid",
        119,
        "0000:9b:00",
        2024380,
        "nvidia-smi",
        "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 103 (GSP_RM_ALLOC) "
        "(0x2081 0x4).",
        wt="Sun Feb 23 16:24:18 2025",
    ),
    X(
        "xid",
        119,
        "0000:9b:00",
        2024380,
        "nvidia-smi",
        "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function 10 (FREE) "
        "(0xa55a0210 0x0).",
        wt="Sun Feb 23 16:24:24 2025",
    ),
    X("xid", 94, "0000:01:00", 7194, U, "Contained: CE User Channel (0x9). RST: No, D-RST: No", gi=5),
    X("xid", 94, "0000:01:00", 7062, U, "Contained: CE User Channel (0x9). RST: No, D-RST: No"),
    X("xid", 95, "0000:01:00", 7062, U, "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No"),
    # gpud PR 46, dmesg --ctime
    X(
        "xid",
        13,
        "0000:cb:00",
        U,
        U,
        "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
        wt="Fri Aug 30 11:43:09 2024",
    ),
    X(
        "xid",
        13,
        "0000:cb:00",
        U,
        U,
        "Graphics SM Global Exception on (GPC 7, TPC 7, SM 0): Multiple Warp Errors",
        wt="Fri Aug 30 11:43:09 2024",
    ),
    X(
        "xid",
        13,
        "0000:cb:00",
        U,
        U,
        "Graphics Exception: ESR 0x57c730=0xc04000b 0x57c734=0x24 0x57c728=0x1f81fb60 0x57c72c=0x1174",
        wt="Fri Aug 30 11:43:09 2024",
    ),
    X(
        "xid",
        109,
        "0000:cb:00",
        1797828,
        "pt_main_thread",
        "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x58005",
        wt="Fri Aug 30 11:43:14 2024",
    ),
    # vllm 5901
    X(
        "xid",
        13,
        "0000:43:00",
        U,
        U,
        "Graphics Exception: ESR 0x52e7b0=0x101000e 0x52e7b4=0x4 0x52e7a8=0xc81eb60 0x52e7ac=0x1174",
        kt=93297.027938,
    ),
    X(
        "xid",
        13,
        "0000:43:00",
        U,
        U,
        "Graphics Exception: ESR 0x52ef30=0x0 0x52ef34=0x20 0x52ef28=0xc81eb60 0x52ef2c=0x1174",
        kt=93297.029837,
    ),
    # Bumblebee 677
    X("xid", 32, "0000:01:00", U, U, "Channel ID 00000000 intr 00004000", kt=24128.828315),
    X("xid", 31, "0000:01:00", U, U, "Ch 00000003, engmask 00000101, intr 10000000", kt=24128.834365),
    # cosmic-comp 1113
    X(
        "xid",
        13,
        "0000:09:00",
        U,
        U,
        "Graphics Exception: Shader Program Header 18 Error",
        kt=4440.890381,
    ),
    X(
        "xid",
        13,
        "0000:09:00",
        U,
        U,
        "Graphics Exception: ChID 000a, Class 0000c797, Offset 00000000, Data 00000000",
        kt=4440.891681,
    ),
    # open-gpu-kernel-modules 1150
    X("xid", 45, "0000:dc:00", 1818990, "python3", "Ch 00000001 caused by previous Xid 149"),
    X("xid", 45, "0000:ed:00", 1818992, "python3", "Ch 0000000c caused by previous Xid 145"),
    # nvtrust 124
    X("sxid", 22013, "0000:02:00.0", U, U, "Non-fatal, Link 00 Minion Link DLREQ interrupt", kt=25.948274),
    X(
        "sxid",
        22013,
        "0000:02:00.0",
        U,
        U,
        "Severity 0 Engine instance 00 Sub-engine instance 00",
        kt=25.950244,
    ),
    X(
        "sxid",
        22013,
        "0000:02:00.0",
        U,
        U,
        "Data {0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x80005302, 0x00000000, 0x00000000, "
        "0x00000000, 0x00000000}",
        kt=25.952303,
    ),
    # gpud PR 338, dmesg --decode --time-format iso
    X(
        "sxid",
        12028,
        "0000:84:00.0",
        U,
        U,
        "Data {0x000001c0, 0x00bd5c8a, 0x00000500, 0x00000064, 0x00000000, 0x40008000, 0x5a001100, "
        "0x00000000, 0x00000000}",
        wt="2025-01-25T10:34:54,859532+00:00",
    ),
    # gpud PR 1174
    X(
        "xid",
        149,
        "0019:01:00",
        U,
        U,
        "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
    ),
    X(
        "xid",
        145,
        "0018:01:00",
        U,
        U,
        "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 "
        "0x00000004)",
    ),
    X("xid", 94, "0000:9b:00", 1234, "python3", "Contained ECC error"),
    # gpud PR 1160
    X(
        "xid",
        144,
        "0000:01:00",
        U,
        U,
        "SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000001 0x00000008 0x00000000 0x00000000 0x00000000 0x00000000)",
    ),
    # dra-driver 904
    X("xid", 43, "0009:01:00", 3188489, "trigger_xid", "channel 0x0b00000a", kt=1231741.378609),
    # NVIDIA forum 364958
    X(
        "xid",
        120,
        "0000:01:00",
        U,
        U,
        "GSP kernel exception: store access page fault (cause:0xf) @ pc:0xffffffff93003d42, partition:4#0",
        wt="Mar 29 15:38:59",
    ),
    X(
        "xid",
        154,
        "0000:01:00",
        U,
        U,
        "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        wt="Mar 29 15:38:59",
    ),
    X(
        "xid",
        62,
        "0000:01:00",
        U,
        U,
        "223b6a66 00002100 00000000 20662342 20662ba6 20664272 2065f7ca 2063f48c",
        wt="Mar 27 17:40:36",
    ),
    X("xid", 45, "0000:01:00", 12542, "VLLM::Worker", "channel 0x00000002", wt="Mar 27 17:40:36"),
    # akash 244, dmesg -T
    X(
        "xid",
        43,
        "0000:00:05",
        1045242,
        "pt_main_thread",
        "Ch 00000008",
        wt="Wed Jul 31 23:14:18 2024",
    ),
    X(
        "xid",
        31,
        "0000:00:07",
        2512125,
        "python3.10",
        "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_8 faulted @ 0x73ac_1c000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE",
        wt="Mon Aug  5 03:54:13 2024",
    ),
    X(
        "xid",
        94,
        "0000:00:08",
        U,
        U,
        "Contained: SM (0x1). RST: No, D-RST: No",
        wt="Fri Aug  9 13:32:56 2024",
    ),
    # chia-gigahorse 301
    X(
        "xid",
        31,
        "0000:0a:00",
        13332,
        "cuda_plot_k32_v",
        "Ch 00000010, intr 00000000. MMU Fault: ENGINE CE2 HUBCLIENT_CE0 faulted @ 0x7f29_5b8c9000. "
        "Fault is of type FAULT_PRIV_VIOLATION ACCESS_TYPE_VIRT_READ",
        kt=14328.198504,
    ),
    X(
        "xid",
        62,
        "0000:0a:00",
        U,
        U,
        "2023b230 20238a3a 2023e8b6 2023eac4 2023ec3c 2023ea86 00000000 00000000",
        kt=14370.687545,
    ),
    X("xid", 45, "0000:0a:00", U, U, "Ch 00000008", kt=14370.688139),
    # gpu-operator 1146
    X(
        "xid",
        48,
        "0000:07:00",
        U,
        U,
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at physAddr "
        "0x7fffa8860 partition 7, subpartition 1.",
        kt=219.470994,
        wt="Dec  2 11:38:47",
    ),
    X(
        "xid",
        64,
        "0000:07:00",
        U,
        U,
        "Dynamic Page Retirement: Blacklisting failed.  Page should have been blacklisted on "
        "boot(0x00000000007fffa8).",
        kt=219.471050,
        wt="Dec  2 11:38:47",
    ),
    # Proton 9426
    X(
        "xid",
        31,
        "0000:01:00",
        35097,
        "SpaceEngine.exe",
        "channel 0x0000005c, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted @ "
        "0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        kt=1451.785035,
    ),
    # vdpau-va-driver-vp9 2
    X(
        "xid",
        31,
        "0000:00:06",
        2708,
        U,
        "Ch 0000003d, intr 10000000. MMU Fault: ENGINE NVDEC HUBCLIENT_NVDEV faulted @ 0x0_00000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    ),
    # dxvk 1027
    X(
        "xid",
        31,
        "0000:01:00",
        U,
        U,
        "Ch 0000003a, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x17_00592000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_READ",
        kt=31543.449443,
    ),
    X(
        "xid",
        13,
        "0000:01:00",
        U,
        U,
        "Graphics Exception: Class 0x0 Subchannel 0x0 Mismatch",
        kt=31609.615230,
    ),
    # open-gpu-kernel-modules 1030
    X(
        "xid",
        31,
        "0000:01:00",
        13705,
        "UnrealEditor",
        "channel 0x0000000c, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted @ "
        "0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        kt=365.969681,
    ),
    # Modal
    X("xid", 79, "0000:c6:00", 1101234, "nvc:[driver]", "GPU has fallen off the bus."),
    # NVIDIA forum 371272
    X(
        "xid",
        62,
        "0000:01:00",
        U,
        U,
        "323f0f30 0000c3d8 00000000 206dae68 206da022 206da190 206d85f6 206d8d86",
    ),
    X(
        "xid",
        154,
        "0000:01:00",
        U,
        U,
        "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
    ),
    # NVSentinel 155
    X("xid", 79, "0000:44:00", U, U, "GPU has fallen off the bus"),
    # NVIDIA docs
    X("xid", 79, "0000:5a:00", U, U, "GPU has fallen off the bus."),
    X("xid", 14, "0000:03:00", U, U, "Channel 00000001"),
]


def _check(ev: object, exp: X, raw: str) -> None:
    assert isinstance(ev, KernelXid), raw
    assert ev == KernelXid(
        kind=exp.kind,  # type: ignore[arg-type]
        xid=exp.xid,
        pci_bus_id=exp.pci,
        pid=exp.pid,
        process_name=exp.name,
        message=exp.message,
        gpu_instance_id=exp.gi,
        compute_instance_id=exp.ci,
        kernel_time_s=exp.kt,
        wall_time=exp.wt,
        raw=raw,
    ), raw


# ---------------------------------------------------------------------------------- real lines


def test_fixture_and_expectations_line_up() -> None:
    lines = _lines("xid_real.txt")
    assert len(lines) == len(EXPECTED_REAL) == 54


@pytest.mark.parametrize("index", range(len(EXPECTED_REAL)))
def test_real_xid_line(index: int) -> None:
    line = _lines("xid_real.txt")[index]
    _check(parse_line(line), EXPECTED_REAL[index], line)


def test_real_xid_lines_through_streaming_parser() -> None:
    lines = _lines("xid_real.txt")
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert len(events) == len(lines)
    for ev, exp, line in zip(events, EXPECTED_REAL, lines, strict=True):
        _check(ev, exp, line)


def test_shared_corpus_every_line() -> None:
    path = _shared("xid-kmsg-corpus-from-repos.txt")
    rows = [r.split("\t")[0] for r in path.read_text(encoding="utf-8").splitlines() if r.strip()]
    assert rows == _lines("xid_real.txt")[: len(rows)]
    for row, exp in zip(rows, EXPECTED_REAL, strict=False):
        _check(parse_line(row), exp, row)


def test_shared_non_xid_corpus_yields_nothing() -> None:
    path = _shared("non-xid-kmsg-from-repos.txt")
    rows = [r.split("\t")[0] for r in path.read_text(encoding="utf-8").splitlines() if r.strip()]
    assert len(rows) == 7
    parser = KmsgParser()
    for row in rows:
        assert parse_line(row) is None, row
        assert parser.feed(row) == [], row
    assert parser.flush() == []


def test_real_non_xid_lines_yield_nothing() -> None:
    lines = _lines("non_xid_real.txt")
    assert len(lines) == 42
    parser = KmsgParser()
    for line in lines:
        assert parse_line(line) is None, line
        assert parser.feed(line) == [], line
    assert parser.flush() == []


def test_real_fallen_off_bus_without_xid() -> None:
    lines = _lines("fallen_off_bus_real.txt")
    for line in lines:
        assert parse_line(line) is None or isinstance(parse_line(line), FallenOffBus)
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert events == [
        FallenOffBus(pci_bus_id="0000:b3:00.0", kernel_time_s=1843.308145, raw="\n".join(lines[:3]))
    ]


def test_real_wrapped_continuation_line() -> None:
    lines = _lines("continuation_real.txt")
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert events == [
        KernelXid(
            kind="xid",
            xid=13,
            pci_bus_id="0000:01:00",
            pid=1773,
            process_name=".gala-wrapped",
            message="Graphics Exception: channel 0x00000005, Class 0000c997, Offset 00000000, Data 00000000",
            gpu_instance_id=None,
            compute_instance_id=None,
            kernel_time_s=None,
            wall_time="Jul 06 20:02:59",
            raw=lines[0] + "\n" + lines[1],
        )
    ]


# ---------------------------------------------------------------------------------- variants
# The lines below are real messages from the fixture with the *prefix* other tools put in front, or
# lines built from the driver's printf format (kernel_rc.c); they are labelled as constructed.

_MSG_94 = (
    "NVRM: Xid (PCI:0000:00:08): 94, pid='<unknown>', name=<unknown>, Contained: SM (0x1). RST: No, D-RST: No"
)


@pytest.mark.parametrize(
    ("line", "kernel_time_s", "wall_time"),
    [
        # journalctl -o short
        (f"Aug 09 13:32:56 gpu-node-7 kernel: {_MSG_94}", None, "Aug 09 13:32:56"),
        # journalctl -o short-precise
        (f"Aug 09 13:32:56.873541 gpu-node-7 kernel: {_MSG_94}", None, "Aug 09 13:32:56.873541"),
        # journalctl -o short-iso
        (f"2024-08-09T13:32:56+0000 gpu-node-7 kernel: {_MSG_94}", None, "2024-08-09T13:32:56+0000"),
        # journalctl -o short-iso-precise
        (
            f"2024-08-09T13:32:56.873541+00:00 gpu-node-7 kernel: {_MSG_94}",
            None,
            "2024-08-09T13:32:56.873541+00:00",
        ),
        # journalctl -o short-monotonic
        (f"[ 1231741.378609] gpu-node-7 kernel: {_MSG_94}", 1231741.378609, None),
        # classic syslog file, single-digit day padded with a space
        (f"Mar  3 10:11:12 gpu-node-7 kernel: {_MSG_94}", None, "Mar  3 10:11:12"),
        # rsyslog RFC 3339 plus the kernel's own stamp
        (
            f"2025-01-07T21:16:59.312055+00:00 gpu-node-7 kernel: [1378283.684891] {_MSG_94}",
            1378283.684891,
            "2025-01-07T21:16:59.312055+00:00",
        ),
        # dmesg, dmesg -T
        (f"[    5.678901] {_MSG_94}", 5.678901, None),
        (f"[Fri Aug  9 13:32:56 2024] {_MSG_94}", None, "Fri Aug  9 13:32:56 2024"),
        # /dev/kmsg records: plain, and with the caller-id field of newer kernels
        (f"4,1234,5678901,-;{_MSG_94}", 5.678901, None),
        (f"4,1234,5678901,-,caller=T4123;{_MSG_94}", 5.678901, None),
        # no prefix at all
        (_MSG_94, None, None),
    ],
)
def test_prefix_variants(line: str, kernel_time_s: float | None, wall_time: str | None) -> None:
    ev = parse_line(line)
    assert isinstance(ev, KernelXid)
    assert (ev.kind, ev.xid, ev.pci_bus_id, ev.pid, ev.process_name) == ("xid", 94, "0000:00:08", None, None)
    assert ev.message == "Contained: SM (0x1). RST: No, D-RST: No"
    assert ev.kernel_time_s == kernel_time_s
    assert ev.wall_time == wall_time
    assert ev.raw == line
    assert containment_flags(ev.message) == (False, False)


@pytest.mark.parametrize(
    ("line", "gi", "ci", "pid", "name", "message"),
    [
        # constructed from kernel_rc.c: "PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u"
        (
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:02): 43, pid=4242, name=python3, channel 0x00000010",
            1,
            2,
            4242,
            "python3",
            "channel 0x00000010",
        ),
        # constructed: GPU instance only, process unknown (the driver then omits pid/name)
        (
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:13): 31, MMU Fault: ENGINE GRAPHICS",
            13,
            None,
            None,
            None,
            "MMU Fault: ENGINE GRAPHICS",
        ),
        # constructed: MIG attribution on an Xid 94 line with both ids
        (
            "[ 8123.000001] NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:00): 94, pid=77, name=python, "
            "Contained: SM (0x1). RST: No, D-RST: No",
            2,
            0,
            77,
            "python",
            "Contained: SM (0x1). RST: No, D-RST: No",
        ),
    ],
)
def test_mig_attribution(
    line: str, gi: int | None, ci: int | None, pid: int | None, name: str | None, message: str
) -> None:
    ev = parse_line(line)
    assert isinstance(ev, KernelXid)
    assert ev.pci_bus_id == "0000:3b:00"
    assert (ev.gpu_instance_id, ev.compute_instance_id) == (gi, ci)
    assert (ev.pid, ev.process_name, ev.message) == (pid, name, message)


@pytest.mark.parametrize(
    ("rest", "pid", "name", "message"),
    [
        ("pid=1234, name=python3, msg", 1234, "python3", "msg"),
        ("pid='<unknown>', name=<unknown>, msg", None, None, "msg"),
        ("pid=<unknown>, name=<unknown>, msg", None, None, "msg"),
        ("pid=1234, msg, with, commas", 1234, None, "msg, with, commas"),
        ("pid=1234, name=python3, ", 1234, "python3", ""),
        ("pid=1234, name=python3", 1234, "python3", ""),
        ("pid=1234", 1234, None, ""),
        ("msg only", None, None, "msg only"),
        ("", None, None, ""),
    ],
)
def test_pid_and_name_forms(rest: str, pid: int | None, name: str | None, message: str) -> None:
    ev = parse_line(f"NVRM: Xid (PCI:0000:01:00): 43, {rest}")
    assert isinstance(ev, KernelXid)
    assert (ev.pid, ev.process_name, ev.message) == (pid, name, message)


def test_code_without_message() -> None:
    ev = parse_line("NVRM: Xid (PCI:0000:01:00): 79")
    assert isinstance(ev, KernelXid)
    assert (ev.xid, ev.message, ev.pid) == (79, "", None)


def test_domain_is_kept_as_printed() -> None:
    ev = parse_line("NVRM: Xid (PCI:0009:01:00): 43, pid=1, name=a, m")
    assert isinstance(ev, KernelXid)
    assert ev.pci_bus_id == "0009:01:00"


def test_kmsg_escapes_in_raw_record_are_undone() -> None:
    ev = parse_line(
        "4,9,1000000,-;NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, path C:\\x5cdir caf\\xc3\\xa9"
    )
    assert isinstance(ev, KernelXid)
    assert ev.message == "path C:\\dir café"
    assert ev.kernel_time_s == 1.0


def test_containment_flags() -> None:
    assert containment_flags("Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No") == (True, False)
    assert containment_flags("Contained: SM (0x1). RST: No, D-RST: Yes") == (False, True)
    assert containment_flags("Graphics Exception") is None


def test_unescape_and_split_record() -> None:
    assert unescape_kmsg("a\\x0ab") == "a\nb"
    assert unescape_kmsg("plain") == "plain"
    assert unescape_kmsg("bad \\xff") == "bad \ufffd"
    assert split_kmsg_record("6,3964,206764307,-;nvidia-nvswitch2: open (major=510)") == (
        6,
        3964,
        206764307,
        "-",
        "nvidia-nvswitch2: open (major=510)",
    )
    assert split_kmsg_record("6,1,2,;x") == (6, 1, 2, "-", "x")
    assert split_kmsg_record("not a record") is None


# ---------------------------------------------------------------------------------- streaming


def test_continuation_lines_are_appended() -> None:
    parser = KmsgParser()
    assert (
        parser.feed("[  100.000001] NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, Graphics Exception:") == []
    )
    assert parser.feed("               NVRM: ESR 0x1=0x2") == []
    assert parser.feed("\tmore text") == []
    (ev,) = parser.feed("[  100.000002] something else")
    assert isinstance(ev, KernelXid)
    assert ev.message == "Graphics Exception: ESR 0x1=0x2 more text"
    assert ev.raw.count("\n") == 2
    assert parser.flush() == []


def test_indented_paste_is_not_one_long_continuation() -> None:
    lines = ["    " + line for line in _lines("xid_real.txt")]
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert [e.message for e in events if isinstance(e, KernelXid)] == [e.message for e in EXPECTED_REAL]


def test_kmsg_dictionary_lines_are_not_continuations() -> None:
    parser = KmsgParser()
    parser.feed("4,12,3000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=a, GPU has fallen off the bus.")
    assert parser.feed(" SUBSYSTEM=pci") == []
    assert parser.feed(" DEVICE=+pci:0000:3b:00.0") == []
    (ev,) = parser.flush()
    assert isinstance(ev, KernelXid)
    assert ev.message == "GPU has fallen off the bus."
    assert ev.kernel_time_s == 3.0


def test_empty_line_releases_held_xid() -> None:
    parser = KmsgParser()
    assert parser.feed("NVRM: Xid (PCI:0000:01:00): 43, pid=1, name=a, m") == []
    assert parser.pending is not None
    (ev,) = parser.feed("")
    assert isinstance(ev, KernelXid)
    assert parser.pending is None


def test_back_to_back_xids_are_separate_events_by_default() -> None:
    lines = _lines("xid_real.txt")[10:13]  # three Xid 13 lines of one fault (gpud PR 46)
    parser = KmsgParser()
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert [e.message for e in events if isinstance(e, KernelXid)] == [
        e.message for e in EXPECTED_REAL[10:13]
    ]


def test_coalesce_repeats_folds_one_fault_into_one_event() -> None:
    lines = _lines("xid_real.txt")
    parser = KmsgParser(coalesce_repeats=True)
    events = [ev for line in lines[10:14] for ev in parser.feed(line)] + parser.flush()
    assert len(events) == 2
    first, second = events
    assert isinstance(first, KernelXid) and isinstance(second, KernelXid)
    assert first.xid == 13
    assert first.message == "; ".join(e.message for e in EXPECTED_REAL[10:13])
    assert first.raw == "\n".join(lines[10:13])
    assert second.xid == 109
    # SXid 22013 Fatal/Severity/Data lines within 4 ms: one event; the two Xid 45 of different GPUs: two
    sx = [ev for line in lines[22:25] for ev in parser.feed(line)] + parser.flush()
    assert len(sx) == 1 and isinstance(sx[0], KernelXid) and sx[0].message.count("; ") == 2
    two = [ev for line in lines[20:22] for ev in parser.feed(line)] + parser.flush()
    assert len(two) == 2


def test_fallen_off_bus_single_line_and_kmsg_record() -> None:
    # constructed from the driver's printf (nv.c) as one /dev/kmsg record with \x0a escapes
    rec = (
        "3,881,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this"
        " system has\\x0aNVRM: fallen off the bus and is not responding to commands."
    )
    assert parse_line(rec) == FallenOffBus(pci_bus_id="0000:b3:00.0", kernel_time_s=1843.308145, raw=rec)
    line = "[ 4254.197871] NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus."
    assert parse_line(line) == FallenOffBus(pci_bus_id="0000:5d:00.0", kernel_time_s=4254.197871, raw=line)


def test_fallen_off_bus_without_indentation() -> None:
    # dmesg -t / pasted logs lose the indentation; the bus id still comes from two lines up
    parser = KmsgParser()
    lines = [
        "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:2d04) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    events = [ev for line in lines for ev in parser.feed(line)]
    assert events == [FallenOffBus(pci_bus_id="0000:01:00.0", kernel_time_s=None, raw="\n".join(lines))]


def test_fallen_line_too_far_from_gpu_line_is_ignored() -> None:
    parser = KmsgParser()
    lines = ["NVRM: The NVIDIA GPU 0000:01:00.0", "a", "b", "c", "d", "NVRM: fallen off the bus and is not"]
    assert [ev for line in lines for ev in parser.feed(line)] == []


def test_xid_79_and_fallen_line_both_reported() -> None:
    parser = KmsgParser()
    lines = [
        "[ 4254.197860] NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, "
        "GPU has fallen off the bus.",
        "[ 4254.197871] NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.",
    ]
    events = [ev for line in lines for ev in parser.feed(line)] + parser.flush()
    assert [type(e) for e in events] == [KernelXid, FallenOffBus]


# ---------------------------------------------------------------------------------- garbage


@pytest.mark.parametrize(
    "line",
    [
        "",
        "Xid (",
        "NVRM: Xid (",
        "NVRM: Xid (PCI:zzzz:01:00): 13, x",
        "NVRM: Xid (PCI:0000:01:00): , x",
        "NVRM: Xid (PCI:0000:01:00): 1234567, x",
        "NVRM: Xid (PCI:0000:01:00: 13, x",
        "NVRM: FooXid (PCI:0000:01:00): 13, x",
        "XidCriticalError: Xid=94 on Device=GPU-1",
        "\x00\x01\x02 Xid \xff\ufffd fallen off",
        "fallen off the bus",
        "\ud800 NVRM: Xid (PCI:\udcff",
        "Xid (" * 5000,
        "NVRM" * 10000,
    ],
)
def test_garbage_never_raises(line: str) -> None:
    assert parse_line(line) is None
    parser = KmsgParser()
    assert parser.feed(line) == []
    assert parser.flush() == []


def test_huge_line_is_capped() -> None:
    line = "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=a, " + "A" * 1_000_000
    ev = parse_line(line)
    assert isinstance(ev, KernelXid)
    assert len(ev.message) == MAX_MESSAGE_CHARS
    assert len(ev.raw) <= 16384


def test_fuzz_truncations_and_random_bytes() -> None:
    rng = random.Random(1234)
    lines = _lines("xid_real.txt") + _lines("non_xid_real.txt")
    parser = KmsgParser(coalesce_repeats=True)
    for line in lines:
        for cut in range(0, len(line), 7):
            piece = line[:cut]
            ev = parse_line(piece)
            assert ev is None or isinstance(ev, KernelXid | FallenOffBus)
            parser.feed(piece)
    for _ in range(2000):
        blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        text = blob.decode("utf-8", "replace")
        if rng.random() < 0.3:
            text = "NVRM: Xid (PCI:0000:01:00): " + text
        ev = parse_line(text)
        assert ev is None or isinstance(ev, KernelXid | FallenOffBus)
        for e in parser.feed(text):
            assert isinstance(e, KernelXid | FallenOffBus)
    parser.flush()


# ---------------------------------------------------------------------------------- JSON / CLI


def test_to_json_dict_has_exactly_the_wire_keys() -> None:
    ev = parse_line(_lines("xid_real.txt")[7])
    assert isinstance(ev, KernelXid)
    d = to_json_dict(ev)
    assert list(d) == [
        "kind",
        "xid",
        "pci_bus_id",
        "pid",
        "process_name",
        "message",
        "gpu_instance_id",
        "compute_instance_id",
    ]
    assert d == {
        "kind": "xid",
        "xid": 94,
        "pci_bus_id": "0000:01:00",
        "pid": 7194,
        "process_name": None,
        "message": "Contained: CE User Channel (0x9). RST: No, D-RST: No",
        "gpu_instance_id": 5,
        "compute_instance_id": None,
    }


def _run(stdin: io.TextIOBase) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run_xid_parse(stdin, out, err)  # type: ignore[arg-type]
    return rc, out.getvalue(), err.getvalue()


def test_cli_exact_output() -> None:
    text = "\n".join(
        [
            "[ 4438.558281] PM: suspend exit",
            _lines("xid_real.txt")[1],  # Xid 79, dmesg
            _lines("xid_real.txt")[2],  # SXid 20034
            _lines("xid_real.txt")[7],  # Xid 94 with GPU-I
            "Jul 06 20:02:59 gaming kernel: NVRM: Xid (PCI:0000:01:00): 13, pid=1773, "
            "name=.gala-wrapped, Data",
            " 00000000",
            *_lines("fallen_off_bus_real.txt"),
        ]
    )
    rc, out, err = _run(io.StringIO(text))
    assert rc == 0
    assert out == (
        '{"kind": "xid", "xid": 79, "pci_bus_id": "0000:91:00", "pid": null, "process_name": null, '
        '"message": "GPU has fallen off the bus.", "gpu_instance_id": null, "compute_instance_id": null}\n'
        '{"kind": "sxid", "xid": 20034, "pci_bus_id": "0000:06:00.0", "pid": null, "process_name": null, '
        '"message": "Fatal, Link 48 LTSSM Fault Up", "gpu_instance_id": null, "compute_instance_id": null}\n'
        '{"kind": "xid", "xid": 94, "pci_bus_id": "0000:01:00", "pid": 7194, "process_name": null, '
        '"message": "Contained: CE User Channel (0x9). RST: No, D-RST: No", "gpu_instance_id": 5, '
        '"compute_instance_id": null}\n'
        '{"kind": "xid", "xid": 13, "pci_bus_id": "0000:01:00", "pid": 1773, '
        '"process_name": ".gala-wrapped", '
        '"message": "Data 00000000", "gpu_instance_id": null, "compute_instance_id": null}\n'
    )
    assert err == "note: GPU 0000:b3:00.0 has fallen off the bus (no Xid on that line; not printed)\n"


def test_cli_all_real_fixture_lines() -> None:
    text = (FIXTURES / "xid_real.txt").read_text(encoding="utf-8")
    rc, out, err = _run(io.StringIO(text))
    assert rc == 0 and err == ""
    rows = [json.loads(r) for r in out.splitlines()]
    assert [(r["kind"], r["xid"], r["pci_bus_id"], r["message"]) for r in rows] == [
        (e.kind, e.xid, e.pci, e.message) for e in EXPECTED_REAL
    ]


def test_cli_garbage_text_stream() -> None:
    rng = random.Random(7)
    junk = "".join(chr(rng.randint(0, 0x2FFF)) for _ in range(20000))
    text = junk + "\n" + "x" * 300_000 + "Xid (" + "\n\ud800\udcff lone surrogates\n"
    rc, out, err = _run(io.StringIO(text))
    assert rc == 0 and out == "" and err == ""


def test_cli_binary_stdin_through_a_pipe() -> None:
    """A real file descriptor: invalid UTF-8, NULs, a 200 KB line, CRLF; never crashes."""
    r, w = os.pipe()
    payload = (
        b"\xff\xfe\x00garbage\x80\x81\n"
        + b"A" * 200_000
        + b"\n"
        + b"[   25.948274] nvidia-nvswitch1: SXid (PCI:0000:02:00.0): 22013, Non-fatal, caf\xc3\xa9 \xff\r\n"
        + bytes(range(256))
        + b"\n"
    )

    def writer() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(payload)

    t = threading.Thread(target=writer)
    t.start()
    with os.fdopen(r, "rb") as raw:
        stdin = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
        rc, out, err = _run(stdin)  # type: ignore[arg-type]
    t.join(5)
    assert rc == 0 and err == ""
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert row["kind"] == "sxid" and row["xid"] == 22013
    assert row["message"] == "Non-fatal, caf\u00e9 \ufffd"


def test_cli_broken_stdout_returns_1() -> None:
    class Closed(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError

    rc = run_xid_parse(io.StringIO(_lines("xid_real.txt")[0] + "\n"), Closed(), io.StringIO())
    assert rc == 1
