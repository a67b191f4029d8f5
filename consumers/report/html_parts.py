"""The pieces both report pages are built of: escaping, dates, colours, swatches, bars, axes, style.

Pure string building. Each page (``html_report``: chargeback; ``idle_html``: idle GPUs) composes
these, so both read alike and print alike.
"""

from __future__ import annotations

import html
import math
from datetime import UTC, datetime

# Okabe-Ito-like qualitative palette (tells colours apart for most readers), then more.
PALETTE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#332288",
    "#117733",
    "#882255",
    "#44AA99",
    "#AA4499",
)


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def breakable(text: object) -> str:
    """Escaped, with a line break allowed after each '/': an owner such as
    notebooks/Notebook/notebook-1c76b has no space, and a table cell that cannot wrap it pushes the
    table's right-hand columns off the page."""
    return escape(text).replace("/", "/<wbr>")


def day(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M")


def swatch(colour: str) -> str:
    return (
        '<svg class="sw" width="10" height="10" aria-hidden="true">'
        f'<rect width="10" height="10" fill="{colour}"/></svg>'
    )


def bar(value: float, top: float, colour: str) -> str:
    w = 0.0 if top <= 0 else max(0.0, min(1.0, value / top)) * 120
    return (
        f'<svg width="120" height="10" aria-hidden="true"><rect width="{w:.1f}" height="10" '
        f'fill="{colour}"/></svg>'
    )


def axis_ticks(v: float) -> tuple[float, int]:
    """A round axis step and a tick count (at most 5 steps) whose top is at or above ``v``."""
    if v <= 0:
        return 0.0, 4
    mag = 10 ** (len(str(int(v))) - 1)
    for step in (0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10):
        if step * mag * 5 >= v:
            return step * mag, max(1, math.ceil(v / (step * mag) - 1e-9))
    return 10 * mag, 5


def y_grid(left: float, top: float, pw: float, ph: float, step: float, ticks: int) -> list[str]:
    """A chart's horizontal gridlines and their value labels, 0 to ``step * ticks``."""
    scale = step * ticks
    out = []
    for i in range(ticks + 1):
        v = step * i
        y = top + ph - (ph * v / scale if scale else 0)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="ax">'
            f"{v:,.{2 if step < 1 else 0}f}</text>"
        )
    return out


def axis_end(left: float, top: float, pw: float, ph: float, y_label: str) -> str:
    """The chart's base line and its y-axis title, closing the ``<svg>``."""
    return (
        f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="#888"/>'
        f'<text x="12" y="{top + ph / 2}" transform="rotate(-90 12 {top + ph / 2})" text-anchor="middle" '
        f'class="ax">{escape(y_label)}</text></svg>'
    )


CSS = """
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1b1b1b;
margin:24px auto;max-width:980px;padding:0 16px;background:#fff}
h1{font-size:22px;margin:0}h2{font-size:16px;margin:24px 0 8px}
.sub{color:#555;margin:4px 0 16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{flex:1 1 160px;border:1px solid #ddd;border-radius:6px;padding:10px 12px;background:#f7f9fc}
.card .k{color:#555;font-size:12px}.card .v{font-size:20px;font-weight:600}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:4px 8px;border-bottom:1px solid #e6e6e6;text-align:left}
th{background:#f0f0f0}.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
th.n{white-space:normal}
tr.total td,tfoot td{font-weight:600;border-top:2px solid #999}
.ax{font-size:11px;fill:#555}
.legend{margin-top:6px}.lg{margin-right:14px;white-space:nowrap}.sw{vertical-align:middle}
#rows{font-size:11px}#rows td,#rows th{padding:3px 5px}
footer{color:#666;font-size:12px;margin-top:24px}
@media print{body{margin:0;max-width:none}.card{background:none}
.keep,.cards{break-inside:avoid;page-break-inside:avoid}thead{display:table-header-group}
tr{break-inside:avoid}a{color:inherit}}
"""
