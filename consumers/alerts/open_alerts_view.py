"""The open alerts as a person reads them: ``/alerts`` (HTML) and ``/alerts.json``, rendered from a snapshot.

Contract: :func:`view_of` turns ``GpuAlert`` records
(:func:`~gpupipe_consumers.alerts.engine.alert_record.to_record` of snapshots the service took under its
lock) into an immutable :class:`OpenAlertsView`; :func:`render_html` and :func:`render_json` turn that view
into bytes. Pure: no clock (``now_ms`` is passed in), no lock, no I/O.

Rules and reasons in full: docs/alerts.md, "Module notes", ``open_alerts_view.py``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpupipe_consumers.alerts.engine.alert_record import iso_ms

__all__ = [
    "MAX_CELL_CHARS",
    "MAX_PODS_SHOWN",
    "MAX_ROWS",
    "AlertRow",
    "OpenAlertsView",
    "order_key",
    "render_html",
    "render_json",
    "view_of",
]

#: Rows on the page and in the JSON at most (the rest are counted: "N more open alerts").
MAX_ROWS = 1000
#: Pods listed per row on the HTML page at most (the JSON lists every one).
MAX_PODS_SHOWN = 8
#: Characters of one value shown in an HTML cell at most.
MAX_CELL_CHARS = 256

_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def order_key(severity: str, first_seen_ms: int, alert_id: str) -> tuple[int, int, str]:
    """Severity first (critical on top), then oldest first, then id (a stable order)."""
    return _SEVERITY_RANK.get(severity, len(_SEVERITY_RANK)), first_seen_ms, alert_id


@dataclass(frozen=True, slots=True)
class AlertRow:
    alert_id: str
    alertname: str
    severity: str
    scope: str
    node: str
    gpu_uuid: str | None
    gpu_index: int | None
    pci_bus_id: str | None
    gpus: tuple[str, ...]  # a node-wide alert's GPUs
    pods: tuple[tuple[str, str, str], ...]  # (namespace, pod, container)
    cause_class: str
    summary: str
    nvidia_action: str | None
    action: str
    drain_node: bool
    first_seen_ms: int
    last_seen_ms: int
    occurrences: int
    xid_codes: tuple[int, ...]

    @classmethod
    def of(cls, rec: Mapping[str, Any]) -> AlertRow:
        return cls(
            alert_id=rec["alert_id"],
            alertname=rec["alertname"],
            severity=rec["severity"],
            scope=rec["scope"],
            node=rec["hostname"],
            gpu_uuid=rec.get("gpu_uuid"),
            gpu_index=rec.get("gpu_index"),
            pci_bus_id=rec.get("pci_bus_id"),
            gpus=tuple(rec.get("gpus") or ()),
            pods=tuple(
                (str(a["namespace"]), str(a["pod"]), str(a.get("container") or ""))
                for a in rec.get("allocations") or ()
            ),
            cause_class=rec["cause_class"],
            summary=rec["summary"],
            nvidia_action=rec.get("nvidia_action"),
            action=rec["action"],
            drain_node=bool(rec["drain_node"]),
            first_seen_ms=rec["first_seen_ms"],
            last_seen_ms=rec["last_seen_ms"],
            occurrences=rec["occurrences"],
            xid_codes=tuple(rec.get("xid_codes") or ()),
        )

    def as_dict(self, now_ms: int) -> dict[str, Any]:
        return {
            "alert_id": self.alert_id,
            "alertname": self.alertname,
            "severity": self.severity,
            "scope": self.scope,
            "node": self.node,
            "gpu": {"uuid": self.gpu_uuid, "index": self.gpu_index, "pci_bus_id": self.pci_bus_id},
            "gpus": list(self.gpus),
            "pods": [{"namespace": n, "pod": p, "container": c} for n, p, c in self.pods],
            "cause_class": self.cause_class,
            "summary": self.summary,
            "nvidia_action": self.nvidia_action,
            "action": self.action,
            "drain_node": self.drain_node,
            "first_seen_ms": self.first_seen_ms,
            "first_seen": iso_ms(self.first_seen_ms),
            "age_s": max(0, now_ms - self.first_seen_ms) // 1000,
            "last_seen_ms": self.last_seen_ms,
            "occurrences": self.occurrences,
            "xid_codes": list(self.xid_codes),
        }


@dataclass(frozen=True, slots=True)
class OpenAlertsView:
    """What one snapshot of the service held: the first rows in :func:`order_key` order, and the total."""

    rows: tuple[AlertRow, ...]
    total: int  # open alerts held, shown or not
    instance: str
    role: str  # single, leader or standby (--ha)
    taken_at_ms: int  # when the snapshot was taken
    stale: bool = False  # the service was busy: this is an earlier snapshot

    @property
    def more(self) -> int:
        return max(0, self.total - len(self.rows))


def view_of(
    records: Iterable[Mapping[str, Any]],
    total: int,
    *,
    instance: str,
    role: str,
    taken_at_ms: int,
    max_rows: int = MAX_ROWS,
) -> OpenAlertsView:
    rows = sorted(
        (AlertRow.of(r) for r in records), key=lambda r: order_key(r.severity, r.first_seen_ms, r.alert_id)
    )[:max_rows]
    return OpenAlertsView(
        rows=tuple(rows), total=max(total, len(rows)), instance=instance, role=role, taken_at_ms=taken_at_ms
    )


def _role_line(view: OpenAlertsView) -> str | None:
    if view.role == "standby":
        return (
            "This instance is a standby (--ha): it holds no alerts until it becomes the leader; "
            "the leader's page lists the open alerts."
        )
    return None


def render_json(view: OpenAlertsView, now_ms: int) -> bytes:
    doc: dict[str, Any] = {
        "instance": view.instance,
        "role": view.role,
        "taken_at_ms": view.taken_at_ms,
        "taken_at": iso_ms(view.taken_at_ms),
        "stale": view.stale,
        "open_alerts": view.total,
        "shown": len(view.rows),
        "more": view.more,
        "alerts": [r.as_dict(now_ms) for r in view.rows],
    }
    note = _role_line(view)
    if note:
        doc["note"] = note
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def age_text(ms: int) -> str:
    """``45s``, ``12m 05s``, ``3h 07m``, ``2d 04h``."""
    s = max(0, ms) // 1000
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h"


def _utc(ms: int) -> str:
    """``2027-01-15 06:53:20`` (UTC, as the column heading says)."""
    return iso_ms(ms)[:19].replace("T", " ")


def _cell(value: object) -> str:
    text = "" if value is None else str(value)
    if len(text) > MAX_CELL_CHARS:
        text = text[: MAX_CELL_CHARS - 1] + "\u2026"
    return html.escape(text, quote=True)


def _gpu_html(r: AlertRow) -> str:
    if r.scope == "node":
        listed = ", ".join(r.gpus[:MAX_PODS_SHOWN])
        extra = f" +{len(r.gpus) - MAX_PODS_SHOWN} more" if len(r.gpus) > MAX_PODS_SHOWN else ""
        return f"node-wide ({len(r.gpus)} GPUs): {_cell(listed)}{extra}"
    parts = []
    if r.scope == "nvswitch":
        parts.append("NVSwitch")
    elif r.gpu_index is not None:
        parts.append(f"GPU {r.gpu_index}")
    if r.gpu_uuid:
        parts.append(f'<span class="uuid">{_cell(r.gpu_uuid)}</span>')
    if r.pci_bus_id:
        parts.append(f'<span class="bus">{_cell(r.pci_bus_id)}</span>')
    return "<br>".join(parts) or "-"


def _pods_html(r: AlertRow) -> str:
    if not r.pods:
        return "-"
    items = [
        f'<li class="pod">{_cell(f"{n}/{p}" + (f"/{c}" if c else ""))}</li>'
        for n, p, c in r.pods[:MAX_PODS_SHOWN]
    ]
    if len(r.pods) > MAX_PODS_SHOWN:
        items.append(f"<li>+{len(r.pods) - MAX_PODS_SHOWN} more</li>")
    return f"<ul>{''.join(items)}</ul>"


def _row_html(r: AlertRow, now_ms: int) -> str:
    nvidia = r.nvidia_action or "-"
    action = f"{_cell(nvidia)}" + (
        f'<br><span class="ours">ours: {_cell(r.action)}</span>' if r.action != nvidia else ""
    )
    cells = [
        f'<td class="sev sev-{_cell(r.severity)}">{_cell(r.severity)}</td>',
        f"<td>{_cell(r.alertname)}</td>",
        f'<td class="node">{_cell(r.node)}</td>',
        f'<td class="gpu">{_gpu_html(r)}</td>',
        f'<td class="pods">{_pods_html(r)}</td>',
        f'<td class="cause"><b>{_cell(r.cause_class)}</b><br>{_cell(r.summary)}</td>',
        f'<td class="action">{action}</td>',
        f'<td class="drain">{"yes" if r.drain_node else "no"}</td>',
        f'<td class="first">{_cell(_utc(r.first_seen_ms))}</td>',
        f'<td class="age">{_cell(age_text(now_ms - r.first_seen_ms))}</td>',
        f'<td class="num">{r.occurrences}</td>',
        f'<td class="id">{_cell(r.alert_id)}</td>',
    ]
    return f'<tr data-alert-id="{_cell(r.alert_id)}">{"".join(cells)}</tr>'


#: (heading, share of the page's width in %): a fixed layout, so long names wrap in their own column
#: and never push the table wider than the window. The soft hyphen lets "occurrences" break.
_HEAD = (
    ("severity", 7),
    ("alert", 8),
    ("node", 8),
    ("GPU", 11),
    ("pods", 12),
    ("cause", 16),
    ("NVIDIA's action", 8),
    ("drain", 5),
    ("first seen (UTC)", 8),
    ("age", 5),
    ("occur\u00adrences", 6),
    ("alert id", 6),
)

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fff}
h1{font-size:1.4em;margin:0 0 .3em}
p.meta{color:#555;margin:.2em 0}
p.note{background:#fff4d6;border:1px solid #e0b44a;padding:.5em .8em}
table{border-collapse:collapse;width:100%;table-layout:fixed}
th,td{border:1px solid #d0d7de;padding:.35em .5em;vertical-align:top;text-align:left}
td{overflow-wrap:anywhere}
th{overflow-wrap:break-word;hyphens:manual}
th{background:#f0f3f6}
td.sev{font-weight:600}
td.sev-critical{background:#ffd7d5;color:#82071e}
td.sev-warning{background:#fff1c2;color:#6b4b00}
td.sev-info{background:#ddf4ff;color:#0a3069}
td.num{text-align:right}
td.id,span.uuid,span.bus{font-family:ui-monospace,monospace;font-size:.9em}
span.ours{color:#555;font-size:.9em}
ul{margin:0;padding-left:1.1em}
"""


