"""A GpuSample's values as Prometheus text lines, dcgm-exporter style (pure: no I/O).

A :class:`Renderer` is built once from the selected counters and :class:`RenderOptions`; per sample
it fills the GPU's *line list* (head and value text per family) in every layout; bad values are
dropped and counted, never raised. Labels come from :mod:`gpupipe_consumers.metrics.labels`. Line
lists, labels, layouts and values: docs/inside-metrics.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from gpupipe_consumers.metrics import derived
from gpupipe_consumers.metrics.collectors_csv import CounterSet
from gpupipe_consumers.metrics.fields import FieldSpec, Kind
from gpupipe_consumers.metrics.labels import (
    MIG_LAYOUTS,
    SAMPLE_AGE_METRIC,
    Attrs,
    GpuView,
    RenderOptions,
    SeriesLabels,
)
from gpupipe_consumers.metrics.layout import SHARE_FAMILIES, VGPU_SPLIT
from gpupipe_consumers.metrics.readings import PENDING, Kept, complete
from gpupipe_consumers.metrics.textfmt import (
    InvalidValue,
    attr_text,
    escape_help,
    escape_label_value,
    format_value,
)
from gpupipe_schemas.validate import reading_max

__all__ = [
    "MIG_LAYOUTS",
    "SAMPLE_AGE_METRIC",
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
        self.labels = SeriesLabels(
            o,
            tuple(None if f.spec is None or f.spec.kind.exp else f.name for f in self.families),
            tuple(sorted((c.spec for c in counters.labels), key=lambda s: s.name)),
        )
        self.label_rows = self.labels.label_rows
        self.label_sources = self.labels.label_sources
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

    def pod_attrs(self, ns: str, pod: str, ctr: str, **extra: str) -> Attrs:
        return self.labels.pod_attrs(ns, pod, ctr, **extra)

    def view(self, rec: Mapping[str, Any]) -> GpuView:
        """Label strings of the GPU (or MIG instance) a sample describes."""
        return self.labels.view(rec)

    def event_view(self, event: Mapping[str, Any], uuid: str) -> GpuView:
        """Labels for a GPU known only from gpu.xid events (see :meth:`SeriesLabels.event_view`)."""
        return self.labels.event_view(event, uuid)

    def base_view(self, view: GpuView) -> GpuView:
        """The same GPU without pod labels (its sample is gone; its XID counters stay)."""
        return self.labels.base_view(view)

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
            out = self._render_multi(rec, view, invalid)
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
            self._render_shares(rec, view, out, invalid)
        return out

    def _render_fast(self, rec: Mapping[str, Any], view: GpuView) -> list[bytes]:
        """The hot path: one loop per kind, no per-value dispatch; ``j`` is the value slot.

        Raises on anything unusual (a negative, NaN or Inf value, a value of an unexpected type);
        the caller then renders the whole record with :meth:`_render_checked`, whose output is the
        same for good values and which counts the bad ones."""
        out = view.template.copy()  # every head; a null clears its head
        ints, floats, percents, rounds, signed_rounds = self._groups[:5]
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
        self._render_fast_units(rec, out)
        return out

    def _render_fast_units(self, rec: Mapping[str, Any], out: list[bytes]) -> None:
        """The rest of :meth:`_render_fast`: values converted to the exposed unit, and the bounds."""
        mibs, bools, hertz, joules, kib = self._groups[5:]
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

    def _render_multi(
        self, rec: Mapping[str, Any], view: GpuView, invalid: dict[tuple[str, str], int]
    ) -> list[bytes]:
        """Complete lines per family, one series per allocation (virtual-GPU layout)."""
        out = [b""] * (2 * self._n)
        procs = rec.get("processes") or ()
        own = _owners(procs, view) if procs else []
        pod_names = self.labels.pod_names
        for src, kind, signed, fi, name, dcgm_name in self._plan:
            v = rec[src]
            text = None
            if v is not None:
                try:
                    text = format_value(kind, v, signed, self._upper.get(src))
                except InvalidValue as bad:
                    key = (name, bad.reason)
                    invalid[key] = invalid.get(key, 0) + 1
            per_pod = self.families[fi].spec.per_pod if dcgm_name in VGPU_SPLIT else None  # type: ignore[union-attr]
            if per_pod and own and any(p.get(per_pod) is not None for p in procs):
                lines = [f"{name}{{{view.base}}} {text}\n"] if text is not None else []
                done: set[tuple[str, str, str]] = set()
                for attrs in view.attrs:
                    a = dict(attrs)
                    pod_key = (
                        a.get(pod_names[1], ""),
                        a.get(pod_names[2], ""),
                        a.get(pod_names[0], ""),
                    )
                    if pod_key in done:
                        continue
                    done.add(pod_key)
                    i = view.share_index.get(pod_key)
                    total = sum(
                        p.get(per_pod) or 0
                        for p, o in zip(procs, own, strict=True)
                        if o == i and i is not None
                    )
                    try:
                        val = format_value(kind, total, signed)
                    except InvalidValue as bad:
                        key = (name, bad.reason)
                        invalid[key] = invalid.get(key, 0) + 1
                        continue
                    labels = attr_text(tuple(sorted((*attrs, ("pod_uid", "")))))
                    lines.append(f"{name}{{{view.base}{labels}}} {val}\n")
                out[2 * fi + 1] = "".join(lines).encode()
            elif text is not None:
                out[2 * fi + 1] = view.lines(name, "", text).encode()
        return out

    def _render_shares(
        self, rec: Mapping[str, Any], view: GpuView, out: list[bytes], invalid: dict[tuple[str, str], int]
    ) -> None:
        """gpupipe_pod_* share families on a GPU held by two or more containers."""
        procs = rec.get("processes") or ()
        if not procs:
            return
        own = _owners(procs, view)
        for fam, (_, src, kind, _) in zip(self._share_fams, SHARE_FAMILIES, strict=True):
            if not any(p.get(src) is not None for p in procs):
                continue
            sums: list[float] = [0] * len(view.share_pods)
            for p, i in zip(procs, own, strict=True):
                x = p.get(src)
                if i is not None and x is not None:
                    sums[i] += x
            lines = []
            for (ns, pod, ctr), total in zip(view.share_pods, sums, strict=True):
                try:
                    val = format_value(int(kind), total)
                except InvalidValue as bad:
                    key = (fam.name, bad.reason)
                    invalid[key] = invalid.get(key, 0) + 1
                    continue
                lines.append(
                    f"{fam.name}{{{view.base}{attr_text(self.labels.pod_attrs(ns, pod, ctr))}}} {val}\n"
                )
            out[2 * fam.index + 1] = "".join(lines).encode()

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


def _owners(procs: Sequence[Mapping[str, Any]], view: GpuView) -> list[int | None]:
    """Index in ``view.share_pods`` of each process's pod (None: not resolved to a pod)."""
    idx = view.share_index
    owner: list[int | None] = []
    for p in procs:
        ns, pod = p.get("namespace"), p.get("pod")
        i = None
        if ns is not None and pod is not None:
            i = idx.get((ns, pod, p.get("container")))
            if i is None:
                i = idx.get((ns, pod))
        owner.append(i)
    return owner
