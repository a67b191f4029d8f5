"""Who a series is: the label strings of one GPU identity (dcgm-exporter's labels, in its order),
built once per identity and reused for every sample until the GPU's labels change (pure).
The labels and the layouts of shared, MIG and HPC-held GPUs are described in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupipe.domain import pci
from gpupipe_consumers.metrics.fields import FieldSpec
from gpupipe_consumers.metrics.textfmt import attr_text, escape_label_value

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


class SeriesLabels:
    """Builds the :class:`GpuView` of a sample or event for one options and families selection."""

    def __init__(
        self,
        options: RenderOptions,
        head_names: tuple[str | None, ...],
        label_rows: tuple[FieldSpec, ...],
    ) -> None:
        self.options = o = options
        # per family, the name its head starts with; None where the value slot carries whole lines
        self.head_names = head_names
        self.label_rows = label_rows  # sorted by name
        self.label_sources: tuple[str, ...] = tuple(dict.fromkeys(s.source for s in label_rows if s.source))
        self._uuid_label = "uuid" if o.old_namespace else "UUID"
        self.pod_names = (
            ("container_name", "pod_namespace", "pod_name")
            if o.old_namespace
            else ("container", "namespace", "pod")
        )

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
        c, n, p = self.pod_names
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
            heads = tuple(b"" if n is None else f"{n}{{{labels}}} ".encode() for n in self.head_names)
        else:
            heads = (b"",) * len(self.head_names)
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
