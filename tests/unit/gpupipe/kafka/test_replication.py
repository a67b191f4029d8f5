"""The copies of the topics the services create: one choice, from the flag or from the cluster."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import replication as topic_replication
from gpupipe.kafka.replication import Replication
from gpupipe.lifecycle import service_flags


@pytest.fixture(autouse=True)
def _auto() -> Iterator[None]:
    yield
    topic_replication.configure(topic_replication.AUTO)  # the CLI sets a process-wide choice


@pytest.mark.parametrize(
    ("brokers", "want"), [(0, Replication(1, 1)), (1, Replication(1, 1)), (2, Replication(1, 1)),
                          (3, Replication(3, 2)), (5, Replication(3, 2))]
)  # fmt: skip
def test_auto_follows_the_brokers_alive(brokers: int, want: Replication) -> None:
    assert topic_replication.for_cluster(brokers) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [("auto", None), (" AUTO ", None), ("3", Replication(3, 2)), ("3:3", Replication(3, 3)),
     ("2", Replication(2, 1)), ("1", Replication(1, 1)), ("5", Replication(5, 2))],
)  # fmt: skip
def test_parse(text: str, want: Replication | None) -> None:
    assert topic_replication.parse(text) == want


@pytest.mark.parametrize("text", ["three", "3:", "0", "3:4", "3:0", "-1", ""])
def test_a_bad_value_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="--topic-replication"):
        topic_replication.parse(text)


def test_a_chosen_value_wins_over_the_cluster() -> None:
    topic_replication.configure("3:2")
    assert topic_replication.for_cluster(1) == Replication(3, 2)
    assert topic_replication.for_cluster(1, Replication(1, 1)) == Replication(1, 1)  # a caller's own
    topic_replication.configure("auto")
    assert topic_replication.for_cluster(1) == Replication(1, 1)


def test_every_service_that_creates_topics_has_the_flag() -> None:
    ref = argparse.ArgumentParser()
    service_flags.add_create_topics(ref)
    want = next(a for a in ref._actions if "--topic-replication" in a.option_strings)
    seen = 0
    stack = [cli.build_parser()]
    while stack:
        parser = stack.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += action.choices.values()
        if any("--create-topics" in a.option_strings for a in parser._actions):
            got = next(a for a in parser._actions if "--topic-replication" in a.option_strings)
            assert (got.default, got.help) == (want.default, want.help)
            seen += 1
    assert seen >= 7


def test_a_bad_flag_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["produce", "--source", "simulated", "--topic-replication", "3:5", "--duration", "1s"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("gpupipe produce: error: --topic-replication '3:5'") and err.count("\n") == 1
