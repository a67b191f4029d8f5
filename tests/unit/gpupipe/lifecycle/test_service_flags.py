"""The flags every service shares come from one declaration (gpupipe.lifecycle.service_flags)."""

import argparse

from gpupipe.commands.cli import build_parser
from gpupipe.kafka import topics
from gpupipe.lifecycle import service_flags


def _subparsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*words, name))
    if words:
        yield words, parser


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in parser._actions if flag in a.option_strings), None)


def _reference(flag: str) -> argparse.Action:
    p = argparse.ArgumentParser()
    {"--create-topics": service_flags.add_create_topics, "--listen": service_flags.add_listen}[flag](p)
    act = _option(p, flag)
    assert act is not None
    return act


def test_every_service_declares_create_topics_alike() -> None:
    ref = _reference("--create-topics")
    services = []
    for words, sub in _subparsers(build_parser()):
        act = _option(sub, "--create-topics")
        if act is None:
            continue
        services.append(words)
        assert (type(act), act.default, act.help) == (type(ref), ref.default, ref.help), words
    assert len(services) >= 7, services  # produce, metrics, chargeback, alerts, recommend, lake, otlp


def test_every_service_but_metrics_listens_only_when_asked() -> None:
    for words, sub in _subparsers(build_parser()):
        act = _option(sub, "--listen")
        if act is None or words == ("metrics",):  # dcgm-exporter's -a/--address :9400
            continue
        assert act.default is None and act.metavar == "HOST:PORT", words
        assert act.help.startswith("address of ") and act.help.endswith(" and /healthz"), words


def test_from_beginning_says_what_the_service_reads() -> None:
    p = argparse.ArgumentParser()
    service_flags.add_from_beginning(p, what="samples")
    act = _option(p, "--from-beginning")
    assert act is not None and act.default is False
    assert "oldest retained samples instead of the newest" in act.help


def test_a_creating_service_prepares_every_topic_a_waiting_one_only_its_own() -> None:
    assert topics.to_prepare([topics.SAMPLES], create=True) == topics.ALL
    assert topics.to_prepare([topics.SAMPLES, topics.XID], create=False) == (topics.SAMPLES, topics.XID)
