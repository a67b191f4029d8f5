"""Refuse a compose file that publishes one host port twice (`make compose-check`).

`docker-compose config` accepts two services that both publish host port 9404: the file is valid,
only `docker compose up` fails, when the second container cannot bind. This check reads every
service's `ports` (short "HOST:CONTAINER", "IP:HOST:CONTAINER", ranges, "/udp", or the long form)
and names each host port that more than one of them publishes.

    python scripts/compose_ports.py [docker-compose.yml]   # exit 1 and one line per clash
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")


def _port_range(text: str) -> list[int]:
    lo, _, hi = str(text).partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def published(entry: Any) -> Iterator[tuple[str, int, str]]:
    """(host address, host port, protocol) of one `ports` entry; none for a container-only port."""
    if isinstance(entry, Mapping):
        if entry.get("published") in (None, ""):
            return
        ip, proto = str(entry.get("host_ip", "")), str(entry.get("protocol", "tcp"))
        for port in _port_range(str(entry["published"])):
            yield ip, port, proto
        return
    text, _, proto = str(entry).partition("/")
    parts = text.rsplit(":", 2)
    if len(parts) == 1:
        return  # "9400": the container port only, the host picks a free one
    ip = parts[0] if len(parts) == 3 else ""
    host = parts[-2]
    if not host:
        return  # "127.0.0.1::9400": an ephemeral host port
    for port in _port_range(host):
        yield ip, port, proto or "tcp"


def clashes(doc: Mapping[str, Any]) -> list[str]:
    """One line per host port that two services (or one service twice) publish."""
    seen: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for name, svc in (doc.get("services") or {}).items():
        for entry in (svc or {}).get("ports") or []:
            for ip, port, proto in published(entry):
                seen.setdefault((port, proto), []).append((name, ip))
    out = []
    for (port, proto), users in sorted(seen.items()):
        clash = any(
            a_ip == b_ip or a_ip in ANY_ADDRESS or b_ip in ANY_ADDRESS
            for i, (_, a_ip) in enumerate(users)
            for _, b_ip in users[i + 1 :]
        )
        if clash:
            names = ", ".join(name for name, _ in users)
            out.append(f"host port {port}/{proto} is published by more than one service: {names}")
    return out


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docker-compose.yml")
    lines = clashes(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    for line in lines:
        print(f"compose-check: {path}: {line}", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
