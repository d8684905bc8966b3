"""Charts for the admin page (chat/admin.py) as inline SVG, drawn here from the figures:
no script, no library, nothing fetched by the browser. Every label is escaped, and every
bar has a <title> (the browser's tooltip, and what a screen reader or a test reads).
"""

from __future__ import annotations

import html
from collections.abc import Sequence

# Distinguishable in light and dark themes, and for the common colour blindnesses
# (Okabe and Ito's palette, in their order).
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")


def colour(n: int) -> str:
    return COLOURS[n % len(COLOURS)]


def stacked_columns(columns: Sequence[str], series: dict[str, Sequence[int]],
                    unit: str, details: dict[str, Sequence[str]] | None = None) -> str:
    """A column per label in `columns` (days), each stacked from `series` (a profile's
    values, one per column, in the order given), a legend under it. `details`: words for
    each bar's title beside its value, by series and column."""
    width, height, left, top, bottom = 720, 220, 56, 10, 40
    plot_w, plot_h = width - left - 10, height - top - bottom
    totals = [sum(values[i] for values in series.values()) for i in range(len(columns))]
    most = max(totals, default=0) or 1
    step = plot_w / max(1, len(columns))
    bar = max(2.0, step * 0.7)
    parts = [_axis(left, top, plot_w, plot_h, most, unit)]
    for i, label in enumerate(columns):
        x = left + i * step + (step - bar) / 2
        y = top + plot_h
        for n, (name, values) in enumerate(series.items()):
            value = values[i]
            if not value:
                continue
            h = plot_h * value / most
            y -= h
            more = f", {details[name][i]}" if details and details.get(name) else ""
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                         f'fill="{colour(n)}"><title>{html.escape(label)} · '
                         f'{html.escape(name)}: {value:,} {html.escape(unit)}'
                         f'{html.escape(more)}</title></rect>')
        if len(columns) <= 16 or i % max(1, len(columns) // 12) == 0:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{top + plot_h + 14}" '
                         f'text-anchor="middle" font-size="10">{html.escape(label[5:])}</text>')
    x = left
    for n, name in enumerate(series):
        parts.append(f'<rect x="{x}" y="{height - 14}" width="10" height="10" '
                     f'fill="{colour(n)}"/><text x="{x + 14}" y="{height - 5}" '
                     f'font-size="11">{html.escape(name)}</text>')
        x += 24 + 7 * len(name)
    return _svg(width, height, "".join(parts), f"{unit} per day")


def bars(rows: Sequence[tuple[str, int, str]], unit: str) -> str:
    """A horizontal bar per (label, value, detail) row, longest first as given."""
    width, row_h, left = 720, 22, 220
    height = max(1, len(rows)) * row_h + 8
    most = max((value for _, value, _ in rows), default=0) or 1
    parts = []
    for i, (label, value, detail) in enumerate(rows):
        y = 4 + i * row_h
        w = (width - left - 110) * value / most
        shown = label if len(label) <= 32 else label[:31] + "…"
        parts.append(
            f'<text x="{left - 6}" y="{y + 14}" text-anchor="end" font-size="12">'
            f'{html.escape(shown)}</text><rect x="{left}" y="{y + 3}" width="{max(w, 1):.1f}" '
            f'height="{row_h - 8}" fill="{colour(0)}"><title>{html.escape(label)}: '
            f'{value:,} {html.escape(unit)}{", " + html.escape(detail) if detail else ""}'
            f'</title></rect><text x="{left + w + 6:.1f}" y="{y + 14}" font-size="12">'
            f'{value:,}</text>')
    return _svg(width, height, "".join(parts), f"{unit} by account")


def _axis(left: int, top: int, plot_w: float, plot_h: float, most: int, unit: str) -> str:
    lines = []
    for fraction in (0, 0.5, 1):
        y = top + plot_h * (1 - fraction)
        lines.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="currentColor" stroke-opacity=".2"/><text x="{left - 6}" '
                     f'y="{y + 4:.1f}" text-anchor="end" font-size="10">'
                     f'{_short(most * fraction)}</text>')
    return "".join(lines)


def _short(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def _svg(width: int, height: int, body: str, label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'width="100%" role="img" aria-label="{html.escape(label)}" fill="currentColor" '
            f'style="max-width:{width}px">{body}</svg>')
