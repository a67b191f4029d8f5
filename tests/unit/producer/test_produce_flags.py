"""`gpupipe produce` flags: which source runs by default, and the simulated fleet's forced node kinds.

Run by hand on a GPU node, `gpupipe produce` once published a made-up fleet into the real topics,
because `--source` defaulted to `simulated`. It now reads the node's GPUs (nvml) unless the
simulated fleet is asked for by name.
"""

from __future__ import annotations

import pytest

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError
from gpupipe_producer.command import fleet_config


def _parse(*argv: str) -> object:
    parser = cli.build_parser()
    cli.apply_env_defaults(parser, {})
    return parser.parse_args(["produce", *argv])


def test_produce_reads_this_nodes_gpus_unless_told_otherwise() -> None:
    assert _parse().source == "nvml"  # type: ignore[attr-defined]
    assert _parse("--source", "simulated").source == "simulated"  # type: ignore[attr-defined]


def test_gpupipe_source_variable_still_selects_the_simulated_fleet() -> None:
    parser = cli.build_parser()
    cli.apply_env_defaults(parser, {"GPUPIPE_SOURCE": "simulated"})
    assert parser.parse_args(["produce"]).source == "simulated"


def test_forced_node_kinds_reach_the_fleet_config() -> None:
    cfg = fleet_config(
        _parse("--source", "simulated", "--nodes", "4", "--mig-nodes", "3", "--shared-nodes", "0,1")
    )  # type: ignore[arg-type]
    assert cfg.mig_nodes == (3,) and cfg.shared_nodes == (0, 1)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nodes", "2", "--mig-nodes", "2"], "--mig-nodes: node 2 is not in the fleet (nodes 0 to 1)"),
        (["--nodes", "2", "--mig-nodes", "1", "--shared-nodes", "1"], "both name node 1"),
        (["--gpus-per-node", "1", "--mig-nodes", "0"], "--gpus-per-node 2 or more"),
    ],
)
def test_impossible_forced_kinds_are_one_line(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        fleet_config(_parse("--source", "simulated", *argv))  # type: ignore[arg-type]
    assert needle in str(exc.value)


def test_a_bad_node_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--mig-nodes", "x")
    assert "gpupipe produce: error: argument --mig-nodes: bad node list 'x'" in capsys.readouterr().err
