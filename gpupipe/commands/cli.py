"""`gpupipe`: one CLI, one subcommand per service.

Every flag has an environment-variable twin (`--bootstrap-servers` ->
`GPUPIPE_BOOTSTRAP_SERVERS`), so the same image runs in Kubernetes with env
vars and on a laptop with flags (12-factor). A flag's `add_argument` is its one
declaration: `--help` appends its default and its variable from it
(:class:`HelpFormatter`), so help texts never restate either and cannot drift
from what the code does. A command module provides
`add_arguments(parser)` and `run(args) -> int`; errors we raise on purpose
become one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from gpupipe.common.errors import BrokerUnavailableError, ConfigError, GpupipeError
from gpupipe.common.flag_files import check_file_flags
from gpupipe.kafka import config as kafka_config

#: Each command registers itself under this entry-point group (``pyproject.toml``): the roof is that
#: table, so the floor the CLI stands on imports no service. A name's dots are its words
#: (``report.idle`` is ``gpupipe report idle``); the module has ``HELP``, ``add_arguments(p)`` and
#: ``run(args)``.
COMMAND_GROUP = "gpupipe.commands"

ENV_PREFIX = "GPUPIPE_"


def commands() -> list[tuple[tuple[str, ...], ModuleType]]:
    """(words, module) of every registered command (by name, as importlib.metadata lists them)."""
    from importlib.metadata import entry_points

    found = [(tuple(ep.name.split(".")), ep.load()) for ep in entry_points(group=COMMAND_GROUP)]
    if not found:
        raise RuntimeError(f"no {COMMAND_GROUP} entry points: gpupipe is not installed (pip install -e .)")
    return found


def env_name(option: str) -> str:
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def flag_env_name(action: argparse.Action) -> str | None:
    """The GPUPIPE_* twin of a flag (from its first long option), None for positionals and --help."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or action.dest in ("help", "version") or isinstance(action, argparse._SubParsersAction):
        return None
    return env_name(longs[0])


def shown_default(action: argparse.Action) -> str | None:
    """A flag's default as one would type it (`10s`, not 10000), or None when there is none to state.

    None, False, empty values and on/off switches that are off say nothing; the converter's `show`
    (see :mod:`gpupipe.common.argtypes`) turns a parsed default back into its text. A default a GPUPIPE_*
    variable replaced is a string already and is shown as given.
    """
    d = action.default
    if d is None or d is False or d is argparse.SUPPRESS or action.help is argparse.SUPPRESS:
        return None
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return None  # the flag's presence is the value; its absence needs no words
    if d is True:
        return "on"
    if isinstance(d, str):
        return d or None
    if isinstance(d, list | tuple):
        sep = ";" if isinstance(action, argparse._AppendAction) else ","  # as GPUPIPE_* / the flag take it
        return sep.join(str(v) for v in d) or None
    show = getattr(action.type, "show", None)
    if show is not None:
        return str(show(d))
    if isinstance(d, float):
        return f"{d:g}"
    return str(d)


# A computed default (default=None) is said in words at the end of the help: "(default: host name)".
_WORDS_DEFAULT = re.compile(r"\s*\(default:? ([^()]*)\)$")


