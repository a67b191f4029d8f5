"""The line lists of GPUs with several series (pure): dcgm-exporter's virtual-GPU layout (one copy
of every series per allocation, per-pod shares of DCGM_FI_DEV_GPU_UTIL / FB_USED) and gpupipe's
own per-pod share families on a shared GPU. Split from :mod:`gpupipe_consumers.metrics.render` (the single
series hot path) by role; the layout rules are described there."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpupipe_consumers.metrics.layout import SHARE_FAMILIES, VGPU_SPLIT
from gpupipe_consumers.metrics.textfmt import InvalidValue, attr_text, format_value

Attrs = tuple[tuple[str, str], ...]


class GpuView(Protocol):
    """What these functions read of :class:`gpupipe_consumers.metrics.render.GpuView` (a protocol, so that
    this module does not import the one that calls it)."""

    base: str
    attrs: tuple[Attrs, ...]
    share_pods: tuple[tuple[str, str, str], ...]
    share_index: dict[tuple[str, ...], int]

    def lines(self, name: str, labels: str, value: str) -> str: ...


class Renderer(Protocol):
    """What these functions read of :class:`gpupipe_consumers.metrics.render.Renderer`."""

    _n: int
    _plan: tuple[tuple[str, int, bool, int, str, str], ...]
    _pod_names: tuple[str, str, str]
    _share_fams: tuple[Any, ...]
    families: tuple[Any, ...]

    def pod_attrs(self, ns: str, pod: str, ctr: str, **extra: str) -> Attrs: ...


def render_multi(
    r: Renderer, rec: Mapping[str, Any], view: GpuView, invalid: dict[tuple[str, str], int]
) -> list[bytes]:
    """Complete lines per family, one series per allocation (virtual-GPU layout)."""
    out = [b""] * (2 * r._n)
    procs = rec.get("processes") or ()
    own = owners(procs, view) if procs else []
    for src, kind, signed, fi, name, dcgm_name in r._plan:
        v = rec[src]
        text = None
        if v is not None:
            try:
                text = format_value(kind, v, signed, r._upper.get(src))
            except InvalidValue as bad:
                key = (name, bad.reason)
                invalid[key] = invalid.get(key, 0) + 1
        per_pod = r.families[fi].spec.per_pod if dcgm_name in VGPU_SPLIT else None  # type: ignore[union-attr]
        if per_pod and own and any(p.get(per_pod) is not None for p in procs):
            lines = [f"{name}{{{view.base}}} {text}\n"] if text is not None else []
            done: set[tuple[str, str, str]] = set()
            for attrs in view.attrs:
                a = dict(attrs)
                pod_key = (
                    a.get(r._pod_names[1], ""),
                    a.get(r._pod_names[2], ""),
                    a.get(r._pod_names[0], ""),
                )
                if pod_key in done:
                    continue
                done.add(pod_key)
                i = view.share_index.get(pod_key)
                total = sum(
                    p.get(per_pod) or 0 for p, o in zip(procs, own, strict=True) if o == i and i is not None
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


def owners(procs: Sequence[Mapping[str, Any]], view: GpuView) -> list[int | None]:
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


def render_shares(
    r: Renderer, rec: Mapping[str, Any], view: GpuView, out: list[bytes], invalid: dict[tuple[str, str], int]
) -> None:
    """gpupipe_pod_* share families on a GPU held by two or more containers."""
    procs = rec.get("processes") or ()
    if not procs:
        return
    own = owners(procs, view)
    for fam, (_, src, kind, _) in zip(r._share_fams, SHARE_FAMILIES, strict=True):
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
            lines.append(f"{fam.name}{{{view.base}{attr_text(r.pod_attrs(ns, pod, ctr))}}} {val}\n")
        out[2 * fam.index + 1] = "".join(lines).encode()
