"""Every YAML file an operator writes fails the same way: one line naming the file and the place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpupipe.common.errors import ConfigError
from gpupipe.domain.price_schedule import load_price_schedule
from gpupipe.domain.prices import load_price_table
from gpupipe.domain.teams import load_team_map
from gpupipe.web.config import load_web_config
from gpupipe_consumers.report.carbon import load_carbon_config

LOADERS: dict[str, Callable[[Path], Any]] = {
    "team mapping": load_team_map,
    "price table": load_price_table,
    "price schedule": load_price_schedule,
    "carbon config": load_carbon_config,
    "web config": load_web_config,
}


def _error(load: Callable[[Path], Any], path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_file_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path: Path, name: str) -> None:
    path = tmp_path / "file.yaml"
    path.write_bytes(b"# ok\ncurrency: \xe9uro\n")
    assert "not UTF-8 text (byte 0xe9 on line 2)" in _error(LOADERS[name], path)


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_broken_yaml_is_one_line_with_its_line_and_column(tmp_path: Path, name: str) -> None:
    path = tmp_path / "file.yaml"
    path.write_text("a: 1\nb: [unclosed\nc: 3\n")
    message = _error(LOADERS[name], path)
    assert "is not valid YAML: line " in message and "column" in message


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_missing_file_says_so(tmp_path: Path, name: str) -> None:
    assert "No such file or directory" in _error(LOADERS[name], tmp_path / "absent.yaml")
