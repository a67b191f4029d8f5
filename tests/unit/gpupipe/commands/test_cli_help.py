"""`--help` states every flag's default and environment twin once, from the flag's own declaration.

Help texts once restated defaults by hand ("(default 10s)") next to `default=`; the two drift apart
silently. The CLI now appends the default and the GPUPIPE_* variable itself, so these tests check,
for every subcommand, that each appears exactly once, that the shown default reads back as the
real one, and that no help text states a default (or a variable) by hand any more.
"""

from __future__ import annotations

import argparse
import re

import pytest

from gpupipe.commands import cli
from gpupipe.common.durations import format_duration_ms, parse_duration_ms

# A default stated in words: "(default 10s)", "default: x", "; default off", "default 60", "default is 5".
STATED_DEFAULT = re.compile(r"\(default\b|\bdefault(?::|\s+(?:is\s+)?[\d'\"])|;\s*default\b|^default\b", re.I)


def _commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out: list[tuple[tuple[str, ...], argparse.ArgumentParser]] = []

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and words:
            out.append((words, parser))
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, (*words, name))

    walk(cli.build_parser(), ())
    return out


COMMANDS = _commands()
IDS = [" ".join(words) for words, _ in COMMANDS]


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a for a in parser._actions if cli.flag_env_name(a) is not None and a.help is not argparse.SUPPRESS
    ]


def _help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())  # line breaks fall only at spaces


def _reads_back(action: argparse.Action, shown: str) -> object:
    """What the flag's value would be if one typed the shown default."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return {"on": True, "off": False}[shown]
    return action.type(shown) if action.type is not None else shown


def test_every_command_is_covered() -> None:
    assert {
        "produce",
        "metrics",
        "chargeback",
        "alerts",
        "recommend",
        "report chargeback",
        "report idle",
    } <= set(IDS)


@pytest.mark.parametrize(("words", "parser"), COMMANDS, ids=IDS)
def test_every_flag_shows_its_environment_variable_once(
    words: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    text = _help(parser)
    for action in _flags(parser):
        name = cli.flag_env_name(action)
        assert text.count(f"env {name})") == 1, (words, action.option_strings)


@pytest.mark.parametrize(("words", "parser"), COMMANDS, ids=IDS)
def test_every_default_is_shown_once_and_reads_back_as_the_default(
    words: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    text = _help(parser)
    shown_any = 0
    for action in _flags(parser):
        shown = cli.shown_default(action)
        if action.default is None or action.default is False or action.default in ([], "", ()):
            assert shown is None, (words, action.option_strings)
            continue
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            continue  # a switch: its presence is the value
        assert shown is not None, (words, action.option_strings)
        note = f"(default: {shown}; env {cli.flag_env_name(action)})"
        assert text.count(note) == 1, (words, note)
        assert text.count(f"default: {shown};") >= 1
        real = action.default
        if isinstance(real, str) and action.type is not None:
            real = action.type(real)  # argparse converts a string default as it would the flag's value
        assert _reads_back(action, shown) == real, (words, action.option_strings, shown)
        shown_any += 1
    assert shown_any or words in {("xid", "parse")}, words


@pytest.mark.parametrize(("words", "parser"), COMMANDS, ids=IDS)
def test_no_help_text_states_a_default_or_a_variable_by_hand(
    words: tuple[str, ...], parser: argparse.ArgumentParser
) -> None:
    twins = {cli.flag_env_name(a) for a in _flags(parser)}
    for action in _flags(parser):
        own = action.help or ""
        switch = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
        if cli.shown_default(action) is None and not switch:
            own = cli._WORDS_DEFAULT.sub("", own)  # a computed default: in words, last, in parentheses
        assert not STATED_DEFAULT.search(own), (words, action.option_strings, action.help)
        for name in re.findall(r"GPUPIPE_[A-Z0-9_]+", own):
            assert name not in twins, (words, action.option_strings, name)


def test_a_computed_default_in_words_shares_the_parentheses() -> None:
    parser = dict(COMMANDS)[("alerts",)]
    text = _help(parser)
    assert "(default: in-cluster config; env GPUPIPE_KUBE_API_URL)" in text
    assert "(default: host name; env GPUPIPE_INSTANCE_ID)" in text
    assert "(env GPUPIPE_LISTEN)" in text  # no default: the variable alone


def test_a_default_from_the_environment_is_the_one_shown() -> None:
    root = cli.build_parser()
    cli.apply_env_defaults(root, {"GPUPIPE_DEDUPE_WINDOW": "15m", "GPUPIPE_HEALTH_SIGNALS": "false"})
    alerts = next(p for w, p in _walk_root(root) if w == ("alerts",))
    text = _help(alerts)
    assert "(default: 15m; env GPUPIPE_DEDUPE_WINDOW)" in text
    assert "(env GPUPIPE_HEALTH_SIGNALS)" in text  # switched off: nothing to state


def _walk_root(root: argparse.ArgumentParser) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return [((name,), p) for name, p in sub.choices.items()]


def test_help_keeps_paths_and_names_whole() -> None:
    parser = dict(COMMANDS)[("produce",)]
    raw = parser.format_help()
    assert "/var/lib/kubelet/pod-resources/kubelet.sock;" in raw
    assert all(len(word) < 80 for word in raw.split())


def test_the_parsers_actions_keep_their_own_help() -> None:
    parser = dict(COMMANDS)[("alerts",)]
    parser.format_help()
    action = next(a for a in parser._actions if a.dest == "dedupe_window")
    assert "env" not in action.help and "default" not in action.help


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0"), (500, "500ms"), (1000, "1s"), (1500, "1s500ms"), (60_000, "1m"), (90_000, "1m30s"),
     (5_400_000, "1h30m"), (86_400_000, "1d"), (7 * 86_400_000, "7d"), (123_456_789, "1d10h17m36s789ms")],
)  # fmt: skip
def test_format_duration_ms_is_exact_and_reads_back(ms: int, text: str) -> None:
    assert format_duration_ms(ms) == text
    assert parse_duration_ms(text) == ms


def test_flag_defaults_come_from_the_configs() -> None:
    """The flags read their defaults from the config classes: parsing no flags gives the configs'."""
    from gpupipe_consumers.alerts.command import options_from_args
    from gpupipe_consumers.alerts.engine.facade import EngineConfig
    from gpupipe_consumers.alerts.engine.health_signals import HealthConfig
    from gpupipe_consumers.metrics import command as metrics_command
    from gpupipe_consumers.metrics.service import MetricsConfig

    opts = options_from_args(cli.build_parser().parse_args(["alerts", "--instance-id", "a"]))
    assert opts.engine == EngineConfig(confirm_by_samples=True)
    assert opts.health == HealthConfig()
    assert (opts.instance, opts.cluster, opts.alertmanager_urls) == ("a", None, ())
    cfg = metrics_command.config_from_args(cli.build_parser().parse_args(["metrics"]))
    want = MetricsConfig(bootstrap="localhost:9092")
    for name in ("group_id", "stale_intervals", "max_sample_age_s", "gzip_level", "host_label"):
        assert getattr(cfg, name) == getattr(want, name), name


