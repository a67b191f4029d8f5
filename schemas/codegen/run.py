"""Run the emitters over the schema files: write their outputs, or name those that differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The schema folder (`schemas/`) and the repository root above it: emitters write repo-relative.
SCHEMAS = Path(__file__).resolve().parents[1]
ROOT = SCHEMAS.parent
REGENERATE = ".venv/bin/python -m gpupipe_schemas.codegen"


def load_schemas(folder: Path = SCHEMAS) -> list[dict[str, Any]]:
    """Every current schema file, parsed, in file-name order (released copies excluded)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.avsc"))]


def render(schemas: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """Every emitter's files: repo-relative path -> text."""
    from gpupipe_schemas.codegen import EMITTERS

    loaded = load_schemas() if schemas is None else schemas
    out: dict[str, str] = {}
    for emitter in EMITTERS:
        for path, text in emitter.outputs(loaded).items():
            if path in out:
                raise ValueError(f"two emitters write {path}")
            out[path] = text
    return out


def stale(root: Path = ROOT) -> list[str]:
    """The generated files under ``root`` that are missing or differ from what the emitters give."""
    out = []
    for path, text in render().items():
        target = root / path
        if not target.is_file() or target.read_text() != text:
            out.append(path)
    return out


def write(root: Path = ROOT) -> list[str]:
    """Write the files that changed; returns their paths."""
    changed = stale(root)
    files = render()
    for path in changed:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(files[path])
    return changed
