"""Which GPU losses this boot were already reported, so a restarted agent does not report them again.

Keyed by (boot id, GPU UUID or bus id) in ``lost-reported`` next to the spool; a file it cannot read
or write means report (at least once rather than never). Why: docs/producer.md.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpupipe_producer.nvml.records import LostGpu

log = logging.getLogger("gpupipe.agent")

FILE = "lost-reported"


class LostReported:
    def __init__(self, directory: str | Path, boot_id: str | None) -> None:
        self.path = Path(directory) / FILE
        self.boot_id = boot_id
        try:
            lines = self.path.read_text().splitlines()
        except OSError:
            lines = []
        self._keys = {ln for ln in lines if boot_id and ln.startswith(boot_id + " ")}

    def _key(self, lost: LostGpu) -> str | None:
        ident = lost.gpu.uuid or lost.gpu.pci_bus_id or f"index{lost.gpu.gpu_index}"
        return f"{self.boot_id} {ident}" if self.boot_id and ident else None

    def should_report(self, lost: LostGpu) -> bool:
        """False only for a loss found at start that this boot already reported."""
        key = self._key(lost)
        return not (lost.call == "start" and key is not None and key in self._keys)

    def record(self, lost: LostGpu) -> None:
        key = self._key(lost)
        if key is None or key in self._keys:
            return
        self._keys.add(key)
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(k + "\n" for k in sorted(self._keys)))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.debug("cannot record a reported GPU loss: %s", exc)
