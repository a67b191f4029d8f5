"""The XID spool on a real filesystem: durable, ordered, bounded, survives restarts and torn writes.

Review findings covered here (producer-review.md): 1.3 ENOSPC kills the agent, 1.4 torn write
swallows the next event and damaged records are silent or replayed as other bytes, 1.5 the bound
is not a bound on disk and a restart resurrects dropped events.
"""

import base64
import errno
import os
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from gpupipe_producer.agent_config import DEFAULT_SPOOL_MAX_BYTES
from gpupipe_producer.xid.spool import DEFAULT_MAX_BYTES, XidSpool
from gpupipe_producer.xid.spool_format import MAGIC, SPOOL_FILE, Scanner, encode_record, scan_records


def _data(tmp_path: Path) -> Path:
    return tmp_path / SPOOL_FILE


def test_append_ack_and_restart_replays_from_the_contiguous_watermark(tmp_path: Path) -> None:
    # Only the contiguous "delivered through" mark is persisted: an event acknowledged out of order
    # (k2) is replayed after a restart. At least once: consumers drop the duplicate by event_id.
    s = XidSpool(tmp_path)
    seqs = [s.append(f"k{i}".encode(), f"v{i}".encode()) for i in range(5)]
    s.ack(seqs[0])
    s.ack(seqs[2])
    s.close()
    again = XidSpool(tmp_path)
    assert [(k, v) for _, k, v in again.pending()] == [
        (b"k1", b"v1"),
        (b"k2", b"v2"),
        (b"k3", b"v3"),
        (b"k4", b"v4"),
    ]
    assert again.append(b"k5", b"v5") > seqs[-1], "sequence numbers keep increasing across restarts"


def test_all_acked_truncates_file(tmp_path: Path) -> None:
    s = XidSpool(tmp_path)
    a, b = s.append(b"a", b"1"), s.append(b"b", b"2")
    s.ack(b)
    assert _data(tmp_path).stat().st_size > 0
    s.ack(a)
    assert _data(tmp_path).stat().st_size == 0
    assert len(s) == 0
    s.close()
    assert XidSpool(tmp_path).pending() == []


def test_torn_write_loses_nothing_complete_and_not_the_next_event(tmp_path: Path) -> None:
    # Review 1.4: a crash mid-write, then a restart that appends, then another restart.
    s = XidSpool(tmp_path)
    s.append(b"a", b"event-1")
    s.close()
    whole = encode_record(2, b"b", b"event-2-torn")
    with open(_data(tmp_path), "ab") as fh:
        fh.write(whole[: len(whole) - 5])  # crash mid-write
    s2 = XidSpool(tmp_path)
    assert s2.torn == 1 and s2.damaged == 0
    assert [v for _, _, v in s2.pending()] == [b"event-1"]
    s2.append(b"c", b"event-3-after-restart")
    s2.close()
    s3 = XidSpool(tmp_path)
    assert [v for _, _, v in s3.pending()] == [b"event-1", b"event-3-after-restart"]
    assert s3.torn == 0 and s3.damaged == 0


@pytest.mark.parametrize("flip", [b"!", b"A"])
@pytest.mark.parametrize("offset", [0, 5, 9, 14, 20, -1])
def test_a_damaged_record_is_counted_and_skipped_never_replayed_as_other_bytes(
    tmp_path: Path, offset: int, flip: bytes
) -> None:
    s = XidSpool(tmp_path)
    for v in (b"first-xid-79", b"second-xid-48", b"third-xid-94"):
        s.append(b"GPU-1", v)
    s.close()
    raw = bytearray(_data(tmp_path).read_bytes())
    second = raw.find(MAGIC, 1)
    size = len(encode_record(2, b"GPU-1", b"second-xid-48"))
    at = second + (offset if offset >= 0 else size - 1)
    raw[at] = flip[0] if raw[at] != flip[0] else flip[0] + 1
    _data(tmp_path).write_bytes(bytes(raw))
    again = XidSpool(tmp_path)
    assert [v for _, _, v in again.pending()] == [b"first-xid-79", b"third-xid-94"]
    assert again.damaged == 1
    again.close()
    clean = XidSpool(tmp_path)  # the rewrite at load left a clean file
    assert clean.damaged == 0 and len(clean) == 2


def test_the_bound_holds_on_disk_and_after_a_restart(tmp_path: Path) -> None:
    # Review 1.5: max_bytes=4096, 200 events, Kafka down (nothing acknowledged).
    s = XidSpool(tmp_path, max_bytes=4096)
    for i in range(200):
        s.append(b"GPU-1", b"x" * 300 + str(i).encode())
        assert _data(tmp_path).stat().st_size <= 4096
        assert s.pending_bytes <= 4096
    assert s.dropped > 180
    kept = [v for _, _, v in s.pending()]
    assert kept[-1].endswith(b"199")
    s.close()
    again = XidSpool(tmp_path, max_bytes=4096)
    assert [v for _, _, v in again.pending()] == kept, "nothing dropped comes back"
    again.close()
    smaller = XidSpool(tmp_path, max_bytes=2048)  # a restart with a smaller bound applies it at load
    assert smaller.pending_bytes <= 2048 and smaller.dropped > 0
    assert _data(tmp_path).stat().st_size <= 2048
    assert [v for _, _, v in smaller.pending()][-1].endswith(b"199")


