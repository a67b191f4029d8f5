"""dcgm-exporter's flags, short flags and environment variables work for `gpupipe metrics`.

Before: `-f`, `-a`, `-n`, `-x`, `--kubernetes-virtual-gpus`, `DCGM_EXPORTER_*`... were rejected, so
container args copied from a dcgm-exporter DaemonSet failed.
"""

from __future__ import annotations

import argparse
import logging

import pytest

from gpupipe.commands.cli import add_common, apply_env_defaults
from gpupipe_consumers.metrics import command, dcgm_compat
from gpupipe_consumers.metrics.collectors_csv import parse_counters
from tests.paths import TESTS

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
        "KUBERNETES_ENABLE_DRA": "true",
        "DCGM_EXPORTER_NO_HOSTNAME": "1",
    }
    cfg = command.config_from_args(parse([], env))
    assert (cfg.host, cfg.port) == ("", 9500)
    assert cfg.counters is not None and cfg.counters.names == ("DCGM_FI_DEV_GPU_TEMP",)
    assert cfg.render is not None and cfg.render.xid_window_ms == 120000 and cfg.render.virtual_gpus
    assert cfg.render.host_label is None and cfg.render.dra_labels
    # our own GPUPIPE_* twin wins over dcgm-exporter's variable; a flag wins over both
    cfg = command.config_from_args(parse([], {**env, "GPUPIPE_LISTEN": "127.0.0.1:9600"}))
    assert (cfg.host, cfg.port) == ("127.0.0.1", 9600)
    cfg = command.config_from_args(parse(["-a", ":9700"], {**env, "GPUPIPE_LISTEN": "127.0.0.1:9600"}))
    assert cfg.port == 9700


def test_defaults_match_dcgm_exporter():
    cfg = command.config_from_args(parse([]))
    assert (cfg.host, cfg.port) == ("", 9400)  # Go's ":9400": IPv4 and IPv6 (was 0.0.0.0: IPv4 only)
    o = cfg.render
    assert o is not None
    assert (o.host_label, o.virtual_gpus, o.mig_layout, o.xid_window_ms, o.dra_labels) == (
        "Hostname",
        False,
        "instances",
        300000,
        False,
    )


@pytest.mark.parametrize("argv", [["-x", "0"], ["--clock-events-count-window-size", "-5"]])
def test_bad_windows(argv):
    from gpupipe.common.errors import ConfigError

    with pytest.raises(ConfigError):
        command.config_from_args(parse(argv))


FIX = TESTS / "fixtures" / "metrics" / "dcgm-exporter"


@pytest.mark.parametrize(
    ("argv", "env", "fixture"),
    [
        # its Helm chart's default arguments
        (["-f", "/etc/dcgm-exporter/default-counters.csv"], {}, "default-counters-4.8.2.csv"),
        # the GPU Operator's environment
        (
            [],
            {"DCGM_EXPORTER_COLLECTORS": "/etc/dcgm-exporter/dcp-metrics-included.csv"},
            "dcp-metrics-included-4.8.2.csv",
        ),
        (["-f", "/etc/dcgm-exporter/1.x-compatibility-metrics.csv"], {}, "1.x-compatibility-metrics.csv"),
    ],
)
def test_dcgm_exporter_stock_paths_read_its_own_files(argv, env, fixture):
    """dcgm-exporter's stock files are not in our image: their paths read our verbatim copies, so the
    series are the ones dcgm-exporter 4.8.2 gives (TYPE counter of NVLINK_BANDWIDTH_TOTAL, no
    gpupipe extras). Before: gpupipe's own default, with other families and that TYPE as gauge."""
    cfg = command.config_from_args(parse(argv, env))
    want = parse_counters((FIX / fixture).read_text())
    assert cfg.counters is not None
    assert [(c.name, c.prom_type, c.help) for c in cfg.counters.metrics] == [
        (c.name, c.prom_type, c.help) for c in want.metrics
    ]
    assert [c.name for c in cfg.counters.labels] == [c.name for c in want.labels]
    from gpupipe.common.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read counters file"):
        command.config_from_args(parse(["-f", "/etc/dcgm-exporter/my-own.csv"]))


