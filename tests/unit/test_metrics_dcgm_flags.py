"""dcgm-exporter's flags, short flags and environment variables work for `gpupipe metrics`.

Before: `-f`, `-a`, `-n`, `-x`, `--kubernetes-virtual-gpus`, `DCGM_EXPORTER_*`... were rejected, so
container args copied from a dcgm-exporter DaemonSet failed.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from consumers.metrics import command, dcgm_compat
from gpupipe.cli import add_common, apply_env_defaults

CSV = "DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\n"


def parse(argv: list[str], env: dict[str, str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    add_common(p)
    dcgm_compat.apply_dcgm_env(p, env or {})
    apply_env_defaults(p, env or {})
    return p.parse_args(argv)


def test_dcgm_exporter_container_args(tmp_path, caplog):
    csv = tmp_path / "counters.csv"
    csv.write_text(CSV)
    ours = ["-f", str(csv), "-a", "[::]:9400", "-n", "-x", "60000", "--kubernetes-virtual-gpus", "-d", "g+i"]
    ignored = ["-o", "-k", "-c", "30000", "--kubernetes-gpu-id-type", "device-name"]
    args = parse([*ours, *ignored, "--web-config-file", "w.yml"])
    with caplog.at_level(logging.INFO, logger="gpupipe.metrics"):
        cfg = command.config_from_args(args)
    assert (cfg.host, cfg.port) == ("::", 9400)
    assert cfg.counters is not None and cfg.counters.names == ("DCGM_FI_DEV_GPU_TEMP",)
    o = cfg.render
    assert o is not None and o.host_label is None and o.xid_window_ms == 60000
    assert o.virtual_gpus and o.old_namespace and o.mig_layout == "gpu+instances"
    assert cfg.web_config == "w.yml"
    assert "--collect-interval" in caplog.text and "--kubernetes-gpu-id-type" in caplog.text


def test_dcgm_exporter_environment(tmp_path):
    csv = tmp_path / "c.csv"
    csv.write_text(CSV)
    env = {
        "DCGM_EXPORTER_COLLECTORS": str(csv),
        "DCGM_EXPORTER_LISTEN": ":9500",
        "DCGM_EXPORTER_XID_COUNT_WINDOW_SIZE": "120000",
        "KUBERNETES_VIRTUAL_GPUS": "true",
        "DCGM_EXPORTER_NO_HOSTNAME": "1",
    }
    cfg = command.config_from_args(parse([], env))
    assert (cfg.host, cfg.port) == ("", 9500)
    assert cfg.counters is not None and cfg.counters.names == ("DCGM_FI_DEV_GPU_TEMP",)
    assert cfg.render is not None and cfg.render.xid_window_ms == 120000 and cfg.render.virtual_gpus
    assert cfg.render.host_label is None
    # our own GPUPIPE_* twin wins over dcgm-exporter's variable; a flag wins over both
    cfg = command.config_from_args(parse([], {**env, "GPUPIPE_LISTEN": "127.0.0.1:9600"}))
    assert (cfg.host, cfg.port) == ("127.0.0.1", 9600)
    cfg = command.config_from_args(parse(["-a", ":9700"], {**env, "GPUPIPE_LISTEN": "127.0.0.1:9600"}))
    assert cfg.port == 9700


def test_defaults_match_dcgm_exporter():
    o = command.config_from_args(parse([])).render
    assert o is not None
    assert (o.host_label, o.virtual_gpus, o.mig_layout, o.xid_window_ms) == (
        "Hostname",
        False,
        "instances",
        300000,
    )


@pytest.mark.parametrize("argv", [["-x", "0"], ["--clock-events-count-window-size", "-5"]])
def test_bad_windows(argv):
    from gpupipe.errors import ConfigError

    with pytest.raises(ConfigError):
        command.config_from_args(parse(argv))


def test_helm_chart_default_arguments_start_the_service(caplog):
    """dcgm-exporter's chart passes -f /etc/dcgm-exporter/default-counters.csv (a file of its image)."""
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        cfg = command.config_from_args(parse(["-f", "/etc/dcgm-exporter/default-counters.csv"]))
    assert cfg.counters is not None and "DCGM_FI_DEV_GPU_TEMP" in cfg.counters.names
    assert "absent from this image" in caplog.text
    from gpupipe.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read counters file"):
        command.config_from_args(parse(["-f", "/etc/dcgm-exporter/my-own.csv"]))
