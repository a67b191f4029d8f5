"""pyproject.toml installs every package of the design's folders, under names that are ours alone."""

import tomllib

from tests.paths import REPO

#: folder in the repository -> the name it is installed as
INSTALLED_AS = {
    "gpupipe": "gpupipe",
    "producer": "gpupipe_producer",
    "consumers": "gpupipe_consumers",
    "schemas": "gpupipe_schemas",
}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_each_design_folder_installs_under_a_gpupipe_name() -> None:
    assert _setuptools()["package-dir"] == {name: folder for folder, name in INSTALLED_AS.items()}


def test_every_folder_with_python_files_or_schemas_is_a_listed_package() -> None:
    found = set()
    for folder, name in INSTALLED_AS.items():
        for d in [REPO / folder, *(p for p in (REPO / folder).rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts:
                continue
            if any(d.glob("*.py")) or any(d.glob("*.avsc")):
                rel = d.relative_to(REPO / folder).parts
                found.add(".".join((name, *rel)))
    assert found == set(_setuptools()["packages"])


def test_the_import_contracts_and_entry_points_name_installed_modules_only() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert set(doc["tool"]["importlinter"]["root_packages"]) == set(INSTALLED_AS.values())
    for target in doc["project"]["entry-points"]["gpupipe.commands"].values():
        assert target.split(".", 1)[0] in INSTALLED_AS.values(), target


def test_no_code_imports_a_folder_by_its_repository_name() -> None:
    """`import producer` works in a source checkout only (the repository root is on the path), and
    would break in the installed wheel: code imports the installed names."""
    import re
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    folder = re.compile(r"^\s*(from|import) (producer|consumers|schemas)\b", re.M)
    offenders = [f for f in files if folder.search((REPO / f).read_text(encoding="utf-8"))]
    assert offenders == []
