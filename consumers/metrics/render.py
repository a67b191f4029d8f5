"""Prometheus text exposition of GpuSample records, dcgm-exporter style (pure: no I/O).

A :class:`Renderer` is built once from the selected counters (:class:`CounterSet`) and
:class:`RenderOptions`. Everything is rendered at ingest, in two parts:

* per GPU identity, a :class:`GpuView`: ``heads[i]`` = ``b'NAME{labels} '`` for family ``i``,
  encoded once and reused for every sample until the GPU's labels change (its pods, host,
  driver...);
* per sample, ``render(...) -> list[bytes]``, the GPU's *line list*: two slots per family, at
  ``2*i`` the head and at ``2*i + 1`` the value text with its line feed (``b'1980\n'``); both
  ``b''`` when the family has no line for this GPU (a null or invalid value). Families with several
  lines for one GPU (shared GPUs, the XID counter per code) have an empty head and their complete
  lines in the value slot.

A scrape then only concatenates ready bytes: for family ``i``, slots ``2*i`` and ``2*i + 1`` of
every GPU's line list (``chain.from_iterable(map(itemgetter(2*i, 2*i + 1), line_lists))``, C
loops only; see :mod:`consumers.metrics.store`). Keeping the ~250-byte label head out of the
per-sample work makes ingest cost one short ``b'%d\n'`` per value instead of a fresh 260-byte
line, and the empty slots of absent lines cost nothing in the join.

Labels, in dcgm-exporter's order (``internal/pkg/rendermetrics`` template): ``gpu``, ``UUID``,
``pci_bus_id``, ``device`` (``nvidia<index>``), ``modelName``, for MIG slices ``GPU_I_PROFILE`` and
``GPU_I_ID``, the host label (``Hostname``, or ``hostname`` as dcgm-exporter main spells it since
#655; omitted when the host name is empty or the option is None), then the "Labels" map in sorted
key order (label rows such as ``DCGM_FI_DRIVER_VERSION``; ``xid`` on the XID counter), then the
"Attributes" in sorted key order: ``container``, ``namespace``, ``pod`` -- only when a pod holds
the GPU (an unallocated GPU has no pod labels at all, as current dcgm-exporter); an HPC job holding
it (``--hpc-job-mapping-dir`` on the producer) gives ``hpc_job`` instead, as dcgm-exporter's HPC
mapping does, one series per job. For a MIG slice
``UUID`` is the parent GPU's UUID (as dcgm-exporter) and ``gpu``/``device`` the parent's index.

Values: DCGM int64 fields as integers (``%d``), DCGM doubles as ``%f`` (``612.500000``), the way
dcgm-exporter prints them; units per :mod:`consumers.metrics.fields`.

Shared GPUs (two or more distinct ``(namespace, pod, container)`` in ``allocations``; replicas of
one container count once): one series per container holding the GPU, for every family. Split by
the pod's own share, when the sample has per-process data (``processes[]`` resolved to pods):

* ``DCGM_FI_DEV_GPU_UTIL`` = 100 x sum of the pod's processes' ``sm_util_ratio``,
* ``DCGM_FI_DEV_MEM_COPY_UTIL`` = 100 x sum of their ``mem_util_ratio``,
* ``DCGM_FI_DEV_FB_USED`` = sum of their ``used_memory_bytes`` in MiB;

a pod without processes gets 0, and the device-wide value is kept as one more series without pod
labels (as dcgm-exporter's per-process mode, PR #594). A process is matched to the allocation with
its namespace, pod and container, else to the first allocation of its pod; unresolved processes
only count in the device value. Without per-process data for a field (no process reports it),
that field is repeated per pod like every other family: power, clocks, temperatures, ECC,
profiling ratios, XID... are device properties that NVML cannot split.

Invalid values never raise: NaN, +-Inf, negative numbers (except temperatures) and non-numbers
are dropped -- that series is absent from the scrape, as dcgm-exporter skips DCGM's blank values
-- and counted per (field, reason) in the ``invalid`` dict the caller passes
(``gpupipe_metrics_invalid_values_total``). Values above the nominal range (utilisation > 100 %,
ratios > 1) are exposed as they are, as dcgm-exporter would: no clamping hides a producer bug.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from consumers.metrics.collectors_csv import CounterSet
from consumers.metrics.fields import FieldSpec, Kind

_INT, _ROUND, _PERCENT, _MIB, _FLOAT, _BOOL = (
    int(k) for k in (Kind.INT, Kind.ROUND, Kind.PERCENT, Kind.MIB, Kind.FLOAT, Kind.BOOL)
)
_INF = float("inf")

SAMPLE_AGE_METRIC = "gpupipe_sample_age_seconds"


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """How series are labelled.

    ``host_label``: ``"Hostname"`` (dcgm-exporter up to 4.5.3-4.8.2, and what its dashboards
    query), ``"hostname"`` (dcgm-exporter main after #655) or ``None`` (no host label, like
    ``--no-hostname``). ``split_shared``: per-pod shares on shared GPUs (see module doc); when
    False every family is repeated per pod with the device value.
    """

    host_label: str | None = "Hostname"
    split_shared: bool = True


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of the exposition: its position, name, TYPE, HELP and header text."""

    index: int
    name: str
    prom_type: str
    help: str
    spec: FieldSpec

    @property
    def header(self) -> str:
        return f"# HELP {self.name} {escape_help(self.help)}\n# TYPE {self.name} {self.prom_type}\n"


