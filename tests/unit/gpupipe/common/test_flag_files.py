"""Every file-taking flag of every command: a bad file is one line on stderr and exit 2, no traceback.

A non-UTF-8 or binary file given to `--kafka-config-file` (every Kafka command),
`--kafka-config sasl.password.file=...` or `metrics --collectors` ended in a UnicodeDecodeError
traceback. The flags are found in the CLI's own parsers, by the convention gpupipe.common.flag_files states
(metavar FILE or PATH, or a name ending in -file), so a new flag is swept without editing this test;
FILE_FLAGS below must equal what is found, so a flag that stops being checked is noticed as well.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import MAX_BYTES, check_file_flags, is_file_flag, read_text

#: (command words, flag) of every flag that names a file the command reads.
FILE_FLAGS = {
    ("acls", "--kafka-config-file"),
    ("alerts", "--node-ca-file"),
    ("chargeback", "--node-ca-file"),
    ("metrics", "--node-ca-file"),
    ("recommend", "--node-ca-file"),
    ("alerts", "--kube-token-file"),
    ("alerts", "--kube-ca-file"),
    ("alerts", "--kafka-config-file"),
    ("alerts", "--web-config-file"),
    ("chargeback", "--prices"),
    ("chargeback", "--teams"),
    ("chargeback", "--kafka-config-file"),
    ("chargeback", "--web-config-file"),
    ("lake maintain", "--catalog-properties-file"),
    ("lake query", "--catalog-properties-file"),
    ("lake write", "--catalog-properties-file"),
    ("lake write", "--kafka-config-file"),
    ("lake write", "--web-config-file"),
    ("metrics", "--collectors"),
    ("metrics", "--web-config-file"),
    ("metrics", "--kafka-config-file"),
    ("otlp", "--otlp-headers-file"),
    ("otlp", "--otlp-ca-file"),
    ("otlp", "--otlp-cert-file"),
    ("otlp", "--otlp-key-file"),
    ("otlp", "--kafka-config-file"),
    ("otlp", "--web-config-file"),
    ("produce", "--node-cert"),
    ("produce", "--node-key"),
    ("produce", "--kube-token-file"),
    ("produce", "--kube-ca-file"),
    ("produce", "--kafka-config-file"),
    ("produce", "--web-config-file"),
    ("recommend", "--prices"),
    ("recommend", "--teams"),
    ("recommend", "--kafka-config-file"),
    ("recommend", "--web-config-file"),
    ("report chargeback", "--carbon"),
    ("report chargeback", "--teams"),
    ("report chargeback", "--kafka-config-file"),
    ("report idle", "--teams"),
    ("report idle", "--kafka-config-file"),
    ("tail", "--kafka-config-file"),
}

#: Flags that name a path but not a file read as configuration, and why they are not swept.
NOT_FILES = {
    "--nvml-release-file": "its existence is the value; it is never read",
    "--kmsg-path": "a kernel-log stream the producer follows (a device, a socket, a file or stdin)",
    "--kubelet-socket": "a unix socket",
    "--spool-dir": "a directory the producer writes",
    "--pod-logs-dir": "a directory",
    "--hpc-job-mapping-dir": "a directory of job files, read per file as they come and go",
    "--warehouse": "a folder or URI the lake writes",
}


def _walk(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*words, name))
    if words:
        yield words, parser


def _commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [
        (w, p)
        for w, p in _walk(cli.build_parser())
        if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
    ]


def _long(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def _needed(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """What the command needs besides the flag under test: its positionals, and the first choice of
    a required one-of group (`acls --print`)."""
    out = ["x" for a in parser._actions if not a.option_strings and a.nargs is None]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            out.insert(0, group._group_actions[0].option_strings[-1])
    return tuple(out)


def _found() -> dict[tuple[str, str], tuple[str, ...]]:
    """(command, flag) -> the positionals the command needs, for every file flag the parsers declare."""
    out = {}
    for words, parser in _commands():
        positionals = _needed(parser)
        for action in parser._actions:
            if is_file_flag(action):
                out[(" ".join(words), _long(action))] = positionals
    return out


def _kafka_commands() -> list[tuple[str, tuple[str, ...]]]:
    return sorted(
        (" ".join(w), _needed(p))
        for w, p in _commands()
        if any("--kafka-config" in a.option_strings for a in p._actions)
    )


def _bad(tmp_path: Path, case: str) -> Path:
    if case == "non-utf8":
        (tmp_path / "latin1").write_bytes(b"# caf\xe9\nkey=value\n")
        return tmp_path / "latin1"
    if case == "binary":
        (tmp_path / "binary").write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + bytes(range(256)))
        return tmp_path / "binary"
    if case == "directory":
        return tmp_path
    return tmp_path / "missing"


CASES = ["non-utf8", "binary", "directory", "missing"]


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    return rc, err.splitlines()


@pytest.fixture(autouse=True)
def _no_gpupipe_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("GPUPIPE_")]:
        monkeypatch.delenv(name)


def test_the_file_flags_found_in_the_parsers_are_the_ones_listed() -> None:
    found = set(_found())
    assert found == FILE_FLAGS, {"not listed": found - FILE_FLAGS, "no longer found": FILE_FLAGS - found}
    # Every other flag that names a path is one on purpose (a stream, a socket, a directory); the
    # dcgm-exporter flags that metrics accepts and ignores (hidden from --help) are never opened.
    for words, parser in _commands():
        for a in parser._actions:
            text = f"{a.metavar or ''} {a.dest}".lower()
            named_path = a.type is None and any(w in text for w in ("file", "path", "dir"))
            if a.option_strings and a.help is not argparse.SUPPRESS and not is_file_flag(a) and named_path:
                assert _long(a) in NOT_FILES, (words, a.option_strings)


@pytest.mark.parametrize("case", CASES)
def test_every_file_flag_refuses_a_bad_file_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _bad(tmp_path, case)
    for (command, flag), positionals in sorted(_found().items()):
        rc, lines = _run_main([*command.split(), *positionals, flag, str(bad)], capsys)
        assert rc == 2 and len(lines) == 1, (command, flag, lines)
        assert str(bad) in lines[0] and "Traceback" not in lines[0], lines


@pytest.mark.parametrize("case", CASES)
def test_a_kafka_setting_read_from_a_file_refuses_a_bad_file_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _bad(tmp_path, case)
    for command, positionals in _kafka_commands():
        argv = [*command.split(), *positionals, "--kafka-config", f"sasl.password.file={bad}"]
        rc, lines = _run_main(argv, capsys)
        assert rc == 2 and len(lines) == 1, (command, lines)
        assert f"sasl.password.file {bad}" in lines[0], lines


def test_the_real_entry_point_prints_one_line_for_a_latin1_file(tmp_path: Path) -> None:
    """Through `python -m gpupipe`, a flag and a GPUPIPE_* variable naming a file."""
    bad = _bad(tmp_path, "non-utf8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPIPE_")}
    runs = [
        (["metrics", "--collectors", str(bad)], env),
        (["tail", "x"], {**env, "GPUPIPE_KAFKA_CONFIG_FILE": str(bad)}),
        (["tail", "x"], {**env, "GPUPIPE_KAFKA_SASL_PASSWORD_FILE": str(bad)}),
    ]
    for argv, run_env in runs:
        res = subprocess.run(
            [sys.executable, "-m", "gpupipe", *argv], env=run_env, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 2, res.stderr
        (line,) = res.stderr.splitlines()
        assert "is not UTF-8 text (byte 0xe9 on line 1)" in line, line


def test_a_file_larger_than_the_bound_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(MAX_BYTES + 1)
    with pytest.raises(ConfigError, match=r"price table .*big is larger than 16 MiB"):
        read_text(big, "price table")


def test_a_repeatable_file_flag_has_each_of_its_files_checked(tmp_path: Path) -> None:
    """The convention holds for a flag given several times (none is declared so today)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rules-file", action="append", default=[])
    good = tmp_path / "good"
    good.write_text("ok\n")
    args = parser.parse_args(["--rules-file", str(good), "--rules-file", str(_bad(tmp_path, "binary"))])
    with pytest.raises(ConfigError, match=r"--rules-file .*binary is not UTF-8 text"):
        check_file_flags(parser, args)
