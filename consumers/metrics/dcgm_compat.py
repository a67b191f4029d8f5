"""dcgm-exporter's command line and environment, accepted by ``gpupipe metrics`` (pure but for
``os.environ`` read once when the parser is built).

A DaemonSet or Helm values written for dcgm-exporter keep working: its flags and short flags are
aliases of ours (``-f/--collectors``, ``-a/--address`` for ``--listen``, ``-n/--no-hostname``,
``-x/--xid-count-window-size``, ``-o/--use-old-namespace``, ``-d/--devices``,
``--kubernetes-virtual-gpus``, ``--web-config-file``...), and its ``DCGM_EXPORTER_*`` environment
variables (plus ``KUBERNETES_VIRTUAL_GPUS``) set the same defaults as our ``GPUPIPE_*`` twins, which
win when both are set. Flags that only make sense next to a DCGM host engine (``-c`` collect
interval, ``-k`` kubernetes, ``-r`` remote host engine, ``-p``/``-s`` CPU and switch devices,
``--kubernetes-gpu-id-type``...) are accepted and ignored with one log line naming them: the node
agent does that job in gpupipe.

Listen addresses follow Go's ``net.Listen``: ``:9400`` (every address, IPv4 and IPv6),
``[::]:9400``, ``[2001:db8::1]:9400``, ``0.0.0.0:9400``, ``host:9400``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

from gpupipe.errors import ConfigError

log = logging.getLogger("gpupipe.metrics")

#: dcgm-exporter environment variable -> our option's dest.
DCGM_ENV: Mapping[str, str] = {
    "DCGM_EXPORTER_COLLECTORS": "collectors",
    "DCGM_EXPORTER_LISTEN": "listen",
    "DCGM_EXPORTER_WEB_CONFIG_FILE": "web_config_file",
    "DCGM_EXPORTER_NO_HOSTNAME": "no_hostname",
    "DCGM_EXPORTER_XID_COUNT_WINDOW_SIZE": "xid_count_window_size",
    "DCGM_EXPORTER_CLOCK_EVENTS_COUNT_WINDOW_SIZE": "clock_events_count_window_size",
    "DCGM_EXPORTER_USE_OLD_NAMESPACE": "use_old_namespace",
    "DCGM_EXPORTER_DEVICES_STR": "devices",
    "KUBERNETES_VIRTUAL_GPUS": "kubernetes_virtual_gpus",
}

#: dcgm-exporter flags with no meaning here: (long, short or None, takes a value).
IGNORED_FLAGS: tuple[tuple[str, str | None, bool], ...] = (
    ("--collect-interval", "-c", True),
    ("--kubernetes", "-k", False),
    ("--kubernetes-enable-pod-labels", None, False),
    ("--kubernetes-enable-pod-uid", None, False),
    ("--kubernetes-gpu-id-type", None, True),
    ("--kubernetes-pod-label-allowlist-regex", None, True),
    ("--remote-hostengine-info", "-r", True),
    ("--switch-devices", "-s", True),
    ("--cpu-devices", "-p", True),
    ("--fake-gpus", None, False),
    ("--configmap-data", "-m", True),
    ("--replace-blanks-in-model-name", None, False),
    ("--enable-dcgm-log", None, False),
    ("--dcgm-log-level", None, True),
    ("--pod-resources-kubelet-socket", None, True),
    ("--hpc-job-mapping-dir", None, True),
    ("--nvidia-resource-names", None, True),
    ("--kubernetes-enable-dra", None, False),
    ("--disable-startup-validate", None, False),
    ("--enable-pprof", None, False),
)

#: ``-d/--devices`` values -> our MIG layout (dcgm-exporter: f flex, g GPUs, i instances, g+i both).
DEVICES = {"f": "instances", "i": "instances", "g+i": "gpu+instances", "g": "gpu+instances"}


def add_ignored(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("dcgm-exporter flags accepted and ignored (no DCGM host engine here)")
    for long, short, value in IGNORED_FLAGS:
        names = [long, *([short] if short else [])]
        dest = "ignored_" + long.lstrip("-").replace("-", "_")
        if value:
            group.add_argument(*names, dest=dest, default=None, metavar="X", help=argparse.SUPPRESS)
        else:
            group.add_argument(
                *names,
                dest=dest,
                nargs="?",
                const="true",
                default=None,
                metavar="BOOL",
                help=argparse.SUPPRESS,
            )


def ignored_given(args: argparse.Namespace) -> list[str]:
    """The dcgm-exporter-only flags the command line used (for one log line)."""
    return [
        long
        for long, _, _ in IGNORED_FLAGS
        if getattr(args, "ignored_" + long.lstrip("-").replace("-", "_"), None)
    ]


def apply_dcgm_env(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """dcgm-exporter's environment variables as defaults (``GPUPIPE_*`` are applied later and win)."""
    env = os.environ if environ is None else environ
    by_dest = {a.dest: a for a in p._actions}
    for var, dest in DCGM_ENV.items():
        value = env.get(var)
        action = by_dest.get(dest)
        if value is None or action is None:
            continue
        if isinstance(action, argparse._StoreTrueAction | argparse.BooleanOptionalAction):
            action.default = value.strip().lower() in {"1", "true", "yes", "on"}
        else:
            action.default = value


#: Paths of dcgm-exporter's stock counters files inside its image (its Helm chart passes
#: ``-f /etc/dcgm-exporter/default-counters.csv``). Not in our image: they mean our default.
STOCK_CSVS = frozenset(
    {
        "/etc/dcgm-exporter/default-counters.csv",
        "/etc/dcgm-exporter/dcp-metrics-included.csv",
        "/etc/dcgm-exporter/1.x-compatibility-metrics.csv",
    }
)


def resolve_collectors(path: str | None) -> str | None:
    """The counters file to load: None (our shipped default) for a dcgm-exporter stock path that
    does not exist here, so its Helm chart's default arguments start the service; else ``path``."""
    if path in STOCK_CSVS and not os.path.exists(path):
        log.warning(
            "counters file %s is dcgm-exporter's stock file, absent from this image: using gpupipe's "
            "default (dcgm-exporter's default set plus what NVML gives; see default-counters.csv)",
            path,
        )
        return None
    return path


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as Go reads it: ``:9400`` (all addresses), ``[::]:9400``, ``[::1]:9400``,
    ``0.0.0.0:9400``. Returns ``("", port)`` for "all addresses" (dual-stack when possible)."""
    s = text.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"--listen expects [IPV6]:PORT, got {text!r}")
        port = rest[1:]
    else:
        host, sep, port = s.rpartition(":")
        if not sep:
            raise ConfigError(f"--listen expects HOST:PORT, got {text!r}")
        if ":" in host:
            raise ConfigError(f"--listen: put an IPv6 address in brackets, e.g. [::]:9400, got {text!r}")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen: bad port in {text!r}")
    return host, int(port)