def help_text(action: argparse.Action) -> str | None:
    """A flag's help as `--help` shows it: its own text, then '(default: 30s; env GPUPIPE_LOOKBACK)'.

    The default comes from the flag's `default=` (:func:`shown_default`), the variable from its name;
    a default=None flag that says its computed default in words keeps them, in the same parentheses.
    Like the flag's own text it is an argparse %-template: a `%` in a default is doubled.
    """
    own = action.help
    env = flag_env_name(action)
    if env is None or own is argparse.SUPPRESS:
        return own
    default = shown_default(action)
    if default is None and own and (words := _WORDS_DEFAULT.search(own)):
        own, default = own[: words.start()], words.group(1)
    note = f"(default: {default.replace('%', '%%')}; env {env})" if default is not None else f"(env {env})"
    return f"{own} {note}" if own else note


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, every flag's help from :func:`help_text` (its default and variable added).

    Lines break only at spaces, so a default such as `/var/lib/kubelet/pod-resources/kubelet.sock`
    or a variable name stays whole (and can be copied).
    """

    def _format_action(self, action: argparse.Action) -> str:
        text = help_text(action)
        if text != action.help:
            action = copy.copy(action)  # the parser's action keeps its own help text
            action.help = text
        return super()._format_action(action)

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's parse_args, but a leftover argument is reported by the subcommand it was given to.

        argparse finds leftovers only back at the root parser, so its error would say `gpupipe:` and
        leave the reader guessing which command's flags to look up; `gpupipe metrics: error: ...`
        names the `--help` that lists them.
        """
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(ns, "_parser", self)
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def apply_env_defaults(parser: argparse.ArgumentParser, environ: os._Environ[str] | dict[str, str]) -> None:
    """Let GPUPIPE_* variables set defaults; explicit flags still win."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, environ)
            continue
        name = flag_env_name(action)
        value = None if name is None else environ.get(name)
        if value is None:
            continue
        if isinstance(
            action, argparse._StoreTrueAction | argparse._StoreFalseAction | argparse.BooleanOptionalAction
        ):
            action.default = _truthy(value)
        elif isinstance(action, argparse._AppendAction):
            action.default = [v for v in value.split(";") if v]
        else:
            action.default = value


def add_common(p: argparse.ArgumentParser, kafka: bool = True) -> None:
    g = p.add_argument_group("common")
    if kafka:
        g.add_argument(
            "--bootstrap-servers", default="localhost:9092", help="Kafka bootstrap servers (HOST:PORT,...)"
        )
        g.add_argument("--topic-prefix", default="", help="prefix for every topic name, e.g. 'staging.'")
        g.add_argument(
            "--schema-registry-url",
            default=None,
            help="use the Confluent wire format with this Schema Registry (default: single-object encoding)",
        )
        kafka_config.add_arguments(g)
    dests = {a.dest for a in p._actions}
    if "listen" in dests and "web_config_file" not in dests:
        # the same exporter-toolkit web-config (TLS, basic auth) as `gpupipe metrics` has
        g.add_argument(
            "--web-config-file",
            default=None,
            metavar="FILE",
            help="TLS and basic auth for --listen (Prometheus exporter-toolkit web-config YAML)",
        )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument(
        "--log-format", default="json", choices=["json", "text"], help="structured JSON or text logs"
    )


def build_parser() -> argparse.ArgumentParser:
    root = _Parser(prog="gpupipe", description="GPU telemetry event-streaming pipeline")
    root.add_argument("--version", action="version", version=f"gpupipe {_version()}")
    tops = root.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    tops.required = True
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module in commands():
        help_text = module.HELP
        parent = tops
        for w in words[:-1]:
            if w not in groups:
                gp = tops.add_parser(w, help=f"{w} commands")
                groups[w] = gp.add_subparsers(dest=f"{w}_command", metavar="COMMAND", parser_class=_Parser)
                groups[w].required = True
            parent = groups[w]
        p = parent.add_parser(words[-1], help=help_text, description=(module.__doc__ or help_text).strip())
        module.add_arguments(p)
        add_common(p, kafka=getattr(module, "USES_KAFKA", True))
        p.set_defaults(_run=module.run, _parser=p)
    return root


def _flag_env_names(parser: argparse.ArgumentParser) -> set[str]:
    """GPUPIPE_* names of every flag (a future --kafka-foo flag's twin is not a librdkafka setting)."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _flag_env_names(sub)
        else:
            out |= {env_name(o) for o in action.option_strings if o.startswith("--")}
    return out


def _command_words(args: argparse.Namespace) -> tuple[str, ...]:
    """('report', 'chargeback') for `gpupipe report chargeback`."""
    words = (args.command,)
    sub = getattr(args, f"{args.command}_command", None)
    return (*words, sub) if sub else words


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("gpupipe")
    except Exception:
        return "dev"


#: Exit status of a writer whose reader closed the pipe: what a shell reports for a tool that SIGPIPE
#: killed (128 + 13), so `set -o pipefail` scripts see gpupipe as they see `cat` or `grep`.
EXIT_BROKEN_PIPE = 141


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_went_away() -> int:
    """`gpupipe tail ... | head`: the reader has what it wanted, so stop without a word.

    Python turns SIGPIPE into BrokenPipeError; left alone it prints a traceback, and the interpreter's
    last flush of stdout at exit would fail once more ("Exception ignored ..."). Pointing stdout at
    /dev/null makes that flush a no-op.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout already closed or not a real file: nothing left to flush
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    from gpupipe.lifecycle.startup import mark_start

    mark_start()  # a new consumer group reads from this moment on (no gap while starting)
    parser = build_parser()
    apply_env_defaults(parser, os.environ)
    args = parser.parse_args(argv)
    from gpupipe.common.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    from gpupipe.common.log_throttle import RepeatThrottle

    logging.getLogger("gpupipe.kafka").addFilter(RepeatThrottle())  # reconnect storms during outages
    prog = " ".join(("gpupipe", *_command_words(args)))  # errors name the command whose --help helps
    try:
        check_file_flags(args._parser, args)  # a bad file is one line, before anything connects
        if hasattr(args, "topic_replication"):
            from gpupipe.kafka import replication as topic_replication

            topic_replication.configure(args.topic_replication)  # every topic this process creates
        if hasattr(args, "kafka_config"):
            # One place for every subcommand: file < GPUPIPE_KAFKA_* < --kafka-config, *.file read.
            args.kafka_config = kafka_config.resolve(
                args.kafka_config, args.kafka_config_file, os.environ, _flag_env_names(parser)
            )
            from gpupipe.kafka.admin import preflight

            preflight(args, _command_words(args))
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailableError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 3
    except GpupipeError as exc:
        from gpupipe.kafka.auth import describe_denial

        line = describe_denial(str(exc), args, _command_words(args)) or str(exc)
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket of our own, not the reader of our output: a real fault
        return _reader_went_away()


if __name__ == "__main__":
    sys.exit(main())