class InvalidValue(ValueError):
    """A value that cannot be exposed; ``reason`` is nan | inf | negative | invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def escape_label_value(value: object) -> str:
    """Label value escaping of the text format: backslash, double quote, line feed."""
    s = str(value)
    if "\\" in s or '"' in s or "\n" in s:
        s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return s


def escape_help(text: str) -> str:
    """HELP escaping of the text format: backslash and line feed."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(kind: int, value: Any, signed: bool = False) -> str:
    """One value as dcgm-exporter prints it; raises :class:`InvalidValue` instead of printing junk.

    The reference (slow) path: :meth:`Renderer.render` has an inlined fast path that must agree.
    """
    if isinstance(value, bool):
        value = int(value)
    elif not isinstance(value, int | float):
        raise InvalidValue("invalid")
    if isinstance(value, float):
        if value != value:
            raise InvalidValue("nan")
        if value in (_INF, -_INF):
            raise InvalidValue("inf")
    if value < 0 and not signed:
        raise InvalidValue("negative")
    if kind == _FLOAT:
        return f"{value:f}"
    if kind == _PERCENT:
        return str(round(value * 100))
    if kind == _MIB:
        return str(int(value) >> 20)
    return str(round(value))  # INT, ROUND, BOOL (an int stays as it is; a float is rounded)


def bus_id_nvml_form(bus_id: str) -> str:
    """A kernel-log or NVML bus id (``0000:3b:00``) in NVML's form (``00000000:3B:00.0``)."""
    s = bus_id.strip()
    try:
        head, _, func = s.partition(".")
        parts = head.split(":")
        if len(parts) == 2:
            parts.insert(0, "0")
        if len(parts) != 3:
            return bus_id
        domain, bus, dev = (int(p, 16) for p in parts)
        fn = int(func, 16) if func else 0
    except ValueError:
        return bus_id
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}"


class GpuView:
    """The label strings of one GPU identity (rendered once, reused for every sample)."""

    __slots__ = (
        "age_head",
        "base",
        "heads",
        "pod_index",
        "pods",
        "series",
        "shared",
        "template",
        "xid_prefix",
    )

    def __init__(
        self,
        base: str,
        heads: tuple[bytes, ...],
        series: tuple[str, ...],
        pods: tuple[tuple[str, str, str], ...],
        age_head: bytes,
        xid_prefix: str,
    ) -> None:
        self.base = base  # identity labels, no pod labels
        self.heads = heads  # per family b"NAME{labels} "; b"" where the value carries whole lines
        self.template = [b""] * (2 * len(heads))  # a line list with every head and no value
        self.template[0::2] = heads
        self.series = series  # label bodies: one per pod on a shared GPU, else the single one
        self.pods = pods  # (namespace, pod, container) per series of a shared GPU
        self.shared = len(pods) > 1
        self.age_head = age_head
        self.xid_prefix = xid_prefix  # 'DCGM_EXP_XID_ERRORS_TOTAL{<base>,xid="'
        idx: dict[tuple[str, ...], int] = {}
        for i, (ns, pod, ctr) in enumerate(pods):
            idx.setdefault((ns, pod, ctr), i)
            idx.setdefault((ns, pod), i)
        self.pod_index = idx


