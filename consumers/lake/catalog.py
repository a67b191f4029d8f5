"""Which Iceberg catalog the lake uses: SQLite by default, any pyiceberg catalog by properties.

Out of the box (no catalog flag, no pyiceberg configuration for ``--catalog-name``) it is a
pyiceberg ``SqlCatalog`` on ``sqlite:///lake/catalog.db`` with ``lake/warehouse`` as warehouse: a
laptop or ``make demo`` needs no server. For production the same properties pyiceberg reads
everywhere select a REST catalog and an object store: ``~/.pyiceberg.yaml``, the environment
(``PYICEBERG_CATALOG__GPUPIPE__URI``...), ``--catalog-properties-file`` (YAML, for secrets: never
put credentials in argv) or ``--catalog-property KEY=VALUE``, later ones winning.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupipe.common.errors import ConfigError
from gpupipe.common.yaml_file import load_yaml

if TYPE_CHECKING:  # pyiceberg is imported where a catalog is opened: the CLI's parser loads this module
    from pyiceberg.catalog import Catalog

DEFAULT_URI = "sqlite:///lake/catalog.db"
DEFAULT_WAREHOUSE = "lake/warehouse"


#: Words that mark a pyiceberg property as a secret (s3.secret-access-key, s3.session-token,
#: credential, token, adls.account-key, adls.sas-token, adls.connection-string, gcs.oauth2.token...):
#: refused on argv.
_SECRET_WORDS = (
    "secret",
    "token",
    "credential",
    "password",
    "authorization",
    "account-key",
    "connection-string",
)
#: A REST catalog sends every ``header.<Name>`` property as an HTTP header of each request, which is
#: where a bearer token or an API key goes: all of them are refused on argv, whatever the name.
_SECRET_PREFIXES = ("header.",)


def refuse_secret_on_command_line(key: str) -> str | None:
    """Why ``key`` must not be given on the command line (visible to every user in ``ps``), or None."""
    low = key.lower()
    if not any(w in low for w in _SECRET_WORDS) and not low.startswith(_SECRET_PREFIXES):
        return None
    env = "PYICEBERG_CATALOG__<NAME>__" + key.upper().replace(".", "__").replace("-", "_")
    return (
        f"--catalog-property {key}=... on the command line is visible to every user in `ps`; "
        f"put it in --catalog-properties-file or the environment ({env})"
    )


class CatalogPropertyAction(argparse._AppendAction):
    """``--catalog-property`` that refuses secrets and URIs with a password at parse time."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        key, _, value = str(values).partition("=")
        msg = refuse_secret_on_command_line(key) or _uri_password(f"--catalog-property {key}", value)
        if msg:
            parser.error(msg)
        super().__call__(parser, namespace, values, option_string)


class CatalogUriAction(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        msg = _uri_password("--catalog-uri", str(values))
        if msg:
            parser.error(msg)
        setattr(namespace, self.dest, values)


def _uri_password(what: str, value: str) -> str | None:
    """A URI carrying ``user:password@`` (a PostgreSQL catalog's, say) is a secret on argv too."""
    _, sep, rest = value.partition("://")
    userinfo = rest.split("/", 1)[0].rpartition("@")[0] if sep else ""
    if ":" not in userinfo:
        return None
    return (
        f"{what} with a password is visible to every user in `ps`; put the URI in --catalog-properties-file"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Iceberg catalog")
    g.add_argument("--catalog-name", default="gpupipe", help="pyiceberg catalog name (its config key)")
    g.add_argument(
        "--catalog-uri",
        action=CatalogUriAction,
        default=None,
        help=f"SQL catalog URI, e.g. sqlite:///PATH; with no catalog configured anywhere, {DEFAULT_URI}",
    )
    g.add_argument(
        "--warehouse",
        default=None,
        metavar="DIR_OR_URI",
        help=f"warehouse folder or URI (s3://bucket/path); a SQL catalog without one: {DEFAULT_WAREHOUSE}",
    )
    g.add_argument(
        "--catalog-property",
        action=CatalogPropertyAction,
        default=[],
        metavar="KEY=VALUE",
        help="pyiceberg catalog property, e.g. type=rest (repeatable; no secrets here: use the file)",
    )
    g.add_argument(
        "--catalog-properties-file",
        default=None,
        metavar="FILE",
        help="YAML mapping of pyiceberg catalog properties (credentials belong here or in the environment)",
    )
    g.add_argument("--namespace", default="gpupipe", help="Iceberg namespace of the tables")


def _warehouse_uri(value: str) -> str:
    if "://" in value:
        return value
    path = Path(value).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path.as_uri()


def _sqlite_ready(uri: str) -> None:
    """Create the folder of a relative or absolute SQLite file (SQLAlchemy creates only the file)."""
    if uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)


def catalog_properties(
    args: argparse.Namespace, configured: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The properties given to ``load_catalog`` (pyiceberg merges them over its own config).

    ``configured``: what pyiceberg's own configuration holds for the name (tests pass {})."""
    props: dict[str, str] = {}
    if args.catalog_properties_file:
        doc = load_yaml(args.catalog_properties_file, "catalog properties file")
        if not isinstance(doc, dict):
            raise ConfigError(f"{args.catalog_properties_file}: expected a mapping of catalog properties")
        props.update({str(k): str(v) for k, v in doc.items()})
    for item in args.catalog_property:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--catalog-property must be KEY=VALUE, got {item!r}")
        props[key] = value
    if args.catalog_uri:
        props.setdefault("type", "sql")
        props["uri"] = args.catalog_uri
    if args.warehouse:
        props["warehouse"] = _warehouse_uri(args.warehouse)
    if configured is None:
        from pyiceberg.utils.config import Config

        configured = Config().get_catalog_config(args.catalog_name) or {}
    if not props.get("uri") and not configured.get("uri") and "type" not in props and not configured:
        props.update(type="sql", uri=DEFAULT_URI)
    if props.get("type") == "sql" and "warehouse" not in props and "warehouse" not in configured:
        props["warehouse"] = _warehouse_uri(DEFAULT_WAREHOUSE)
    return props


def open_catalog(args: argparse.Namespace) -> Catalog:
    from pyiceberg.catalog import load_catalog

    props = catalog_properties(args)
    if props.get("type") == "sql":
        _sqlite_ready(props["uri"])
    try:
        return load_catalog(args.catalog_name, **props)
    except Exception as exc:  # pyiceberg raises many kinds for a wrong config
        raise ConfigError(f"cannot open Iceberg catalog {args.catalog_name!r}: {exc}") from exc
