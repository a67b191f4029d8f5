"""The shipped kernel-log relay as a process, for tests: the DaemonSet's ``kmsg-relay`` command with
the device and socket paths a test gives (a file of raw records stands in for ``/dev/kmsg`` where a
test must write kernel records)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests import hygiene

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "deploy" / "kubernetes" / "producer-daemonset.yaml"


def shipped_relay_command(device: str, sock: str) -> list[str]:
    """The manifest's relay command, its program from this environment, the two paths replaced."""
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "DaemonSet"]
    pod = doc["spec"]["template"]["spec"]
    (relay,) = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "kmsg-relay"]
    program, *flags = relay["command"]
    paths = {"--device": device, "--socket": sock}
    out = [str(Path(sys.executable).parent / program)]
    for flag in flags:
        name = flag.split("=", 1)[0]
        out.append(f"{name}={paths[name]}" if name in paths else flag)
    return out


class RelayProcess:
    """``flags`` follow the shipped ones (so they override them); ``log`` takes the relay's stderr."""

    def __init__(self, device: Path | str, sock: Path, *flags: str, log: Path | None = None) -> None:
        self.device, self.sock, self.flags, self.log = str(device), sock, flags, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RelayProcess:
        cmd = shipped_relay_command(self.device, str(self.sock)) + list(self.flags)
        if self.log is None:
            self.proc = proc = hygiene.popen(cmd)
        else:
            with self.log.open("ab") as err:
                self.proc = proc = hygiene.popen(cmd, stderr=err)
        end = time.monotonic() + 20
        while not self.sock.is_socket():
            if proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"the relay did not listen on {self.sock} (exit {proc.poll()})")
            time.sleep(0.02)
        return self

    def peak_rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise LookupError("VmHWM")

    def stop(self) -> int:
        assert self.proc is not None
        return hygiene.stop_group(self.proc)