# Container slot of an HPC job holder (issue 14): never a Kubernetes container name (NUL).
_HPC_JOB = "\x00hpc_job"


def _pods(allocations: Sequence[Mapping[str, Any]] | None) -> tuple[tuple[str, str, str], ...]:
    """Distinct (namespace, pod, container), first-seen order (replicas of one container count once).
    An HPC job (``hpc_job`` set, from --hpc-job-mapping-dir) is (namespace, job id, _HPC_JOB)."""
    out: dict[tuple[str, str, str], None] = {}
    for a in allocations or ():
        job = a["hpc_job"] if "hpc_job" in a else None  # noqa: SIM401 (a TypeError for a non-dict, as before)
        if job:
            out.setdefault((a["namespace"], job, _HPC_JOB), None)
        else:
            out.setdefault((a["namespace"], a["pod"], a["container"]), None)
    return tuple(out)


def _pod_labels(pod: tuple[str, str, str]) -> str:
    ns, name, ctr = pod
    e = escape_label_value
    if ctr == _HPC_JOB:  # as dcgm-exporter's HPC mapping: an hpc_job label, no pod labels
        return f'hpc_job="{e(name)}"'
    return f'container="{e(ctr)}",namespace="{e(ns)}",pod="{e(name)}"'


class Renderer:
    """Renders GpuSample records for one counters selection. Immutable; share it freely."""

    def __init__(self, counters: CounterSet, options: RenderOptions | None = None) -> None:
        self.counters = counters
        self.options = options or RenderOptions()
        self.families: tuple[Family, ...] = tuple(
            Family(i, c.name, c.prom_type, c.help, c.spec) for i, c in enumerate(counters.metrics)
        )
        self.label_rows: tuple[FieldSpec, ...] = tuple(
            sorted((c.spec for c in counters.labels), key=lambda s: s.name)
        )
        self.with_driver = any(s.source == "driver_version" for s in self.label_rows)
        plan = []
        self.xid_last_index: int | None = None
        self.xid_total_index: int | None = None
        for fam in self.families:
            k = fam.spec.kind
            if k is Kind.XID_LAST:
                self.xid_last_index = fam.index
            elif k is Kind.XID_TOTAL:
                self.xid_total_index = fam.index
            else:
                plan.append((fam.spec.source, int(k), fam.spec.signed, fam.index, fam.name))
        self._plan: tuple[tuple[str, int, bool, int, str], ...] = tuple(plan)
        self._xid_last_slot = None if self.xid_last_index is None else 2 * self.xid_last_index + 1

        def group(kind: int, signed: bool | None = None) -> tuple[tuple[str, int], ...]:
            return tuple(
                (src, 2 * fi + 1)
                for src, k, sg, fi, _ in plan
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
        )
        handled = {_INT, _FLOAT, _PERCENT, _ROUND, _MIB, _BOOL}
        if any(
            k not in handled or (sg and k != _ROUND) for _, k, sg, _, _ in plan
        ):  # a new Kind in fields.py
            raise ValueError("render plan: a field kind or sign that _render_fast does not handle")
        self._n = len(self.families)

    # -- identity --------------------------------------------------------------------------------
    def identity(self, rec: Mapping[str, Any]) -> tuple:
        """What the label strings depend on; a new view is needed only when this changes."""
        return (
            rec["hostname"],
            rec["gpu_index"],
            rec["uuid"],
            rec["pci_bus_id"],
            rec["model_name"],
            rec["mig"],
            rec["driver_version"] if self.with_driver else None,
            rec["allocations"],
        )

    def _base(
        self,
        gpu_index: int | None,
        uuid: str,
        pci_bus_id: str,
        model_name: str | None,
        mig: Mapping[str, Any] | None,
        hostname: str | None,
        driver_version: str | None,
    ) -> str:
        parts = []
        if gpu_index is not None:
            parts.append(f'gpu="{gpu_index}"')
        parts.append(f'UUID="{escape_label_value(uuid)}"')
        parts.append(f'pci_bus_id="{escape_label_value(pci_bus_id)}"')
        if gpu_index is not None:
            parts.append(f'device="nvidia{gpu_index}"')
        if model_name is not None:
            parts.append(f'modelName="{escape_label_value(model_name)}"')
        if mig is not None:
            parts.append(f'GPU_I_PROFILE="{escape_label_value(mig["profile"])}"')
            parts.append(f'GPU_I_ID="{mig["gpu_instance_id"]}"')
        host = self.options.host_label
        if host and hostname:
            parts.append(f'{host}="{escape_label_value(hostname)}"')
        for spec in self.label_rows:  # sorted by name, like dcgm-exporter's Labels map
            if spec.source == "driver_version" and driver_version:
                parts.append(f'{spec.name}="{escape_label_value(driver_version)}"')
        return ",".join(parts)

    def _make_view(self, base: str, pods: tuple[tuple[str, str, str], ...]) -> GpuView:
        xid_name = self.families[self.xid_total_index].name if self.xid_total_index is not None else ""
        age_head = f"{SAMPLE_AGE_METRIC}{{{base}}} ".encode()
        xid_prefix = f'{xid_name}{{{base},xid="'
        if len(pods) <= 1:
            labels = f"{base},{_pod_labels(pods[0])}" if pods else base
            heads = tuple(
                b"" if f.index == self.xid_total_index else f"{f.name}{{{labels}}} ".encode()
                for f in self.families
            )
            return GpuView(base, heads, (labels,), pods, age_head, xid_prefix)
        series = tuple(f"{base},{_pod_labels(p)}" for p in pods)
        return GpuView(base, (b"",) * self._n, series, pods, age_head, xid_prefix)

    def base_view(self, view: GpuView) -> GpuView:
        """The same GPU without pod labels (its sample is gone; its XID counters stay)."""
        return self._make_view(view.base, ())

    def view(self, rec: Mapping[str, Any]) -> GpuView:
        """Label strings of the GPU (or MIG slice) a sample describes."""
        base = self._base(
            rec["gpu_index"],
            rec["uuid"],
            rec["pci_bus_id"],
            rec["model_name"],
            rec["mig"],
            rec["hostname"],
            rec["driver_version"],
        )
        return self._make_view(base, _pods(rec["allocations"]))

    def event_view(self, event: Mapping[str, Any], uuid: str) -> GpuView:
        """Labels for a GPU known only from gpu.xid events (no sample yet): no pod labels."""
        base = self._base(
            event.get("gpu_index"),
            uuid,
            bus_id_nvml_form(event.get("pci_bus_id") or ""),
            event.get("model_name"),
            None,
            event.get("hostname"),
            event.get("driver_version"),
        )
        return self._make_view(base, ())

    # -- values ----------------------------------------------------------------------------------
    def render(
        self,
        rec: Mapping[str, Any],
        view: GpuView,
        xid_last: int | None,
        xid_counts: Mapping[int, int] | None,
        invalid: dict[tuple[str, str], int],
    ) -> list[bytes]:
        """The GPU's line list (see the module doc); bad values are counted in ``invalid``."""
        if view.shared:
            out = self._render_shared(rec, view, invalid)
            self.render_xid(view, xid_last, xid_counts, out)
            return out
        try:
            out = self._render_fast(rec, view)
        except (ValueError, TypeError, OverflowError):
            out = self._render_checked(rec, view, invalid)
        j = self._xid_last_slot  # the common case inline: the template holds its head already
        if j is not None:
            if xid_last is None:
                out[j - 1] = b""
            else:
                out[j] = b"%d\n" % xid_last
        if xid_counts:
            self.render_xid(view, xid_last, xid_counts, out)
        return out

    def _render_fast(self, rec: Mapping[str, Any], view: GpuView) -> list[bytes]:
        """The hot path: one loop per kind, no per-value dispatch; ``j`` is the value slot.

        Raises on anything unusual (a negative, NaN or Inf value, a value of an unexpected type);
        the caller then renders the whole record with :meth:`_render_checked`, whose output is the
        same for good values and which counts the bad ones."""
        out = view.template.copy()  # every head; a null clears its head
        ints, floats, percents, rounds, signed_rounds, mibs, bools = self._groups
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
        return out

    def _render_checked(
        self, rec: Mapping[str, Any], view: GpuView, invalid: dict[tuple[str, str], int]
    ) -> list[bytes]:
        """The reference path: every value through :func:`format_value`, bad ones counted."""
        out = view.template.copy()
        for src, kind, signed, fi, name in self._plan:
            v = rec[src]
            try:
                if v is None:
                    raise InvalidValue("")
                out[2 * fi + 1] = f"{format_value(kind, v, signed)}\n".encode()
            except InvalidValue as bad:
                out[2 * fi] = b""
                if bad.reason:
                    key = (name, bad.reason)
                    invalid[key] = invalid.get(key, 0) + 1
        return out

    def render_xid_only(
        self, view: GpuView, xid_last: int | None, xid_counts: Mapping[int, int] | None
    ) -> list[bytes]:
        """The line list of a GPU known only from gpu.xid events: the two XID families."""
        out = [b""] * (2 * self._n)
        self.render_xid(view, xid_last, xid_counts, out)
        return out

    def render_xid(
        self,
        view: GpuView,
        xid_last: int | None,
        xid_counts: Mapping[int, int] | None,
        out: list[bytes],
    ) -> None:
        """Fill the two XID families of a line list in place (after a gpu.xid event, say)."""
        fi = self.xid_last_index
        if fi is not None:
            if xid_last is None:
                out[2 * fi] = out[2 * fi + 1] = b""
            elif not view.shared:
                out[2 * fi] = view.heads[fi]
                out[2 * fi + 1] = b"%d\n" % xid_last
            else:
                name = self.families[fi].name
                out[2 * fi + 1] = "".join(f"{name}{{{s}}} {xid_last:d}\n" for s in view.series).encode()
        fi = self.xid_total_index
        if fi is not None:
            if xid_counts:
                prefix = view.xid_prefix
                counts = sorted(xid_counts.items())
                out[2 * fi + 1] = "".join(f'{prefix}{code}"}} {n}\n' for code, n in counts).encode()
            else:
                out[2 * fi + 1] = b""

    def _render_shared(
        self, rec: Mapping[str, Any], view: GpuView, invalid: dict[tuple[str, str], int]
    ) -> list[bytes]:
        """Complete lines per family, one series per pod (shares as the module doc says)."""
        out = [b""] * (2 * self._n)
        series = view.series
        procs = rec.get("processes") or ()
        owner: list[int | None] = []
        if procs and self.options.split_shared:
            idx = view.pod_index
            for p in procs:
                ns, pod = p.get("namespace"), p.get("pod")
                i = idx.get((ns, pod, p.get("container"))) if ns is not None and pod is not None else None
                if i is None and ns is not None and pod is not None:
                    i = idx.get((ns, pod))
                owner.append(i)
        fams = self.families
        for src, kind, signed, fi, name in self._plan:
            v = rec[src]
            text = None
            if v is not None:
                try:
                    text = format_value(kind, v, signed)
                except InvalidValue as bad:
                    key = (name, bad.reason)
                    invalid[key] = invalid.get(key, 0) + 1
            per_pod = fams[fi].spec.per_pod
            if owner and per_pod and any(p.get(per_pod) is not None for p in procs):
                sums: list[float] = [0] * len(series)
                for p, i in zip(procs, owner, strict=True):
                    x = p.get(per_pod)
                    if i is not None and x is not None:
                        sums[i] += x
                lines = [f"{name}{{{view.base}}} {text}\n"] if text is not None else []
                for s, total in zip(series, sums, strict=True):
                    try:
                        lines.append(f"{name}{{{s}}} {format_value(kind, total, signed)}\n")
                    except InvalidValue as bad:
                        key = (name, bad.reason)
                        invalid[key] = invalid.get(key, 0) + 1
                out[2 * fi + 1] = "".join(lines).encode()
            elif text is not None:
                out[2 * fi + 1] = "".join(f"{name}{{{s}}} {text}\n" for s in series).encode()
        return out
