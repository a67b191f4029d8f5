"""dcgm-exporter's command line and environment, accepted by ``gpupipe metrics`` (pure but for
``os.environ`` read once when the parser is built).

A DaemonSet or Helm values written for dcgm-exporter keep working: its flags and short flags are
aliases of ours (``-f/--collectors``, ``-a/--address`` for ``--listen``, ``-n/--no-hostname``,
``-x/--xid-count-window-size``, ``-o/--use-old-namespace``, ``-d/--devices``,
``-rbmn/--replace-blanks-in-model-name``,
``--kubernetes-virtual-gpus``, ``--web-config-file``...), and its ``DCGM_EXPORTER_*`` environment
variables (plus ``KUBERNETES_VIRTUAL_GPUS``) set the same defaults as our ``GPUPIPE_*`` twins, which
win when both are set. Flags that only make sense next to a DCGM host engine (``-c`` collect
interval, ``-k`` kubernetes, ``-r`` remote host engine, ``-p``/``-s`` CPU and switch devices,
``--kubernetes-gpu-id-type``, its chart's ``--dump-*``...) are accepted and ignored with one log line
naming them: the node agent does that job in gpupipe. Boolean flags take Go's ``--flag=false`` form
too; Go's single-dash long form (``-collectors``) is not accepted. dcgm-exporter's stock counters
paths (``/etc/dcgm-exporter/*.csv``) read verbatim copies of its 4.8.2 files when absent here.

Listen addresses follow Go's ``net.Listen``: ``:9400`` (every address, IPv4 and IPv6),
``[::]:9400``, ``[2001:db8::1]:9400``, ``0.0.0.0:9400``, ``host:9400``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping
from importlib import resources

from gpupipe.common.errors import ConfigError

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
    "DCGM_EXPORTER_REPLACE_BLANKS_IN_MODEL_NAME": "replace_blanks_in_model_name",
    "KUBERNETES_VIRTUAL_GPUS": "kubernetes_virtual_gpus",
    "KUBERNETES_ENABLE_DRA": "kubernetes_enable_dra",
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
    ("--enable-dcgm-log", None, False),
    ("--dcgm-log-level", None, True),
    ("--pod-resources-kubelet-socket", None, True),
    ("--hpc-job-mapping-dir", None, True),
    ("--nvidia-resource-names", None, True),
    ("--disable-startup-validate", None, False),
    ("--enable-pprof", None, False),
    ("--web-systemd-socket", None, False),
    ("--debug", None, False),
    # its Helm chart's debugDump values add these
    ("--dump-enabled", None, False),
    ("--dump-directory", None, True),
    ("--dump-retention", None, True),
    ("--dump-compression", None, False),
    ("--enable-gpu-bind-unbind-watch", None, False),
    ("--gpu-bind-unbind-poll-interval", None, True),
)

#: dcgm-exporter's -d syntax: ``f`` or ``[g[:range]][+][i[:range]]`` (range: ``0-3``, ``0,2,4``).
_DEVICES_RE = re.compile(r"^(?:f|(?P<g>g(?::[\d,-]+)?)?\+?(?P<i>i(?::[\d,-]+)?)?)$")
TRUE_WORDS = frozenset({"1", "t", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "f", "false", "no", "off"})


def mig_layout_for(devices: str) -> str:
    """Our MIG layout for a dcgm-exporter ``-d`` value, saying (in the log) what it cannot do:
    GPU/instance ranges (every GPU is shown), ``g`` alone (MIG GPUs keep their instance series) and
    ``i`` alone (GPUs without MIG keep theirs)."""
    m = _DEVICES_RE.match(devices.strip())
    if m is None or not devices.strip():
        raise ConfigError(f"-d/--devices: {devices!r} is not dcgm-exporter's f or [g[:range]][+][i[:range]]")
    g, i = m["g"], m["i"]
    if (g and ":" in g) or (i and ":" in i):
        log.warning("-d %s: GPU and instance ranges are ignored; every GPU of the stream is shown", devices)
    if g and not i:
        log.warning("-d %s: MIG GPUs are shown with their instances too (as -d g+i)", devices)
        return "gpu+instances"
    if i and not g:
        log.warning("-d %s: GPUs without MIG are shown too (as -d f)", devices)
    return "gpu+instances" if g and i else "instances"


class GoBool(argparse._StoreTrueAction):
    """A boolean flag that also takes Go's explicit form, as dcgm-exporter's (urfave/cli) do:
    ``-n``, ``--no-hostname=true``, ``--no-hostname=false``."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        super().__init__(option_strings, dest, **kw)  # type: ignore[arg-type]
        self.nargs = "?"

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        if values is None:
            setattr(namespace, self.dest, True)
            return
        word = str(values).strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            parser.error(f"{option_string}: expected true or false, got {values!r}")
        setattr(namespace, self.dest, word in TRUE_WORDS)


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


#: dcgm-exporter's stock counters files, at their path inside its image (its Helm chart passes
#: ``-f /etc/dcgm-exporter/default-counters.csv``, the GPU Operator sets
#: ``DCGM_EXPORTER_COLLECTORS=/etc/dcgm-exporter/dcp-metrics-included.csv``) -> our copy of that file
#: (package data: ``etc/*.csv`` of dcgm-exporter tag 4.5.3-4.8.2, verbatim).
STOCK_CSVS: Mapping[str, str] = {
    "/etc/dcgm-exporter/default-counters.csv": "dcgm-exporter-default-counters.csv",
    "/etc/dcgm-exporter/dcp-metrics-included.csv": "dcgm-exporter-dcp-metrics-included.csv",
    "/etc/dcgm-exporter/1.x-compatibility-metrics.csv": "dcgm-exporter-1.x-compatibility-metrics.csv",
}


def resolve_collectors(path: str | None) -> str | None:
    """The counters file to load: a dcgm-exporter stock path that does not exist here (our image
    has no /etc/dcgm-exporter) reads our copy of that very file, so its chart's and the GPU Operator's
    defaults give the series dcgm-exporter 4.8.2 gives; a file mounted there (the chart's ConfigMap)
    is read as it is; None is gpupipe's default."""
    if path in STOCK_CSVS and not os.path.exists(path):
        copy = str(resources.files("gpupipe_consumers.metrics").joinpath(STOCK_CSVS[path]))
        log.info("counters file %s (dcgm-exporter's stock file) read from gpupipe's copy %s", path, copy)
        return copy
    return path
