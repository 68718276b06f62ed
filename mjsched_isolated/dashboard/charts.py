"""Inline SVG charts, drawn on the server (no script, no library): stacked bars of runs by status."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup, escape

from mjsched_isolated.enums import RunStatus, values

ORDER = values(RunStatus)  # stacking order, bottom first
WIDTH, HEIGHT, PAD = 480, 120, 16


def svg(chart: dict[str, Any], title: str) -> Markup:
    """An SVG of ``chart`` (a :func:`data.overview` chart: ``buckets`` of ``{"start", "counts"}``): one bar per
    bucket, stacked by status (CSS classes ``st-<Status>``), each segment with a ``<title>`` tooltip."""
    buckets = chart["buckets"]
    peak = max([sum(b["counts"].values()) for b in buckets] + [1])
    slot = (WIDTH - 2 * PAD) / max(len(buckets), 1)
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT + PAD}" role="img" aria-label="{escape(title)}">',
             f"<title>{escape(title)}</title>",
             f'<line class="axis" x1="{PAD}" y1="{HEIGHT}" x2="{WIDTH - PAD}" y2="{HEIGHT}"/>']
    for i, bucket in enumerate(buckets):
        x = PAD + i * slot + slot * 0.1
        y = float(HEIGHT)
        for status in ORDER:
            n = bucket["counts"].get(status, 0)
            if not n:
                continue
            h = (HEIGHT - PAD) * n / peak
            y -= h
            label = f"{bucket['start']:%H:%M}Z: {n} {status}"
            parts.append(f'<rect class="st-{status}" x="{x:.1f}" y="{y:.1f}" width="{slot * 0.8:.1f}" '
                         f'height="{h:.1f}"><title>{escape(label)}</title></rect>')
        if i % max(1, len(buckets) // 6) == 0:
            parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT + PAD - 3}">{bucket["start"]:%H:%M}</text>')
    parts.append(f'<text class="tick" x="{PAD}" y="{PAD - 4}">max {peak}</text></svg>')
    return Markup("".join(parts))
