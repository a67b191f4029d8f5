"""Where every command's librdkafka settings come from, and why secrets never come from argv.

A process's command line is readable by every user of the host (`ps`, `/proc/<pid>/cmdline`), so a
password given as ``--kafka-config sasl.password=...`` leaks to anyone on a GPU node. Settings are
therefore merged, lowest precedence first, from:

1. ``--kafka-config-file PATH`` (env ``GPUPIPE_KAFKA_CONFIG_FILE``): a librdkafka properties file,
   ``key=value`` per line, ``#``/``!`` comments, as ``kcat -F`` and the Java clients read;
2. ``GPUPIPE_KAFKA_<KEY>`` environment variables, ``_`` for ``.``: ``GPUPIPE_KAFKA_SASL_USERNAME`` is
   ``sasl.username`` (the way Kubernetes passes a Secret as env);
3. ``--kafka-config KEY=VALUE`` (env ``GPUPIPE_KAFKA_CONFIG``, ``;``-separated).

Any key may instead be given as ``<key>.file=PATH`` (env ``GPUPIPE_KAFKA_<KEY>_FILE``): the value is
read from that file, trailing newline stripped (a mounted Secret). A secret key given on the command
line itself is refused at parse time with a line naming the alternatives; the same key from the
environment, a file or ``GPUPIPE_KAFKA_CONFIG`` is fine. Done once here, for every subcommand.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpupipe.common.argtypes import duration_ms
from gpupipe.common.errors import ConfigError
from gpupipe.common.flag_files import read_text

SECRET_KEYS = frozenset(
    {
        "sasl.password",
        "sasl.jaas.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.config",
        "ssl.key.password",
        "ssl.keystore.password",
        "ssl.key.pem",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.passphrase",
    }
)
"""librdkafka (and Java-client) settings whose value is a credential."""

FILE_SUFFIX = ".file"
ENV_PREFIX = "GPUPIPE_KAFKA_"
# Env twins of our own flags, not librdkafka settings.
_OWN_ENV = frozenset({"GPUPIPE_KAFKA_CONFIG", "GPUPIPE_KAFKA_CONFIG_FILE", "GPUPIPE_KAFKA_AUTHZ_WAIT"})


class KafkaSettings(dict[str, str]):
    """The merged settings; a dict whose repr hides secret values (it may end up in a log line)."""

    def __repr__(self) -> str:
        return repr({k: ("***" if is_secret(k) else v) for k, v in self.items()})


def is_secret(key: str) -> bool:
    return key in SECRET_KEYS or key.endswith((".password", ".secret", ".passphrase", ".key.pem"))


def split_items(items: Iterable[str], source: str) -> list[tuple[str, str]]:
    """`['a=1,b=2', 'c=3']` -> pairs; every part must be KEY=VALUE."""
    out: list[tuple[str, str]] = []
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"{source} expects key=value, got {part!r}")
            k, v = part.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def refuse_secret_on_command_line(key: str) -> str | None:
    """The error line for a secret passed as a command-line argument, or None if `key` is fine there."""
    if not is_secret(key):
        return None
    env = ENV_PREFIX + key.upper().replace(".", "_")
    return (
        f"--kafka-config {key}=... on the command line is visible to every user in `ps`; "
        f"give it as {key}{FILE_SUFFIX}=PATH, in --kafka-config-file, "
        f"or as {env} / {env}_FILE in the environment"
    )


class KafkaConfigAction(argparse._AppendAction):
    """`--kafka-config` that refuses secrets. Only argv goes through here: env defaults do not."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            pairs = split_items([str(values)], "--kafka-config")
        except ConfigError as exc:
            parser.error(str(exc))
        for key, _ in pairs:
            msg = refuse_secret_on_command_line(key)
            if msg:
                parser.error(msg)
        super().__call__(parser, namespace, values, option_string)


def read_properties(path: str | Path) -> dict[str, str]:
    """A librdkafka/Java-style properties file: `key=value` lines, `#` or `!` comments, blank lines."""
    text = read_text(path, "--kafka-config-file")
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--kafka-config-file {path} line {n}: expected key=value")
        out[key.strip()] = value.strip()
    return out


def from_environ(environ: Mapping[str, str], own: Iterable[str] = ()) -> dict[str, str]:
    """`GPUPIPE_KAFKA_SASL_PASSWORD_FILE=/x` -> `{'sasl.password.file': '/x'}`; the env twins of our own
    flags (`own`, e.g. GPUPIPE_KAFKA_CONFIG_FILE) are not librdkafka settings."""
    skip = _OWN_ENV | frozenset(own)
    out: dict[str, str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in skip:
            continue
        key = name[len(ENV_PREFIX) :].lower().replace("_", ".")
        if key:
            out[key] = value
    return out


def _resolve_files(conf: dict[str, str]) -> None:
    """Replace every `<key>.file=PATH` by `<key>=<contents of PATH>` (in place)."""
    for fkey in [k for k in conf if k.endswith(FILE_SUFFIX)]:
        key = fkey[: -len(FILE_SUFFIX)]
        path = conf.pop(fkey)
        conf[key] = read_text(path, f"{key} from {fkey}").rstrip("\r\n")


def resolve(
    items: Iterable[str] | Mapping[str, str],
    config_file: str | None,
    environ: Mapping[str, str],
    own_env: Iterable[str] = (),
) -> KafkaSettings:
    """Merge file < environment < --kafka-config, then read `*.file` values (see module doc)."""
    merged: dict[str, str] = {}
    layers: list[dict[str, str]] = [
        read_properties(config_file) if config_file else {},
        from_environ(environ, own_env),
        dict(items) if isinstance(items, Mapping) else dict(split_items(items, "--kafka-config")),
    ]
    for layer in layers:
        for k, v in layer.items():
            # A later layer's `key` wins over an earlier `key.file`, and the other way round.
            merged.pop(k + FILE_SUFFIX if not k.endswith(FILE_SUFFIX) else k[: -len(FILE_SUFFIX)], None)
            merged[k] = v
    _resolve_files(merged)
    return KafkaSettings(merged)


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The Kafka client flags every Kafka-using subcommand gets.

    Called from `gpupipe.commands.cli.add_common`."""
    group.add_argument(
        "--kafka-config",
        action=KafkaConfigAction,
        default=[],
        metavar="KEY=VALUE",
        help="extra librdkafka setting, repeatable (env: ';'-separated); secrets are refused here: "
        "use --kafka-config-file, GPUPIPE_KAFKA_<KEY> or KEY.file=PATH",
    )
    group.add_argument(
        "--kafka-config-file",
        default=None,
        metavar="PATH",
        help="librdkafka properties file (key=value lines), e.g. a mounted Secret; "
        "GPUPIPE_KAFKA_<KEY> env vars and --kafka-config override it",
    )
    group.add_argument(
        "--kafka-authz-wait",
        type=duration_ms,
        default="10s",
        metavar="DURATION",
        help="on a secured cluster, how long to retry at start while an ACL this role needs is missing "
        "(ACLs being applied) before failing",
    )
