"""Run mypy over the project's packages under their installed names (`make typecheck`).

The folders install under other names (pyproject: tool.setuptools.package-dir) through an editable
install's import hook, which mypy cannot follow. This links each renamed folder under its installed
name in .run/mypy-path (the mypy_path of tool.mypy), then runs mypy with the arguments given and
prints how long it took.
"""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def link_packages(root: Path = ROOT) -> Path:
    """``.run/mypy-path/<installed name>`` -> ``<folder>`` for each renamed folder; returns the dir."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    links = root / config["tool"]["mypy"]["mypy_path"]
    links.mkdir(parents=True, exist_ok=True)
    for name, folder in config["tool"]["setuptools"]["package-dir"].items():
        if name == folder:
            continue  # found where it is
        link = links / name
        target = Path("../..") / folder
        if not link.is_symlink() or link.readlink() != target:
            link.unlink(missing_ok=True)
            link.symlink_to(target, target_is_directory=True)
    return links


def main(argv: list[str]) -> int:
    link_packages()
    start = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "mypy", *argv], cwd=ROOT)
    print(f"typecheck: mypy took {time.monotonic() - start:.1f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
