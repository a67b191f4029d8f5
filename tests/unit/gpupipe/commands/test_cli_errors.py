"""One-line errors name the subcommand, and a reader that closes the pipe early gets no traceback.

`gpupipe: error: unrecognized arguments: ...` left the reader guessing which command's `--help` to
read; every error line now starts `gpupipe <command>: error:`. `gpupipe tail ... | head` once ended
in a BrokenPipeError traceback; it now stops quietly with the status a shell gives a tool that
SIGPIPE ended (141), as `cat` or `grep` do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError, GpupipeError
from gpupipe_producer.xid import parse_command
from tests.paths import REPO

REPO = REPO


def test_unknown_argument_is_reported_by_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["metrics", "-collectors", "/etc/x.csv"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "gpupipe metrics: error: unrecognized arguments: /etc/x.csv (see --help)\n"
    )


def test_unknown_argument_of_a_two_word_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["report", "idle", "--bogus"])
    assert capsys.readouterr().err.startswith("gpupipe report idle: error: unrecognized arguments: --bogus")


def test_config_error_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["produce", "--source", "simulated", "--nodes", "0", "--bootstrap-servers", "127.0.0.1:9"])
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        "gpupipe produce: error: --nodes and --gpus-per-node must be at least 1"
    ]


@pytest.mark.parametrize(("error", "rc"), [(ConfigError("bad"), 2), (GpupipeError("bad"), 1)])
def test_errors_raised_by_a_command_name_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], error: Exception, rc: int
) -> None:
    def fail(_: object) -> int:
        raise error

    monkeypatch.setattr(parse_command, "run", fail)
    assert cli.main(["xid", "parse"]) == rc
    assert capsys.readouterr().err == "gpupipe xid parse: error: bad\n"


def _run_into_closed_pipe(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """Run gpupipe with stdout a real pipe whose reader has already gone (as `| head` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "gpupipe", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=REPO,
            timeout=60,
        )
    finally:
        os.close(write_end)


def test_closed_pipe_ends_quietly_with_the_sigpipe_status() -> None:
    res = _run_into_closed_pipe("acls", "--print")
    assert res.stderr.decode() == ""
    assert res.returncode == cli.EXIT_BROKEN_PIPE == 141


def test_a_broken_pipe_that_is_not_stdout_is_still_a_fault(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")  # e.g. a socket to some server, stdout still fine

    monkeypatch.setattr(parse_command, "run", fail)
    monkeypatch.setattr(cli, "_stdout_reader_gone", lambda: False)
    with pytest.raises(BrokenPipeError):
        cli.main(["xid", "parse"])
