"""Refuse a compose file whose Kafka writes its data outside its volume (`make compose-check`).

`docker-compose config` accepts a Kafka service whose volume is mounted at /var/lib/kafka/data while
the broker writes to its image's default log directory (apache/kafka: /tmp/kraft-combined-logs):
the file is valid, and recreating the container empties every topic. For each Kafka service (an
apache/kafka image, or KAFKA_PROCESS_ROLES set) this check requires KAFKA_LOG_DIRS and each of its
directories to lie in a writable volume of that service.

    python scripts/compose_kafka_data.py [docker-compose.yml]   # exit 1 and one line per problem
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

import yaml


def _environment(svc: Mapping[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, Mapping):
        return {str(k): "" if v is None else str(v) for k, v in env.items()}
    return {k: v for k, _, v in (str(item).partition("=") for item in env)}


def _mounts(svc: Mapping[str, Any]) -> list[PurePosixPath]:
    """Container paths of the service's writable volumes and binds."""
    out = []
    for vol in svc.get("volumes") or []:
        if isinstance(vol, Mapping):
            target, read_only = vol.get("target"), bool(vol.get("read_only"))
        else:
            parts = str(vol).split(":")
            target = parts[1] if len(parts) > 1 else parts[0]
            read_only = len(parts) > 2 and "ro" in parts[2].split(",")
        if target and not read_only:
            out.append(PurePosixPath(str(target)))
    return out


def problems(doc: Mapping[str, Any]) -> list[str]:
    """One line per Kafka service whose log directories are not all in one of its volumes."""
    out = []
    for name, svc in (doc.get("services") or {}).items():
        svc = svc or {}
        env = _environment(svc)
        if not (str(svc.get("image", "")).startswith("apache/kafka") or "KAFKA_PROCESS_ROLES" in env):
            continue
        dirs = [d.strip() for d in env.get("KAFKA_LOG_DIRS", "").split(",") if d.strip()]
        mounts = _mounts(svc)
        if not dirs:
            out.append(f"{name}: KAFKA_LOG_DIRS is not set, so Kafka writes outside its volumes")
        for d in dirs:
            if not any(PurePosixPath(d).is_relative_to(m) for m in mounts):
                where = ", ".join(map(str, mounts)) or "none"
                out.append(f"{name}: KAFKA_LOG_DIRS {d} is in none of its writable volumes ({where})")
    return out


def main(argv: list[str]) -> int:
    path = argv[0] if argv else "docker-compose.yml"
    with open(path, encoding="utf-8") as f:
        lines = problems(yaml.safe_load(f) or {})
    for line in lines:
        print(f"compose-check: {path}: {line}", file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
