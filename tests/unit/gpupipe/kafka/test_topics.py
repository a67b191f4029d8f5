import pytest

from gpupipe.common.errors import ConfigError
from gpupipe.kafka import topics
from gpupipe.kafka.admin import parse_kafka_overrides, parse_topic_overrides


def test_defaults_without_overrides() -> None:
    assert parse_topic_overrides([], []) == topics.DEFAULT_SPECS


def test_overrides_by_alias_and_full_name() -> None:
    specs = parse_topic_overrides(["samples=24", "gpu.xid.v1=6"], ["xid=90d", "deadletter=1h"])
    assert specs[topics.SAMPLES].partitions == 24
    assert specs[topics.SAMPLES].retention_ms == topics.DEFAULT_SPECS[topics.SAMPLES].retention_ms
    assert specs[topics.XID].partitions == 6 and specs[topics.XID].retention_ms == 90 * 86_400_000
    assert specs[topics.DEADLETTER].retention_ms == 3_600_000


@pytest.mark.parametrize(
    ("parts", "ret"), [(["bogus=3"], []), (["samples=0"], []), (["samples"], []), ([], ["xid=forever"])]
)
def test_bad_overrides(parts: list[str], ret: list[str]) -> None:
    with pytest.raises(ConfigError):
        parse_topic_overrides(parts, ret)


def test_prefix_roundtrip() -> None:
    assert topics.with_prefix("staging.", topics.XID) == "staging.gpu.xid.v1"
    assert topics.base_name("staging.", "staging.gpu.xid.v1") == topics.XID
    assert topics.with_prefix("", topics.XID) == topics.XID


def test_kafka_overrides() -> None:
    assert parse_kafka_overrides(["a=1,b=2", "c = 3"]) == {"a": "1", "b": "2", "c": "3"}
    with pytest.raises(ConfigError):
        parse_kafka_overrides(["novalue"])
