"""Prometheus text exposition of GpuSample records, dcgm-exporter style (pure: no I/O).

A :class:`Renderer` is built once from the selected counters (:class:`CounterSet`) and
:class:`RenderOptions`. Everything is rendered at ingest, in two parts:

* per GPU identity, a :class:`GpuView`: ``heads[i]`` = ``b'NAME{labels} '`` for family ``i``,
  encoded once and reused for every sample until the GPU's labels change (its pods, host,
  driver...);
* per sample, ``render(...) -> list[bytes]``, the GPU's *line list*: two slots per family, at
  ``2*i`` the head and at ``2*i + 1`` the value text with its line feed (``b'1980\\n'``); both
  ``b''`` when the family has no line for this GPU (a null or invalid value). Families with several
  lines for one GPU, or whose labels depend on the value (``DCGM_FI_DEV_XID_ERRORS`` carries
  ``err_code``/``err_msg``; the ``DCGM_EXP_*`` families; every family of a GPU with several series)
  have an empty head and their complete lines in the value slot.

A scrape then only concatenates ready bytes (see :mod:`gpupipe_consumers.metrics.store`).

Labels, in dcgm-exporter's order (``internal/pkg/rendermetrics`` template): ``gpu``, ``UUID``,
``pci_bus_id``, ``device`` (``nvidia<index>``), ``modelName``, for MIG instances ``GPU_I_PROFILE``
and ``GPU_I_ID``, the host label (``Hostname`` as dcgm-exporter up to 4.8.2, or ``hostname`` as
4.8.3; omitted when the host name is empty or the option is None), then the "Labels" map in sorted
key order (label rows such as ``DCGM_FI_DRIVER_VERSION``, then the ``DCGM_EXP_*`` labels
``window_size_in_ms``, ``xid``, ``clock_event``, ``health_*``), then the "Attributes" in sorted key
order: ``container``, ``err_code``, ``err_msg`` (XID family only), ``namespace``, ``pod``,
``pod_uid``, ``vgpu`` -- pod labels only when a pod holds the GPU. An HPC job holding it
(``--hpc-job-mapping-dir`` on the producer) gives ``hpc_job`` instead of pod labels, as
dcgm-exporter's HPC mapping does, one series per job. ``--use-old-namespace`` spells
them ``uuid``, ``container_name``, ``pod_name``, ``pod_namespace`` as dcgm-exporter 1.x.

Shared (time-sliced) GPUs, like dcgm-exporter:

* default: **one** series per GPU, labelled with one pod (dcgm-exporter keeps the last pod its
  device map sees; we take the last allocation of the sample), so sums over GPUs count each GPU
  once;
* ``virtual_gpus`` (dcgm-exporter's ``--kubernetes-virtual-gpus``): one copy of every series per
  allocation (``vgpu`` = the time-slicing replica), and for ``DCGM_FI_DEV_GPU_UTIL`` and
  ``DCGM_FI_DEV_FB_USED``, when the sample has per-process data, the device-wide series without
  pod labels plus one series per pod with its processes' share (``pod_uid`` empty: the kubelet
  API we read has no pod UID).

gpupipe's own per-pod share stays available under its own names, whatever the layout
(``split_shared``): on a GPU held by two or more containers, with per-process data,
``gpupipe_pod_gpu_util_percent`` (100 x sum of the pod's processes' ``sm_util_ratio``),
``gpupipe_pod_mem_copy_util_percent`` (``mem_util_ratio``) and ``gpupipe_pod_fb_used_mib``
(``used_memory_bytes``) per ``container, namespace, pod``; a pod without a process gets 0.

Values: DCGM int64 fields as integers (``%d``), DCGM doubles as ``%f`` (``612.500000``), the way
dcgm-exporter prints them; units per :mod:`gpupipe_consumers.metrics.fields`.

Invalid values never raise: NaN, +-Inf, negative numbers (except temperatures) and non-numbers
are dropped -- that series is absent from the scrape, as dcgm-exporter skips DCGM's blank values
-- and counted per (field, reason) in the ``invalid`` dict the caller passes
(``gpupipe_metrics_invalid_values_total``). Values above the nominal range (utilisation > 100 %,
ratios > 1) are exposed as they are, as dcgm-exporter would: no clamping hides a producer bug.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from gpupipe import pci
from gpupipe_consumers.metrics import derived
from gpupipe_consumers.metrics.collectors_csv import CounterSet
from gpupipe_consumers.metrics.fields import FieldSpec, Kind
from gpupipe_consumers.metrics.layout import SHARE_FAMILIES
from gpupipe_consumers.metrics.readings import PENDING, Kept, complete
from gpupipe_consumers.metrics.render_multi import render_multi, render_shares
from gpupipe_consumers.metrics.textfmt import (
    InvalidValue,
    attr_text,
    escape_help,
    escape_label_value,
    format_value,
)
from gpupipe_schemas.validate import reading_max

__all__ = [
    "GpuView",
    "InvalidValue",
    "RenderOptions",
    "Renderer",
    "escape_help",
    "escape_label_value",
    "format_value",
]

_INT, _ROUND, _PERCENT, _MIB, _FLOAT, _BOOL = (
    int(k) for k in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT, Kind.BOOL)
)
_HERTZ, _JOULES, _KIB = (int(k) for k in (Kind.HERTZ, Kind.JOULES, Kind.KIB))

SAMPLE_AGE_METRIC = "gpupipe_sample_age_seconds"
MIG_LAYOUTS = ("instances", "gpu+instances")


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """How series are labelled and laid out.

    ``host_label``: ``"Hostname"`` (dcgm-exporter up to 4.8.2, and what its dashboards query),
    ``"hostname"`` (4.8.3) or ``None`` (``--no-hostname``). ``split_shared``: gpupipe's per-pod
    share families. ``virtual_gpus``: dcgm-exporter's ``--kubernetes-virtual-gpus`` layout.
    ``old_namespace``: 1.x label names. ``xid_window_ms`` / ``clock_window_ms``: the windows of
    ``DCGM_EXP_XID_ERRORS_COUNT`` / ``DCGM_EXP_CLOCK_EVENTS_COUNT``. ``mig_layout``:
    ``instances`` (dcgm-exporter's default ``-d f``: a GPU in MIG mode is shown only as its
    instances, each with the parent's device-wide readings) or ``gpu+instances`` (``-d g+i``: the
    parent GPU's own series too). ``replace_blanks_in_model_name``: dcgm-exporter's
    ``--replace-blanks-in-model-name``, ``modelName="NVIDIA-H200"`` for ``NVIDIA H200``, which
    dashboards and rules written for that form match on. ``dra_labels``: dcgm-exporter's
    ``--kubernetes-enable-dra``, the ``dra_*`` labels on GPUs held through ResourceClaims.
    """

    host_label: str | None = "Hostname"
    split_shared: bool = True
    virtual_gpus: bool = False
    old_namespace: bool = False
    xid_window_ms: int = 300_000
    clock_window_ms: int = 300_000
    mig_layout: str = "instances"
    replace_blanks_in_model_name: bool = False
    dra_labels: bool = False


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of the exposition: its position, name, TYPE, HELP and header text."""

    index: int
    name: str
    prom_type: str
    help: str
    spec: FieldSpec | None
    share: str | None = None  # GpuProcess field of a gpupipe_pod_* share family

    @property
    def header(self) -> str:
        return f"# HELP {self.name} {escape_help(self.help)}\n# TYPE {self.name} {self.prom_type}\n"


Attrs = tuple[tuple[str, str], ...]


class GpuView:
    """The label strings of one GPU identity (rendered once, reused for every sample)."""

    __slots__ = (
        "age_head",
        "attr_texts",
        "attrs",
        "base",
        "heads",
        "multi",
        "series",
        "share_index",
        "share_pods",
        "template",
        "xid_lines",
    )

    def __init__(
        self,
        base: str,
        heads: tuple[bytes, ...],
        attrs: tuple[Attrs, ...],
        share_pods: tuple[tuple[str, str, str], ...],
        age_head: bytes,
    ) -> None:
        self.base = base  # identity labels and label rows, no pod labels
        self.heads = heads  # per family b"NAME{labels} "; b"" where the value carries whole lines
        self.template = [b""] * (2 * len(heads))  # a line list with every head and no value
        self.template[0::2] = heads
        self.attrs = attrs  # sorted attributes (pod labels...) per series; ((),) for one bare series
        self.attr_texts = tuple(attr_text(a) for a in attrs)
        self.series = tuple(base + t for t in self.attr_texts)  # label bodies, one per series
        self.multi = len(attrs) > 1
        self.age_head = age_head
        self.share_pods = share_pods  # distinct (namespace, pod, container) when >= 2, else ()
        idx: dict[tuple[str, ...], int] = {}
        for i, (ns, pod, ctr) in enumerate(share_pods):
            idx.setdefault((ns, pod, ctr), i)
            idx.setdefault((ns, pod), i)
        self.share_index = idx
        self.xid_lines: dict[int, bytes] = {}  # XID code -> DCGM_FI_DEV_XID_ERRORS lines (cache)

    @property
    def shared(self) -> bool:
        return len(self.share_pods) > 1

    def lines(self, name: str, labels: str, value: str) -> str:
        """One line per series: ``name{base<labels><attributes>} value`` (labels: ``,k="v"...``)."""
        b = self.base
        return "".join(f"{name}{{{b}{labels}{a}}} {value}\n" for a in self.attr_texts)


def _hpc_jobs(allocations: Sequence[Mapping[str, Any]] | None) -> tuple[str, ...]:
    """Distinct HPC job ids (``hpc_job``, from the producer's --hpc-job-mapping-dir), first-seen order."""
    out: dict[str, None] = {}
    for a in allocations or ():
        job = a.get("hpc_job")
        if job:
            out.setdefault(job, None)
    return tuple(out)


def _dra_attrs(a: Mapping[str, Any], mig: Mapping[str, Any] | None) -> dict[str, str]:
    """dcgm-exporter's DRA attributes of one claim allocation (``transformation/const.go``)."""
    out = {
        "dra_claim_name": a.get("claim_name") or "",
        "dra_claim_namespace": a.get("claim_namespace") or "",
        "dra_driver_name": a.get("resource_name") or "",
        "dra_pool_name": a.get("dra_pool") or "",
        "dra_device_name": a.get("dra_device") or "",
    }
    if mig is not None:
        out["dra_mig_profile"] = mig.get("profile") or ""
        out["dra_mig_device_uuid"] = mig.get("mig_uuid") or ""
    return out


def _distinct_pods(allocations: Sequence[Mapping[str, Any]] | None) -> tuple[tuple[str, str, str], ...]:
    """Distinct (namespace, pod, container), first-seen order (replicas of one container count once)."""
    out: dict[tuple[str, str, str], None] = {}
    for a in allocations or ():
        out.setdefault((a["namespace"], a["pod"], a["container"]), None)
    return tuple(out)


class Renderer:
    """Renders GpuSample records for one counters selection. Immutable; share it freely."""

    def __init__(self, counters: CounterSet, options: RenderOptions | None = None) -> None:
        self.counters = counters
        self.options = o = options or RenderOptions()
        if o.mig_layout not in MIG_LAYOUTS:
            raise ValueError(f"mig_layout must be one of {', '.join(MIG_LAYOUTS)}")
        fams = [Family(i, c.name, c.prom_type, c.help, c.spec) for i, c in enumerate(counters.metrics)]
        if o.split_shared:
            for name, src, _kind, help_ in SHARE_FAMILIES:
                fams.append(Family(len(fams), name, "gauge", help_, None, src))
        self.families: tuple[Family, ...] = tuple(fams)
        self.label_rows: tuple[FieldSpec, ...] = tuple(
            sorted((c.spec for c in counters.labels), key=lambda s: s.name)
        )
        self.label_sources: tuple[str, ...] = tuple(
            dict.fromkeys(s.source for s in self.label_rows if s.source)
        )
        self.with_driver = "driver_version" in self.label_sources
        self._identity = itemgetter(
            "hostname",
            "gpu_index",
            "uuid",
            "pci_bus_id",
            "model_name",
            "mig",
            "allocations",
            *self.label_sources,
        )
        self._uuid_label = "uuid" if o.old_namespace else "UUID"
        self._pod_names = (
            ("container_name", "pod_namespace", "pod_name")
            if o.old_namespace
            else ("container", "namespace", "pod")
        )
        plan = []
        exp_fams: dict[Kind, list[Family]] = {}
        for fam in self.families:
            if fam.spec is None:
                continue
            k = fam.spec.kind
            if k.exp:
                exp_fams.setdefault(k, []).append(fam)
            else:
                # the last item names the field as <= 4.8 did: the virtual-GPU split is keyed on it
                dcgm_name = fam.spec.renames or fam.spec.name
                plan.append((fam.spec.source, int(k), fam.spec.signed, fam.index, fam.name, dcgm_name))
        self._exp = {k: tuple(v) for k, v in exp_fams.items()}
        self._xid_last_fams = self._exp.get(Kind.XID_LAST, ())  # looked up once: render_xid is per GPU
        self._xid_total_fams = self._exp.get(Kind.XID_TOTAL, ())
        self.has_xid_count = Kind.XID_COUNT in self._exp
        self.has_clock_count = Kind.CLOCK_COUNT in self._exp
        self.has_clock_total = Kind.CLOCK_TOTAL in self._exp
        self.has_health = Kind.HEALTH in self._exp
        self._plan: tuple[tuple[str, int, bool, int, str, str], ...] = tuple(plan)
        self._share_fams = tuple(f for f in self.families if f.share)

        def group(kind: int, signed: bool | None = None) -> tuple[tuple[str, int], ...]:
            return tuple(
                (src, 2 * fi + 1)
                for src, k, sg, fi, *_ in plan
                if k == kind and (signed is None or sg == signed)
            )

        # the fast path's loops, one per kind, in _render_fast's order
        self._groups = (
            group(_INT),
            group(_FLOAT),
            group(_PERCENT),
            group(_ROUND, signed=False),
            group(_ROUND, signed=True),
            group(_MIB),
            group(_BOOL),
            group(_HERTZ),
            group(_JOULES),
            group(_KIB),
        )
        handled = {_INT, _FLOAT, _PERCENT, _ROUND, _MIB, _BOOL, _HERTZ, _JOULES, _KIB}
        if any(k not in handled or (sg and k != _ROUND) for _, k, sg, *_ in plan):  # a new Kind in fields.py
            raise ValueError("render plan: a field kind or sign that _render_fast does not handle")
        self._n = len(self.families)
        # readings with a bound of their own, checked after the per-kind loops of the fast path
        self._upper = {src: hi for src, *_ in plan if (hi := reading_max(src)) is not None}
        self._bounded = tuple(self._upper.items())

    def needed_fields(self) -> set[str]:
        """GpuSample fields the exposition reads by key (others are read with ``.get``); a decoder
        may project the record to these plus :data:`OPTIONAL_FIELDS`."""
        return {
            "timestamp_ms",
            "hostname",
            "gpu_index",
            "uuid",
            "pci_bus_id",
            "model_name",
            "mig",
            "allocations",
            *self.label_sources,
            *(src for src, *_ in self._plan),
        }

    @property
    def value_plan(self) -> tuple[tuple[str, int, bool, int, str, str], ...]:
        """Per plain-value family: (sample field, kind, signed, family index, name, DCGM name)."""
        return self._plan

    def exp_families(self, kind: Kind) -> tuple[Family, ...]:
        return self._exp.get(kind, ())

    # -- identity --------------------------------------------------------------------------------
    def identity(self, rec: Mapping[str, Any]) -> tuple:
        """What the label strings depend on; a new view is needed only when this changes (one C
        call: this runs for every sample)."""
        return self._identity(rec)

    def identity_getter(self) -> Any:
        """:meth:`identity` as the bare C callable (no method call per sample)."""
        return self._identity

    def _base(
        self,
        gpu_index: int | None,
        uuid: str,
        pci_bus_id: str,
        model_name: str | None,
        mig: Mapping[str, Any] | None,
        hostname: str | None,
        label_values: Mapping[str, Any],
    ) -> str:
        parts = []
        if gpu_index is not None:
            parts.append(f'gpu="{gpu_index}"')
        parts.append(f'{self._uuid_label}="{escape_label_value(uuid)}"')
        parts.append(f'pci_bus_id="{escape_label_value(pci_bus_id)}"')
        if gpu_index is not None:
            parts.append(f'device="nvidia{gpu_index}"')
        if model_name is not None:
            if self.options.replace_blanks_in_model_name:
                model_name = model_name.replace(" ", "-")
            parts.append(f'modelName="{escape_label_value(model_name)}"')
        if mig is not None:
            parts.append(f'GPU_I_PROFILE="{escape_label_value(mig["profile"])}"')
            parts.append(f'GPU_I_ID="{mig["gpu_instance_id"]}"')
        host = self.options.host_label
        if host and hostname:
            parts.append(f'{host}="{escape_label_value(hostname)}"')
        for spec in self.label_rows:  # sorted by name, like dcgm-exporter's Labels map
            v = label_values.get(spec.source) if spec.source else None
            if v not in (None, ""):  # dcgm-exporter skips blank values
                parts.append(f'{spec.name}="{escape_label_value(v)}"')
        return ",".join(parts)

    def pod_attrs(self, ns: str, pod: str, ctr: str, **extra: str) -> Attrs:
        c, n, p = self._pod_names
        return tuple(sorted(((c, ctr), (n, ns), (p, pod), *extra.items())))

    def _make_view(
        self,
        base: str,
        allocations: Sequence[Mapping[str, Any]] | None,
        mig: Mapping[str, Any] | None = None,
    ) -> GpuView:
        o = self.options
        pods = _distinct_pods(allocations)
        share = pods if o.split_shared and len(pods) > 1 else ()
        # As dcgm-exporter's HPC mapping: a series per HPC job, with an hpc_job label and no pod labels.
        jobs = _hpc_jobs(allocations)
        job_attrs: tuple[Attrs, ...] = tuple((("hpc_job", j),) for j in jobs)
        if jobs:
            allocations = [a for a in allocations or () if not a.get("hpc_job")]
        claims = [a for a in allocations or () if a.get("claim_name")] if o.dra_labels else []
        if not allocations:
            attrs: tuple[Attrs, ...] = job_attrs or ((),)
        elif claims and not o.virtual_gpus:
            # As dcgm-exporter with --kubernetes-enable-dra: one series per container holding the
            # device through a claim (the first claim of a container wins), device-plugin holders
            # of the same GPU not shown; its virtual-GPU layout has no DRA labels at all.
            held: dict[tuple[str, str, str], Mapping[str, Any]] = {}
            for a in claims:
                held.setdefault((a["namespace"], a["pod"], a["container"]), a)
            attrs = tuple(
                self.pod_attrs(ns, pod, ctr, **_dra_attrs(a, mig)) for (ns, pod, ctr), a in held.items()
            )
        elif o.virtual_gpus:
            seen: dict[tuple, None] = {}
            for a in allocations:
                seen.setdefault((a["namespace"], a["pod"], a["container"], a.get("replica")), None)
            attrs = tuple(
                self.pod_attrs(ns, pod, ctr, **({} if rep is None else {"vgpu": str(rep)}))
                for ns, pod, ctr, rep in seen
            )
        else:  # dcgm-exporter's default: one PodInfo per device, the last one wins
            a = allocations[-1]
            attrs = (self.pod_attrs(a["namespace"], a["pod"], a["container"]),)
        if jobs and allocations:
            attrs = (*attrs, *job_attrs)
        age_head = f"{SAMPLE_AGE_METRIC}{{{base}}} ".encode()
        if len(attrs) == 1:
            labels = base + attr_text(attrs[0])
            heads = tuple(
                b"" if f.spec is None or f.spec.kind.exp else f"{f.name}{{{labels}}} ".encode()
                for f in self.families
            )
        else:
            heads = (b"",) * self._n
        return GpuView(base, heads, attrs, share, age_head)

    def base_view(self, view: GpuView) -> GpuView:
        """The same GPU without pod labels (its sample is gone; its XID counters stay)."""
        return self._make_view(view.base, ())

    def view(self, rec: Mapping[str, Any]) -> GpuView:
        """Label strings of the GPU (or MIG instance) a sample describes."""
        base = self._base(
            rec["gpu_index"],
            rec["uuid"],
            rec["pci_bus_id"],
            rec["model_name"],
            rec["mig"],
            rec["hostname"],
            {s: rec[s] for s in self.label_sources},
        )
        return self._make_view(base, rec["allocations"], rec["mig"])

    def event_view(self, event: Mapping[str, Any], uuid: str) -> GpuView:
        """Labels for a GPU known only from gpu.xid events (no sample yet), from the event's identity
        and pods: the same series as once its first sample comes, when the event knows the GPU (the
        node agent fills index, model, driver and pods from its inventory)."""
        values = {
            "driver_version": event.get("driver_version"),
            "uuid": uuid,
            "model_name": event.get("model_name"),
        }
        bus = pci.nvml_form(event.get("pci_bus_id") or "")
        values["pci_bus_id"] = bus
        base = self._base(
            event.get("gpu_index"),
            uuid,
            bus,
            event.get("model_name"),
            None,
            event.get("hostname"),
            values,
        )
        return self._make_view(base, event.get("allocations") or ())

    # -- values ----------------------------------------------------------------------------------
    def render(
        self,
        rec: Mapping[str, Any],
        view: GpuView,
        xid_last: int | None,
        xid_counts: Mapping[int, int] | None,
        invalid: dict[tuple[str, str], int],
        prev: Kept | None = None,
    ) -> list[bytes]:
        """The GPU's line list (see the module doc); bad values are counted in ``invalid``.
        The ``DCGM_EXP_*`` window/health families are filled by :meth:`render_exp`.

        A record whose readings are pending (:mod:`gpupipe_consumers.metrics.readings`) is rendered from
        their bytes; ``prev`` (:meth:`Readings.kept <gpupipe_consumers.metrics.readings.Readings.kept>`) is
        the GPU's previous render of such a record, whose value text is kept for readings with the
        same bytes."""
        pending = rec.get(PENDING)
        if view.multi:
            rec = complete(rec)
            out = render_multi(self, rec, view, invalid)
        else:
            try:
                if pending is not None:
                    out = pending.lines(rec, view.template, prev)
                else:
                    out = self._render_fast(rec, view)
            except (ValueError, TypeError, OverflowError):  # UnusualValue is a ValueError
                rec = complete(rec)
                out = self._render_checked(rec, view, invalid)
        self.render_xid(view, xid_last, xid_counts, out)
        if view.share_pods:
            render_shares(self, rec, view, out, invalid)
        return out

    def _render_fast(self, rec: Mapping[str, Any], view: GpuView) -> list[bytes]:
        """The hot path: one loop per kind, no per-value dispatch; ``j`` is the value slot.

        Raises on anything unusual (a negative, NaN or Inf value, a value of an unexpected type);
        the caller then renders the whole record with :meth:`_render_checked`, whose output is the
        same for good values and which counts the bad ones."""
        out = view.template.copy()  # every head; a null clears its head
        ints, floats, percents, rounds, signed_rounds, mibs, bools, hertz, joules, kib = self._groups
        for src, j in ints:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0 or type(v) is not int:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % v
        for src, j in floats:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0 or v - v:  # v - v is NaN (truthy) for NaN and +-Inf
                raise ValueError(src)
            else:
                out[j] = b"%f\n" % v
        for src, j in percents:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % round(v * 100)  # round(NaN) raises ValueError, round(Inf) OverflowError
        for src, j in rounds:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % round(v)
        for src, j in signed_rounds:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            else:
                out[j] = b"%d\n" % round(v)
        for src, j in mibs:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % (v >> 20)  # a float raises TypeError
        for src, j in bools:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif type(v) is not bool:
                raise ValueError(src)
            else:
                out[j] = b"1\n" if v else b"0\n"
        for src, j in hertz:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0 or type(v) is not int:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % (v * 1_000_000)
        for src, j in joules:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0 or type(v) is not int:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % (v // 1000)
        for src, j in kib:
            v = rec[src]
            if v is None:
                out[j - 1] = b""
            elif v < 0 or type(v) is not int:
                raise ValueError(src)
            else:
                out[j] = b"%d\n" % (v * 1024)
        for src, hi in self._bounded:
            v = rec[src]
            if v is not None and not -hi <= v <= hi:
                raise ValueError(src)
        return out

    def _render_checked(
        self, rec: Mapping[str, Any], view: GpuView, invalid: dict[tuple[str, str], int]
    ) -> list[bytes]:
        """The reference path: every value through :func:`format_value`, bad ones counted."""
        out = view.template.copy()
        for src, kind, signed, fi, name, _ in self._plan:
            v = rec[src]
            try:
                if v is None:
                    raise InvalidValue("")
                out[2 * fi + 1] = f"{format_value(kind, v, signed, self._upper.get(src))}\n".encode()
            except InvalidValue as bad:
                out[2 * fi] = b""
                if bad.reason:
                    key = (name, bad.reason)
                    invalid[key] = invalid.get(key, 0) + 1
        return out

    def render_xid_only(
        self, view: GpuView, xid_last: int | None, xid_counts: Mapping[int, int] | None
    ) -> list[bytes]:
        """The line list of a GPU known only from gpu.xid events: the XID families."""
        out = [b""] * (2 * self._n)
        self.render_xid(view, xid_last, xid_counts, out)
        return out

    def _xid_line(self, fam: Family, view: GpuView, code: int) -> bytes:
        key = code if fam.index == 0 else (fam.index, code)
        got = view.xid_lines.get(key)  # type: ignore[arg-type]
        if got is None:
            err = (("err_code", str(code)), ("err_msg", derived.xid_message(code)))
            b = view.base
            got = "".join(
                f"{fam.name}{{{b}{attr_text(tuple(sorted((*a, *err))))}}} {code:d}\n" for a in view.attrs
            ).encode()
            if len(view.xid_lines) < 64:
                view.xid_lines[key] = got  # type: ignore[index]
        return got

    def render_xid(
        self,
        view: GpuView,
        xid_last: int | None,
        xid_counts: Mapping[int, int] | None,
        out: list[bytes],
    ) -> None:
        """Fill the XID families of a line list in place (after a gpu.xid event, say).

        ``DCGM_FI_DEV_XID_ERRORS`` (last XID, with ``err_code``/``err_msg``) and 4.8.3's
        ``DCGM_EXP_XID_ERRORS_TOTAL{xid}`` (codes seen since start, on every series of the GPU,
        pod labels included)."""
        for fam in self._xid_last_fams:
            j = 2 * fam.index
            out[j] = b""
            out[j + 1] = b"" if xid_last is None else self._xid_line(fam, view, xid_last)
        for fam in self._xid_total_fams:
            out[2 * fam.index + 1] = (
                "".join(
                    view.lines(fam.name, f',xid="{c}"', str(n)) for c, n in sorted(xid_counts.items())
                ).encode()
                if xid_counts
                else b""
            )

    def render_exp(
        self,
        view: GpuView,
        out: list[bytes],
        *,
        xid_window: Mapping[int, int] | None = None,
        clock_window: Mapping[int, int] | None = None,
        clock_totals: Mapping[int, int] | None = None,
        health: derived.Health | None = None,
    ) -> None:
        """Fill the ``DCGM_EXP_*`` window, clock and health families in place (see :mod:`derived`).

        A ``None`` argument leaves that family empty (no sample yet for clock and health)."""
        o = self.options
        for fam in self._exp.get(Kind.XID_COUNT, ()):
            w = f',window_size_in_ms="{o.xid_window_ms}"'
            if xid_window is None:
                text = ""
            elif xid_window:
                text = "".join(
                    view.lines(fam.name, f'{w},xid="{c}"', str(n)) for c, n in sorted(xid_window.items())
                )
            else:
                text = view.lines(fam.name, w, "0")
            out[2 * fam.index + 1] = text.encode()
        for fam in self._exp.get(Kind.CLOCK_COUNT, ()):
            w = f'window_size_in_ms="{o.clock_window_ms}"'
            if clock_window is None:
                text = ""
            elif clock_window:
                text = "".join(
                    view.lines(fam.name, f',clock_event="{derived.CLOCK_EVENT_NAME[b]}",{w}', str(n))
                    for b, n in sorted(clock_window.items())
                )
            else:
                text = view.lines(fam.name, "," + w, "0")
            out[2 * fam.index + 1] = text.encode()
        for fam in self._exp.get(Kind.CLOCK_TOTAL, ()):
            out[2 * fam.index + 1] = (
                "".join(
                    view.lines(fam.name, f',clock_event="{derived.CLOCK_EVENT_NAME[b]}"', str(n))
                    for b, n in sorted(clock_totals.items())
                ).encode()
                if clock_totals
                else b""
            )
        for fam in self._exp.get(Kind.HEALTH, ()):
            out[2 * fam.index + 1] = (
                "".join(
                    view.lines(fam.name, f',health_error_code="{code}",health_watch="{w}"', str(v))
                    for w, v, code in health
                ).encode()
                if health is not None
                else b""
            )