def render_html(view: OpenAlertsView, now_ms: int) -> bytes:
    notes = [line for line in (_role_line(view),) if line]
    if view.stale:
        notes.append(f"The service was busy: this is its list as of {iso_ms(view.taken_at_ms)}.")
    meta = (
        f"{view.total} open alert{'s' if view.total != 1 else ''} held by instance "
        f"<b>{_cell(view.instance)}</b> ({_cell(view.role)}), as of {_cell(iso_ms(view.taken_at_ms))}. "
        "Sorted by severity, then oldest first. "
        '<a href="alerts.json">JSON</a>'
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>gpupipe: open alerts ({view.total})</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Open GPU alerts</h1>",
        f'<p class="meta" id="summary">{meta}</p>',
        *(f'<p class="note">{_cell(n)}</p>' for n in notes),
    ]
    if view.rows:
        parts.append('<table id="alerts"><colgroup>')
        parts.extend(f'<col style="width:{w}%">' for _, w in _HEAD)
        parts.append("</colgroup><thead><tr>")
        parts.extend(f"<th>{_cell(h)}</th>" for h, _ in _HEAD)
        parts.append("</tr></thead><tbody>")
        parts.extend(_row_html(r, now_ms) for r in view.rows)
        parts.append("</tbody></table>")
    else:
        parts.append('<p id="none">No open alerts.</p>')
    if view.more:
        parts.append(
            f'<p class="note" id="more">{view.more} more open alert{"s" if view.more != 1 else ""} '
            f"not shown (the first {len(view.rows)} by severity and age are).</p>"
        )
    parts.append("</body></html>\n")
    return "\n".join(parts).encode()
