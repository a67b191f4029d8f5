"""The previous release as its users installed it: its wheel, built from git history, in a venv of its own.

Contract: :func:`previous_release` returns a :class:`Release` whose ``gpupipe`` argv runs that version's
CLI (``python -m gpupipe`` of the old wheel), and whose ``tree`` is the release's source tree (its own
tests' doubles live there). The wheel is built from the commit that released it (``git archive``, no
network), installed without dependencies into a venv that reads the current venv's site-packages
for them through a ``.pth`` line: the old release's lower bounds are below ours, and
`gpupipe`'s import name is the same in both, so the two must never share one environment.
Built once per machine under ``~/.cache/gpupipe/previous-release/`` (keyed by commit and Python).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO

# 0.1.0, released 2026-11-30: the commit "CHANGELOG for 0.1.0" (CHANGELOG.md names the version).
PREVIOUS_VERSION = "0.1.0"
PREVIOUS_COMMIT = "07aeaf82741ccf671c9f520fd32fc195ac9fe723"
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpupipe" / "previous-release"


@dataclass(frozen=True)
class Release:
    version: str
    python: Path  # the release venv's interpreter
    tree: Path  # the release's source tree (git archive of its commit)

    @property
    def gpupipe(self) -> list[str]:
        # -P: the current directory (often this repository, whose `gpupipe` is the new one) stays off
        # sys.path. Run it with an environment from :meth:`env` (no PYTHONPATH) for the same reason.
        return [str(self.python), "-P", "-m", "gpupipe"]

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **extra}


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited {done.returncode}: {done.stderr[-2000:]}")


def previous_release(commit: str = PREVIOUS_COMMIT, version: str = PREVIOUS_VERSION) -> Release:
    """The release of ``commit`` installed in its own venv (built on first use, then reused)."""
    tag = f"{version}-{commit[:12]}-py{sys.version_info.major}{sys.version_info.minor}"
    root = _CACHE / tag
    tree, venv = root / "tree", root / "venv"
    python = venv / "bin" / "python"
    if not (root / ".complete").exists():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            staging = Path(tmp)
            (staging / "tree").mkdir()
            src = staging / "src.tar"
            _run(["git", "-C", str(REPO), "archive", "-o", str(src), commit])  # a shallow clone lacks it
            _run(["tar", "-x", "-f", str(src), "-C", str(staging / "tree")])
            wheels = staging / "wheels"
            pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
            _run(
                [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(staging / "tree")]
            )
            _run([sys.executable, "-m", "venv", "--without-pip", str(staging / "venv")])
            wheel = next(wheels.glob(f"gpupipe-{version}-*.whl"))
            site = _site_packages(staging / "venv")
            _run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)])
            for old in (tree, venv):
                if old.exists():
                    subprocess.run(["rm", "-rf", str(old)], check=True)
            (staging / "tree").rename(tree)
            (staging / "venv").rename(venv)
        (root / ".complete").write_text(commit + "\n")
    # Each run points the release at this run's dependencies (the current venv may have moved).
    (_site_packages(venv) / "gpupipe-current-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return Release(version=version, python=python, tree=tree)


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
