"""scripts/typecheck.py: mypy finds the renamed folders under their installed names."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from tests.paths import REPO

_spec = importlib.util.spec_from_file_location("typecheck", REPO / "scripts" / "typecheck.py")
assert _spec is not None and _spec.loader is not None
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)


def test_links_each_renamed_folder_under_its_installed_name(tmp_path: Path) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("producer", "consumers", "schemas", "gpupipe"):
        (tmp_path / folder).mkdir()
    links = typecheck.link_packages(tmp_path)
    assert links == tmp_path / ".run" / "mypy-path"
    assert sorted(p.name for p in links.iterdir()) == [
        "gpupipe_consumers",
        "gpupipe_producer",
        "gpupipe_schemas",
    ]
    assert (links / "gpupipe_producer").resolve() == (tmp_path / "producer").resolve()
    (links / "gpupipe_schemas").unlink()
    (links / "gpupipe_schemas").symlink_to(tmp_path / "producer")  # a stale link is replaced
    typecheck.link_packages(tmp_path)
    assert (links / "gpupipe_schemas").resolve() == (tmp_path / "schemas").resolve()