def test_full_disk_degrades_to_memory_counted_and_recovers(tmp_path: Path) -> None:
    # Review 1.3: the spool's fd swapped for /dev/full (ENOSPC on write).
    now = [0.0]
    s = XidSpool(tmp_path, retry_s=10.0, clock=lambda: now[0])
    s.append(b"a", b"before")
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, s._fd)
    os.close(full)
    seq = s.append(b"b", b"hit-enospc")  # must not raise
    assert not s.on_disk and s.write_errors == 1
    s.append(b"c", b"while-degraded")
    assert [v for _, _, v in s.pending()] == [b"before", b"hit-enospc", b"while-degraded"]
    now[0] = 11.0  # retry: the directory is fine again, the whole pending set goes back to disk
    s.append(b"d", b"after")
    assert s.on_disk
    s.ack(seq - 1)
    s.close()
    again = XidSpool(tmp_path)
    assert [v for _, _, v in again.pending()] == [b"hit-enospc", b"while-degraded", b"after"]


def test_an_unwritable_directory_is_memory_mode_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    s = XidSpool(tmp_path / "file" / "spool")
    assert not s.on_disk and s.write_errors == 1
    seq = s.append(b"k", b"v")
    assert s.pending() == [(seq, b"k", b"v")]
    s.ack(seq)
    assert len(s) == 0


def test_files_are_private_and_the_legacy_text_spool_is_migrated(tmp_path: Path) -> None:
    good = b"7\t%s\t%s\n" % (base64.b64encode(b"GPU-1"), base64.b64encode(b"old-event"))
    bad = b"8\tazE=\tZXZlbn!\n"  # one byte damaged: counted, not replayed as other bytes
    (tmp_path / "xid.spool").write_bytes(good + bad + b"9\tYg==")
    s = XidSpool(tmp_path)
    assert s.pending() == [(7, b"GPU-1", b"old-event")] and s.damaged == 1
    assert not (tmp_path / "xid.spool").exists()
    assert stat.S_IMODE(_data(tmp_path).stat().st_mode) == 0o600
    assert s.append(b"k", b"v") == 8
    s.close()
    assert [v for _, _, v in XidSpool(tmp_path).pending()] == [b"old-event", b"v"]


def test_scan_counts_a_torn_header(tmp_path: Path) -> None:
    rec = encode_record(1, b"k", b"v")
    assert scan_records(rec + rec[:6]).torn == 1
    assert scan_records(rec + b"\x00garbage" + encode_record(2, b"k", b"w")).damaged == 1
    assert errno.ENOSPC == 28


def test_new_files_and_the_acknowledged_mark_are_durable(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Review 1.4: the directory was not fsynced when the file was created, nor the "acked" temp
    # file before os.replace: a crash could leave the rename or its content unwritten.
    ops: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        ops.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        ops.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    s = XidSpool(tmp_path)
    assert ("fsync", str(tmp_path)) in ops, "the directory holding the new spool file"
    first = s.append(b"k", b"one")
    s.append(b"k", b"two")
    assert ("fsync", str(_data(tmp_path))) in ops  # each event before it is handed to Kafka
    ops.clear()
    s.ack(first)
    assert ops == [], "an acknowledgement is applied in memory; the mark is written once per pass"
    s.sync_acked()
    tmp, acked = str(tmp_path / "acked.tmp"), str(tmp_path / "acked")
    assert ops == [("fsync", tmp), ("replace", f"{tmp} -> {acked}"), ("fsync", str(tmp_path))]
    s.close()


def test_the_default_bound_is_one_value_everywhere() -> None:
    from gpupipe.commands.cli import build_parser

    args = build_parser().parse_args(["produce", "--source", "nvml"])
    assert args.spool_max_bytes == DEFAULT_SPOOL_MAX_BYTES == DEFAULT_MAX_BYTES


def test_the_streamed_scan_finds_what_the_whole_file_scan_finds() -> None:
    # Records, damage and torn tails across window edges: a 7-byte window sees every boundary.
    rng = random.Random(3)
    for _ in range(200):
        parts = []
        for i in range(rng.randint(0, 6)):
            rec = encode_record(i + 1, b"k%d" % i, rng.randbytes(rng.randint(0, 40)))
            roll = rng.random()
            if roll < 0.15:
                rec = rec[: rng.randint(1, len(rec) - 1)]
            elif roll < 0.3:
                b = bytearray(rec)
                b[rng.randrange(len(b))] ^= 0xFF
                rec = bytes(b)
            elif roll < 0.4:
                rec = rng.randbytes(rng.randint(1, 9)) + MAGIC[: rng.randint(0, 4)] + rec
            parts.append(rec)
        data = b"".join(parts)
        whole = scan_records(data)
        streamed = Scanner(lambda pos, n, d=data: d[pos : pos + n], len(data), chunk=7)
        records = list(streamed)
        assert (records, streamed.damaged, streamed.torn) == (whole.records, whole.damaged, whole.torn)
