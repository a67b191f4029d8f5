"""Parse kernel-log lines (dmesg, journalctl -k, syslog, /dev/kmsg) from stdin into XID JSON lines.

One JSON object per Xid/SXid on stdout with the keys kind, xid, pci_bus_id, pid,
process_name, message, gpu_instance_id, compute_instance_id. Lines that are not
XIDs print nothing; the command never fails on its input.
"""

from __future__ import annotations

import argparse
import sys

from gpupipe_producer.xid.parse_cli import run_xid_parse

USES_KAFKA = False


#: One line for `gpupipe --help`.
HELP = "parse kernel-log lines on stdin into XID JSON lines"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "example: dmesg | gpupipe xid parse"


def run(args: argparse.Namespace) -> int:
    return run_xid_parse(sys.stdin, sys.stdout, sys.stderr)