def test_every_command_is_registered_and_the_floor_imports_none() -> None:
    # The roof is pyproject's entry-point table: the CLI module names no service.
    names = {" ".join(words) for words, _ in cli.commands()}
    assert names == {
        "produce",
        "tail",
        "xid parse",
        "metrics",
        "chargeback",
        "report chargeback",
        "alerts",
        "recommend",
        "report idle",
        "acls",
        "lake write",
        "lake query",
        "lake maintain",
        "otlp",
    }
    for _, module in cli.commands():
        assert module.HELP and callable(module.add_arguments) and callable(module.run)
    import inspect

    source = inspect.getsource(cli)
    assert (
        "import producer" not in source and "from consumers" not in source and "from producer" not in source
    )


def test_building_the_parser_loads_no_columnar_stack() -> None:
    # Every gpupipe process builds the whole parser, a node agent's too: the lake's pyarrow,
    # pyiceberg and DuckDB load only when a lake command runs.
    import subprocess
    import sys

    code = (
        "import sys; from gpupipe.commands.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('pyarrow', 'pyiceberg', 'duckdb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


#: Flags whose names sound like time but that take no duration, and why.
NOT_DURATIONS = {
    "--alertmanager-url": "a URL",
    "--alertmanager-max-alerts": "a count",
    "--xid-count-window-size": "dcgm-exporter's flag: milliseconds, as it takes them",
    "--clock-events-count-window-size": "dcgm-exporter's flag: milliseconds, as it takes them",
    "--collect-interval": "dcgm-exporter's flag: milliseconds, as it takes them",
    "--stale-intervals": "a number of sample intervals",
    "--dump-retention": "dcgm-exporter's flag, accepted and ignored",
    "--gpu-bind-unbind-poll-interval": "dcgm-exporter's flag, accepted and ignored",
    "--topic-retention": "TOPIC=DURATION pairs",
    "--period": "a period name or a month",
    "--since": "a duration or a date",
}
_TIME_WORDS = re.compile(
    r"timeout|interval|delay|grace|window|age|after|lookback|deadline|horizon|wait|retention"
)


@pytest.mark.parametrize(("words", "parser"), COMMANDS, ids=IDS)
def test_every_time_flag_takes_a_duration(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    for action in _flags(parser):
        assert action.metavar != "SECONDS", (words, action.option_strings)
        names = [o for o in action.option_strings if o.startswith("--") and _TIME_WORDS.search(o)]
        if not names or any(o in NOT_DURATIONS for o in action.option_strings):
            continue
        assert action.type is not None, (words, names)
        for text, ms in (("1m", 60_000), ("1.5s", 1500), ("2", 2000)):  # a bare number is seconds
            assert action.type(text) == ms, (words, names, text)


def test_tail_and_report_timeouts_are_durations(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["tail", "gpu.xid.v1", "--idle-timeout", "500ms"]).idle_timeout == 500
    assert parser.parse_args(["report", "idle", "--timeout", "2m"]).timeout == 120_000
    assert parser.parse_args(["report", "chargeback"]).timeout == 60_000
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", "chargeback", "--timeout", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gpupipe report chargeback: error: argument --timeout: duration '0' must be greater than zero "
        "(see --help)"
    )
