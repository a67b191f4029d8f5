"""Secrets never on the command line; --kafka-config-file, GPUPIPE_KAFKA_*, *.file variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpupipe.commands import cli
from gpupipe.common.errors import ConfigError
from gpupipe.kafka import config as kafka_config
from gpupipe.kafka.admin import parse_kafka_overrides


def test_password_on_the_command_line_is_refused_with_the_alternatives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["tail", "gpu.xid.v1", "--kafka-config", "sasl.username=u,sasl.password=hunter2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--kafka-config sasl.password=... on the command line is visible to every user in `ps`; "
        "give it as sasl.password.file=PATH, in --kafka-config-file, or as GPUPIPE_KAFKA_SASL_PASSWORD / "
        "GPUPIPE_KAFKA_SASL_PASSWORD_FILE in the environment"
    ) in err
    assert "hunter2" not in err


@pytest.mark.parametrize(
    "key",
    [
        "ssl.key.password",
        "sasl.jaas.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.passphrase",
    ],
)
def test_every_secret_key_is_refused_on_every_kafka_subcommand(key: str) -> None:
    parser = cli.build_parser()
    for argv in (
        ["produce"],
        ["metrics"],
        ["chargeback"],
        ["alerts"],
        ["report", "chargeback"],
        ["acls", "--print"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--kafka-config", f"{key}=x"])


def test_non_secrets_and_password_files_are_fine_on_the_command_line() -> None:
    args = cli.build_parser().parse_args(
        [
            "tail",
            "t",
            "--kafka-config",
            "security.protocol=SASL_SSL",
            "--kafka-config",
            "sasl.password.file=/p",
        ]
    )
    assert args.kafka_config == ["security.protocol=SASL_SSL", "sasl.password.file=/p"]


def test_secret_in_the_env_twin_of_kafka_config_is_accepted(tmp_path: Path) -> None:
    parser = cli.build_parser()
    cli.apply_env_defaults(parser, {"GPUPIPE_KAFKA_CONFIG": "sasl.username=u;sasl.password=pw"})
    args = parser.parse_args(["tail", "t"])
    assert kafka_config.resolve(args.kafka_config, None, {}) == {"sasl.username": "u", "sasl.password": "pw"}


def test_file_env_and_flags_merge_with_flags_winning(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text(
        "# comment\n! also a comment\n\nsecurity.protocol = SASL_SSL\nsasl.username=from-file\n"
        "sasl.mechanism=SCRAM-SHA-512\nssl.ca.location=/ca.pem\n"
    )
    env = {"GPUPIPE_KAFKA_SASL_USERNAME": "from-env", "GPUPIPE_KAFKA_SSL_CA_LOCATION": "/env-ca.pem"}
    conf = kafka_config.resolve(["ssl.ca.location=/flag-ca.pem"], str(props), env)
    assert conf == {
        "security.protocol": "SASL_SSL",
        "sasl.username": "from-env",
        "sasl.mechanism": "SCRAM-SHA-512",
        "ssl.ca.location": "/flag-ca.pem",
    }


def test_file_variants_read_the_secret_from_a_mounted_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "keypw").write_text("k3y")
    props = tmp_path / "c.properties"
    props.write_text(f"sasl.password.file={tmp_path / 'pw'}\n")
    conf = kafka_config.resolve(
        [], str(props), {"GPUPIPE_KAFKA_SSL_KEY_PASSWORD_FILE": str(tmp_path / "keypw")}
    )
    assert conf == {"sasl.password": "s3cret", "ssl.key.password": "k3y"}
    # a later layer's plain value replaces an earlier layer's file variant
    conf = kafka_config.resolve([], str(props), {"GPUPIPE_KAFKA_SASL_PASSWORD": "env-pw"})
    assert conf == {"sasl.password": "env-pw"}


def test_own_flag_env_twins_are_not_taken_as_librdkafka_settings() -> None:
    env = {
        "GPUPIPE_KAFKA_CONFIG": "a=b",
        "GPUPIPE_KAFKA_CONFIG_FILE": "/x",
        "GPUPIPE_KAFKA_AUTHZ_WAIT": "1s",
        "GPUPIPE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "GPUPIPE_BOOTSTRAP_SERVERS": "h:1",
    }
    assert kafka_config.from_environ(env) == {"sasl.mechanism": "SCRAM-SHA-512"}


def test_bad_inputs_name_the_file_and_line(tmp_path: Path) -> None:
    props = tmp_path / "c.properties"
    props.write_text("security.protocol=SSL\nthis line has no equals sign\n")
    with pytest.raises(ConfigError, match=r"c.properties line 2: expected key=value"):
        kafka_config.resolve([], str(props), {})
    with pytest.raises(ConfigError, match=r"--kafka-config-file .*missing.properties: No such file"):
        kafka_config.resolve([], str(tmp_path / "missing.properties"), {})
    with pytest.raises(
        ConfigError, match=r"cannot read sasl.password from sasl.password.file /nonexistent/pw"
    ):
        kafka_config.resolve(["sasl.password.file=/nonexistent/pw"], None, {})


def test_settings_repr_hides_secrets_and_commands_get_a_plain_dict() -> None:
    conf = kafka_config.resolve(
        [], None, {"GPUPIPE_KAFKA_SASL_PASSWORD": "hunter2", "GPUPIPE_KAFKA_SASL_USERNAME": "u"}
    )
    assert "hunter2" not in repr(conf) and "'u'" in repr(conf)
    assert parse_kafka_overrides(conf) == {"sasl.password": "hunter2", "sasl.username": "u"}
    assert parse_kafka_overrides(["a=1,b=2", "c=3"]) == {"a": "1", "b": "2", "c": "3"}


def test_env_twins_of_any_gpupipe_flag_are_not_kafka_settings() -> None:
    own = cli._flag_env_names(cli.build_parser())
    assert {"GPUPIPE_KAFKA_CONFIG", "GPUPIPE_KAFKA_CONFIG_FILE", "GPUPIPE_KAFKA_AUTHZ_WAIT"} <= own
    env = {"GPUPIPE_KAFKA_FUTURE_FLAG": "x", "GPUPIPE_KAFKA_SASL_USERNAME": "u"}
    assert kafka_config.resolve([], None, env, own | {"GPUPIPE_KAFKA_FUTURE_FLAG"}) == {"sasl.username": "u"}