def test_helm_chart_debug_dump_and_go_style_flags(caplog):
    """Arguments dcgm-exporter's chart adds (debugDump) and Go's flag forms (--flag=true/false) work."""
    argv = [
        "--dump-enabled",
        "--dump-directory=/tmp/dcgm-exporter-debug",
        "--dump-retention=24",
        "--dump-compression",
        "--web-systemd-socket",
        "--debug",
        "-rbmn",
        "--no-hostname=false",
        "--kubernetes-virtual-gpus=true",
        "-o=false",
        "--log-format",
        "text",
    ]
    with caplog.at_level(logging.INFO, logger="gpupipe.metrics"):
        args = parse(argv)
        cfg = command.config_from_args(args)
    o = cfg.render
    assert o is not None and o.host_label == "Hostname" and o.virtual_gpus and not o.old_namespace
    assert args.log_format == "text"  # gpupipe's own --log-format takes dcgm-exporter's values
    for flag in (
        "--dump-enabled",
        "--dump-directory",
        "--web-systemd-socket",
    ):
        assert flag in caplog.text
    assert o.replace_blanks_in_model_name and "--replace-blanks-in-model-name" not in caplog.text
    with pytest.raises(SystemExit):
        parse(["--no-hostname=maybe"])


@pytest.mark.parametrize(
    ("devices", "layout", "warns"),
    [
        ("f", "instances", False),
        ("g+i", "gpu+instances", False),
        ("g:0-3", "gpu+instances", True),
        ("i", "instances", True),
        ("g:0,2+i:1", "gpu+instances", True),
    ],
)
def test_devices_syntax(devices, layout, warns, caplog):
    """dcgm-exporter's -d syntax, its chart's example -d g:0-3 included (choices f/i/g/g+i before)."""
    with caplog.at_level(logging.WARNING, logger="gpupipe.metrics"):
        o = command.config_from_args(parse(["-d", devices])).render
    assert o is not None and o.mig_layout == layout
    assert bool(caplog.records) == warns


def test_bad_devices():
    from gpupipe.common.errors import ConfigError

    with pytest.raises(ConfigError, match="-d/--devices"):
        command.config_from_args(parse(["-d", "x"]))


@pytest.mark.parametrize(
    ("argv", "env", "model"),
    [
        ([], {}, "NVIDIA H200 NVL"),
        (["-rbmn"], {}, "NVIDIA-H200-NVL"),
        (["--replace-blanks-in-model-name=true"], {}, "NVIDIA-H200-NVL"),
        ([], {"DCGM_EXPORTER_REPLACE_BLANKS_IN_MODEL_NAME": "true"}, "NVIDIA-H200-NVL"),
    ],
)
def test_replace_blanks_in_model_name(argv, env, model):
    """dcgm-exporter's -rbmn rewrites modelName; it was accepted and ignored, so dashboards and
    rules written for NVIDIA-H200 matched nothing."""
    from gpupipe_consumers.metrics.store import SeriesStore
    from tests.unit.consumers.metrics.test_store import blank, lines_of

    o = command.config_from_args(parse(argv, env)).render
    store = SeriesStore(options=o)
    store.apply_sample(blank(model_name="NVIDIA H200 NVL"), 0, 100.0)
    store.apply_xid({**_xid_only_event(), "model_name": "NVIDIA H200 NVL"}, 0, 100.0)
    text = store.render(100.0).decode()
    lines = lines_of(text, "DCGM_FI_DEV_GPU_TEMP") + lines_of(text, "DCGM_FI_DEV_XID_ERRORS")
    assert lines and all(f'modelName="{model}"' in ln for ln in lines), lines


def _xid_only_event() -> dict:
    from tests.unit.consumers.metrics.test_store import xid

    return xid(13, uuid="GPU-xid-only")
