"""Server-side SVG charts for the console: no script, no external asset, every label escaped.

``bars(items)`` draws labelled horizontal bars (a histogram, pending per level, messages per topic);
the result is markup to embed as is (Jinja ``|safe``)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

ROW = 22
LABEL_W = 150
BAR_W = 420
VALUE_W = 90


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:,.2f}"


def bars(items: Sequence[tuple[str, float]], *, title: str, unit: str = "") -> str:
    """Horizontal bars, one per (label, value), scaled to the largest value; an empty chart says so."""
    height = ROW * max(1, len(items)) + 30
    width = LABEL_W + BAR_W + VALUE_W
    out = [f'<svg class="chart" role="img" aria-label="{escape(title)}" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="0" y="16" class="chart-title">{escape(title)}</text>']
    if not items:
        out.append('<text x="0" y="40" class="chart-empty">no data yet</text></svg>')
        return "".join(out)
    top = max((v for _, v in items), default=0) or 1
    for i, (label, value) in enumerate(items):
        y = 26 + i * ROW
        w = max(0.0, value) / top * BAR_W
        out.append(f'<text x="{LABEL_W - 6}" y="{y + 14}" text-anchor="end" class="chart-label">'
                   f'{escape(str(label))}</text>')
        out.append(f'<rect x="{LABEL_W}" y="{y + 3}" width="{w:.1f}" height="{ROW - 6}" class="chart-bar">'
                   f'<title>{escape(str(label))}: {_fmt(value)}{escape(unit)}</title></rect>')
        out.append(f'<text x="{LABEL_W + w + 6:.1f}" y="{y + 14}" class="chart-value">'
                   f'{_fmt(value)}{escape(unit)}</text>')
    out.append("</svg>")
    return "".join(out)


def histogram(cumulative: Sequence[tuple[int, int]], total: int, *, title: str, unit: str = " ms") -> str:
    """A latency histogram from cumulative (upper bound, count at or below it) pairs and the total count:
    one bar per bucket (``<= bound``) and one for the samples above the last bound."""
    items: list[tuple[str, float]] = []
    prev = 0
    for bound, count in cumulative:
        items.append((f"<= {bound:,}{unit}", count - prev))
        prev = count
    if cumulative:
        items.append((f"> {cumulative[-1][0]:,}{unit}", max(0, total - prev)))
    while items and items[-1][1] == 0:  # trailing empty buckets say nothing
        items.pop()
    return bars(items, title=title)
