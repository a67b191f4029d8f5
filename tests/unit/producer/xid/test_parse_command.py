"""`gpupipe xid parse` through the real CLI entry point, on the shared corpus of real kernel-log lines."""

import json
import subprocess
import sys

from tests.paths import TESTS

# Copies of the shared corpus, sources named in tests/fixtures/reference/README.md.
REF = TESTS / "fixtures" / "reference"


def _run(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpupipe", "xid", "parse"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_corpus_lines_parse_and_non_xid_lines_do_not() -> None:
    corpus = (REF / "xid-kmsg-corpus-from-repos.txt").read_text()
    xid_lines = [ln for ln in corpus.splitlines() if ("Xid" in ln) and not ln.startswith("#")]
    out = _run(corpus)
    assert out.returncode == 0, out.stderr
    objs = [json.loads(x) for x in out.stdout.splitlines()]
    assert len(objs) >= len([ln for ln in xid_lines if "NVRM: Xid" in ln or "SXid" in ln])
    for o in objs:
        assert list(o) == [
            "kind",
            "xid",
            "pci_bus_id",
            "pid",
            "process_name",
            "message",
            "gpu_instance_id",
            "compute_instance_id",
        ]
        assert o["kind"] in ("xid", "sxid") and isinstance(o["xid"], int)
    non = _run((REF / "non-xid-kmsg-from-repos.txt").read_text())
    assert non.returncode == 0 and non.stdout == ""


def test_exact_output_for_one_line() -> None:
    line = (
        "[ 4123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n"
    )
    out = _run(line)
    assert json.loads(out.stdout) == {
        "kind": "xid",
        "xid": 79,
        "pci_bus_id": "0000:3b:00",
        "pid": 1234,
        "process_name": "python3",
        "message": "GPU has fallen off the bus.",
        "gpu_instance_id": None,
        "compute_instance_id": None,
    }


def test_garbage_input_does_not_crash() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "gpupipe", "xid", "parse"],
        input=b"\x00\xff\xfe garbage\n" * 100,
        capture_output=True,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout == b""
