"""Catalog properties on the command line: every secret a pyiceberg catalog takes is refused on
argv (visible to every user in `ps`), with the file or environment named instead."""

from __future__ import annotations

import argparse

import pytest

from gpupipe_consumers.lake import catalog as lake_catalog


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpupipe lake write")
    lake_catalog.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "prop",
    [
        "header.Authorization=Bearer SECRET-ARGV",  # pyiceberg's REST catalog sends header.* as HTTP headers
        "header.X-Api-Key=SECRET-ARGV",  # any header: a custom one carries a key as often as not
        "credential=id:SECRET-ARGV",
        "token=SECRET-ARGV",
        "s3.secret-access-key=SECRET-ARGV",
        "s3.session-token=SECRET-ARGV",
        "adls.account-key=SECRET-ARGV",
        "adls.connection-string=DefaultEndpointsProtocol=https;AccountKey=SECRET-ARGV",
        "client.password=SECRET-ARGV",
    ],
)
def test_a_secret_catalog_property_on_argv_is_refused_in_one_line(
    prop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse("--catalog-property", prop)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]  # after a plain parser's usage
    assert "--catalog-properties-file" in line and "PYICEBERG_CATALOG__" in line
    assert "SECRET-ARGV" not in line, "the refusal does not echo the secret"


def test_plain_properties_pass(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(
        "--catalog-property",
        "type=rest",
        "--catalog-property",
        "s3.access-key-id=AKIA",
        "--catalog-property",
        "s3.endpoint=https://s3.example",
    )
    assert args.catalog_property == ["type=rest", "s3.access-key-id=AKIA", "s3.endpoint=https://s3.example"]
