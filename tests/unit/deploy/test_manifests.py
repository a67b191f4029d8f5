"""The shipped deployment files start real subcommands with flags the CLI accepts (no drift)."""

import pytest
import yaml

from gpupipe.commands.cli import apply_env_defaults, build_parser
from tests.paths import REPO

REPO = REPO


def _k8s_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    for path in sorted((REPO / "deploy" / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "DaemonSet", "StatefulSet"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                out.append((f"{path.name}:{doc['metadata']['name']}", c["args"], env))
    return out


def _compose_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    doc = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    out = []
    for name, svc in doc["services"].items():
        if svc.get("image", "").startswith("gpupipe") or svc.get("build"):
            env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if k.startswith("GPUPIPE_")}
            out.append((f"compose:{name}", svc["command"], env))
    return out


CASES = _k8s_commands() + _compose_commands()


def test_there_is_something_to_check() -> None:
    names = {c[0] for c in CASES}
    assert {"compose:producer", "compose:chargeback", "compose:alerts", "compose:metrics-1"} <= names
    assert any("producer-daemonset" in n for n in names)


@pytest.mark.parametrize(("name", "args", "env"), CASES, ids=[c[0] for c in CASES])
def test_args_and_env_parse(name: str, args: list[str], env: dict[str, str]) -> None:
    parser = build_parser()
    apply_env_defaults(parser, env)
    ns = parser.parse_args(args)
    assert callable(ns._run), name
