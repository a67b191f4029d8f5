"""Read a YAML configuration file the operator wrote: every way it can be wrong is one line.

The team map, the price tables, the carbon config and the web config are all read here, so a file
that cannot be read, is not UTF-8 or is not YAML gets the same kind of message everywhere: the file,
what it is meant to be, and where it broke, as a :class:`ConfigError` (exit 2, no traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import read_text

__all__ = ["load_yaml"]


def _where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_yaml(path: str | Path, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """The document of ``path`` (``what`` names it in errors, e.g. "price table"); raises ``error``."""
    text = read_text(path, what, error)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {_where(exc)}") from exc
