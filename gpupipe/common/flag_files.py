"""Read a file that a flag (or a `KEY.file=` setting, or a file a config file names) points to.

Contract: :func:`read_bytes` and :func:`read_text` return the file's contents or raise
:class:`ConfigError` with one line that names the file and what it is meant to be, for every way a
path can fail: missing, a directory, no permission, another ``OSError``, larger than
:data:`MAX_BYTES`, and (text) bytes that are not UTF-8. The CLI turns that into exit 2, never a
traceback.

:func:`check_file_flags` reads, through the same reader, every file that the parsed flags name, as
the CLI's first step after parsing: a bad path stops a service before it connects to anything (a
``GPUPIPE_*`` variable naming the file is checked as the flag is), and the command's own read later
meets a file known to be text. A file-taking flag is one whose metavar is FILE or PATH or
whose name ends in ``-file``: a new flag that follows the convention is checked without more code.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpupipe.common.errors import ConfigError

__all__ = ["MAX_BYTES", "check_file_flags", "is_file_flag", "read_bytes", "read_text"]

#: The largest file a flag may name: config files, certificates and tables are kilobytes; the bound
#: keeps `--teams /dev/zero` (or a log given by mistake) from filling memory.
MAX_BYTES = 16 * 1024 * 1024

FILE_METAVARS = frozenset({"FILE", "PATH"})
#: Flags whose file is never read, only looked for (its existence is the value).
NOT_READ = frozenset({"nvml_release_file"})


def read_bytes(path: str | Path, what: str, error: type[ConfigError] = ConfigError) -> bytes:
    """The bytes of ``path`` (``what`` names it in errors, e.g. "price table"); raises ``error``."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_BYTES:
        raise error(f"{what} {path} is larger than {MAX_BYTES // (1024 * 1024)} MiB")
    return raw


def read_text(path: str | Path, what: str, error: type[ConfigError] = ConfigError) -> str:
    """The UTF-8 text of ``path``; a byte that is not UTF-8 is named with its line."""
    raw = read_bytes(path, what, error)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise error(f"{what} {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})") from exc


def is_file_flag(action: argparse.Action) -> bool:
    """Whether a flag names a file the command reads (see the module doc for the convention)."""
    if not action.option_strings or action.dest in NOT_READ or action.nargs == 0:
        return False
    return action.metavar in FILE_METAVARS or action.dest.endswith("_file")


def check_file_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Read once every file that a file-taking flag of ``parser`` names in ``args`` (see module doc)."""
    for action in parser._actions:
        if not is_file_flag(action):
            continue
        value = getattr(args, action.dest, None)
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        for path in value if isinstance(value, list | tuple) else [value]:
            if isinstance(path, str) and path:  # '' is "none" for the flags that accept it
                read_text(path, flag)
