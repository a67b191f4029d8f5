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
from gpupipe_producer.framings import parse_framings
from gpupipe_producer.publish import Publisher


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


def test_framing_is_chosen_per_topic_or_for_both() -> None:
    assert parse_framings([], registry=False) == {}
    assert parse_framings(["raw"], registry=False) == {"gpu.samples.v1": "raw", "gpu.xid.v1": "raw"}
    assert parse_framings(["raw", "xid=single-object"], registry=False) == {
        "gpu.samples.v1": "raw",
        "gpu.xid.v1": "single-object",
    }
    assert parse_framings(["samples=confluent"], registry=True) == {"gpu.samples.v1": "confluent"}


@pytest.mark.parametrize(
    ("items", "registry"),
    [(["avro"], False), (["chargeback=raw"], False), (["samples="], False), (["confluent"], False)],
)
def test_a_bad_framing_is_one_line(items: list[str], registry: bool) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_framings(items, registry=registry)
    assert "--framing" in str(ei.value) and "\n" not in str(ei.value)


def test_publisher_stamps_a_raw_topics_schema_header_on_each_record() -> None:
    sent: list[tuple[str, object]] = []

    class _Fake:
        def produce(self, topic: str, value: bytes, key: bytes, **kw: object) -> None:
            sent.append((topic, kw.get("headers")))

    pub = Publisher({}, producer_factory=lambda _c: _Fake())
    pub.topic_headers["raw.t"] = [("gpupipe.schema", b"GpuSample@00")]
    pub.produce("raw.t", b"k", b"v", [("sig", b"s")])
    pub.produce("other.t", b"k", b"v")
    pub.produce_tracked("raw.t", b"k", b"v", lambda _e, _m: None)
    assert sent == [
        ("raw.t", [("gpupipe.schema", b"GpuSample@00"), ("sig", b"s")]),
        ("other.t", None),
        ("raw.t", [("gpupipe.schema", b"GpuSample@00")]),
    ]
