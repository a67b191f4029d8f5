"""`gpupipe`: one CLI, one subcommand per service.

Every flag has an environment-variable twin (`--bootstrap-servers` ->
`GPUPIPE_BOOTSTRAP_SERVERS`), so the same image runs in Kubernetes with env
vars and on a laptop with flags (12-factor). A command module provides
`add_arguments(parser)` and `run(args) -> int`; errors we raise on purpose
become one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from consumers import tail
from consumers.alerts import command as alerts_command
from consumers.chargeback import command as chargeback_command
from consumers.metrics import command as metrics_command
from consumers.recommend import command as recommend_command
from consumers.report import command as report_command
from consumers.report import idle_command
from gpupipe import acls_command, kafka_config
from gpupipe.errors import BrokerUnavailableError, ConfigError, GpupipeError
from producer import command as producer_command
from producer.xid import parse_command as xid_parse_command

ENV_PREFIX = "GPUPIPE_"

# (path of words, command module, help). Every command module has add_arguments(p) and run(args).
COMMANDS: tuple[tuple[tuple[str, ...], ModuleType, str], ...] = (
    (("produce",), producer_command, "run the node producer (simulated fleet or NVML) publishing to Kafka"),
    (("tail",), tail, "print records of a gpupipe topic as JSON lines"),
    (("xid", "parse"), xid_parse_command, "parse kernel-log lines on stdin into XID JSON lines"),
    (("metrics",), metrics_command, "serve dcgm-exporter-compatible /metrics from Kafka"),
    (("chargeback",), chargeback_command, "aggregate GPU cost per namespace into windows"),
    (("report", "chargeback"), report_command, "print chargeback reports per namespace or team"),
    (("alerts",), alerts_command, "classify and deduplicate XIDs into alerts"),
    (("recommend",), recommend_command, "recommend what to do with GPUs that pods hold idle"),
    (("report", "idle"), idle_command, "print the top idle-GPU wasters per team or owner"),
    (("acls",), acls_command, "print or apply the least-privilege Kafka ACLs of each role"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def env_name(option: str) -> str:
    return ENV_PREFIX + option.lstrip("-").upper().replace("-", "_")


def _truthy(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


def apply_env_defaults(parser: argparse.ArgumentParser, environ: os._Environ[str] | dict[str, str]) -> None:
    """Let GPUPIPE_* variables set defaults; explicit flags still win."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                apply_env_defaults(sub, environ)
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        value = environ.get(env_name(longs[0]))
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
    for words, module, help_text in COMMANDS:
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
        p.set_defaults(_run=module.run)
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


def main(argv: Sequence[str] | None = None) -> int:
    from gpupipe.startup import mark_start

    mark_start()  # a new consumer group reads from this moment on (no gap while starting)
    parser = build_parser()
    apply_env_defaults(parser, os.environ)
    args = parser.parse_args(argv)
    from gpupipe.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    from gpupipe.startup import RepeatThrottle

    logging.getLogger("gpupipe.kafka").addFilter(RepeatThrottle())  # reconnect storms during outages
    try:
        if hasattr(args, "kafka_config"):
            # One place for every subcommand: file < GPUPIPE_KAFKA_* < --kafka-config, *.file read.
            args.kafka_config = kafka_config.resolve(
                args.kafka_config, args.kafka_config_file, os.environ, _flag_env_names(parser)
            )
            from gpupipe.kafka_admin import preflight

            preflight(args, _command_words(args))
        return int(args._run(args) or 0)
    except ConfigError as exc:
        print(f"gpupipe: error: {exc}", file=sys.stderr)
        return 2
    except BrokerUnavailableError as exc:
        print(f"gpupipe: error: {exc}", file=sys.stderr)
        return 3
    except GpupipeError as exc:
        from gpupipe.kafka_auth import describe_denial

        line = describe_denial(str(exc), args, _command_words(args)) or str(exc)
        print(f"gpupipe: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
