"""Self-contained HTML reports with inline SVG charts, drawn here (no JS, no CDN, no fonts).

`gateway demo` writes one of these; anything else that wants a chart in a file a person can
open offline may use it too. Every chart function returns an `<svg>` string and copes with
empty data, a single point and hostile labels (everything printed is escaped).

The charts are deliberately few and plain: a line chart (optionally step-shaped and with a
log x axis, which is what a CDF needs), stacked bars per time bucket, lanes of coloured
state bands, and box plots. Each takes data in user units and lays out its own axes.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "Band",
    "Bars",
    "BoxGroup",
    "Marker",
    "Series",
    "Span",
    "bar_chart",
    "box_chart",
    "cdf_chart",
    "cdf_points",
    "fmt_ms",
    "fmt_num",
    "fmt_seconds",
    "line_chart",
    "nice_ticks",
    "page",
    "percentile",
    "timeline_chart",
]

Formatter = Callable[[float], str]

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
PALETTE: Final = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000")

WIDTH: Final = 960
HEIGHT: Final = 300
_FONT: Final = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Noto Sans', sans-serif"
_CHAR_W: Final = 6.6  # average glyph width of the 12 px font, for laying out legends
_MARGIN_L: Final = 70
_MARGIN_R: Final = 20
_MARGIN_T: Final = 58  # title and legend
_MARGIN_B: Final = 46  # tick labels and the axis label
_GRID: Final = "#e3e3e3"
# Element ids must be unique within a page that holds many charts.
_ids = itertools.count(1)
_AXIS: Final = "#555"


# ---- data types ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Series:
    """One line: `points` are (x, y) in data units, sorted by x."""

    label: str
    points: Sequence[tuple[float, float]]
    color: str = PALETTE[0]
    dashed: bool = False
    step: bool = False  # hold each y until the next x (counters, CDFs)
    width: float = 2.0


@dataclass(frozen=True, slots=True)
class Bars:
    """One layer of a stacked bar chart: `values[i]` belongs to bucket `i`."""

    label: str
    values: Sequence[float]
    color: str = PALETTE[0]


@dataclass(frozen=True, slots=True)
class Marker:
    """A labelled vertical line at `x` (an event on a time axis)."""

    x: float
    label: str
    color: str = "#333"


@dataclass(frozen=True, slots=True)
class Span:
    """A shaded x range behind the data (a phase on a time axis)."""

    start: float
    end: float
    label: str = ""
    color: str = "#f2f2f2"


@dataclass(frozen=True, slots=True)
class Band:
    """One stretch of one lane of a timeline, in one state."""

    start: float
    end: float
    state: str


@dataclass(frozen=True, slots=True)
class BoxGroup:
    """One box of a box chart: the raw values it summarises."""

    label: str
    values: Sequence[float]
    color: str = PALETTE[0]


@dataclass(slots=True)
class _Axis:
    """Maps data values to pixels along one axis, linear or log10."""

    lo: float
    hi: float
    start: float  # pixel of `lo`
    end: float  # pixel of `hi`
    log: bool = False
    ticks: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.log:
            self.lo = max(self.lo, 1e-12)
            self.hi = max(self.hi, self.lo * 10)
        elif not self.hi > self.lo:
            # A single value (or none): give it room instead of dividing by zero.
            pad = abs(self.lo) * 0.5 or 1.0
            self.lo, self.hi = self.lo - pad, self.hi + pad

    def __call__(self, value: float) -> float:
        if self.log:
            v = math.log10(min(max(value, self.lo), self.hi))
            lo, hi = math.log10(self.lo), math.log10(self.hi)
        else:
            v, lo, hi = min(max(value, self.lo), self.hi), self.lo, self.hi
        return self.start + (v - lo) / (hi - lo) * (self.end - self.start)


# ---- numbers ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 × 10^k apart) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    k = 0
    while (value := first + k * step) <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        k += 1
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten in range; with fewer than three, the 2 and 5 multiples as well."""
    lo_exp, hi_exp = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    decades = [10.0**e for e in range(lo_exp, hi_exp + 1)]
    ticks = [t for t in decades if lo <= t <= hi * (1 + 1e-9)]
    if len(ticks) < 3:
        ticks = sorted(m * d for d in decades for m in (1, 2, 5) if lo <= m * d <= hi * (1 + 1e-9))
    return ticks


def fmt_num(value: float) -> str:
    """A tick label: no trailing zeros, thousands as k."""
    if value == 0:
        return "0"
    if abs(value) >= 10_000:
        return f"{value / 1000:g}k"
    return f"{value:.6g}" if value == int(value) else f"{value:.3g}"


def fmt_ms(value: float) -> str:
    """A duration given in milliseconds, in the unit a person reads fastest."""
    if math.isnan(value):
        return "-"
    if value < 1:
        return f"{value:.1f} ms"
    if value < 1000:
        return f"{value:.0f} ms"
    if value < 9_950:
        return f"{round(value / 1000, 1):g} s"
    return f"{value / 1000:.0f} s"


def fmt_seconds(value: float) -> str:
    """A time-axis label in seconds."""
    return f"{fmt_num(value)} s"


# ---- SVG building blocks ---------------------------------------------------------------------


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _text(
    x: float,
    y: float,
    text: str,
    *,
    anchor: str = "start",
    size: int = 12,
    weight: str = "normal",
    color: str = "#222",
    extra: str = "",
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-weight="{weight}" fill="{color}"{extra}>{_esc(text)}</text>'
    )


def _svg_open(title: str, width: int, height: int) -> list[str]:
    return [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{_esc(title)}" font-family="{_esc(_FONT)}">',
        f"<title>{_esc(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
        _text(_MARGIN_L, 22, title, size=15, weight="600"),
    ]


def _legend(items: Sequence[tuple[str, str, str]], width: int) -> list[str]:
    """One row (wrapping if needed) of swatches under the title: (label, colour, kind)."""
    out: list[str] = []
    x, y = float(_MARGIN_L), 42.0
    for label, color, kind in items:
        w = 26 + len(label) * _CHAR_W + 18
        if x + w > width - _MARGIN_R and x > _MARGIN_L:
            x, y = float(_MARGIN_L), y + 16
        if kind == "line":
            out.append(
                f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 18:.1f}" y2="{y - 4:.1f}" '
                f'stroke="{_esc(color)}" stroke-width="3"/>'
            )
        elif kind == "dash":
            out.append(
                f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 18:.1f}" y2="{y - 4:.1f}" '
                f'stroke="{_esc(color)}" stroke-width="2" stroke-dasharray="5 3"/>'
            )
        else:
            out.append(
                f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="14" height="11" '
                f'fill="{_esc(color)}" stroke="#0003"/>'
            )
        out.append(_text(x + 24, y, label))
        x += w
    return out


def _plot_box(width: int, height: int, extra_top: int = 0) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) pixels of the plotting area."""
    return (_MARGIN_L, _MARGIN_T + extra_top, width - _MARGIN_R, height - _MARGIN_B)


def _axes(
    xa: _Axis | None,
    ya: _Axis | None,
    box: tuple[float, float, float, float],
    x_label: str,
    y_label: str,
    x_fmt: Formatter,
    y_fmt: Formatter,
) -> list[str]:
    """Grid lines, tick labels, axis lines and axis titles."""
    left, top, right, bottom = box
    out: list[str] = []
    if ya is not None:
        for t in ya.ticks:
            py = ya(t)
            out.append(
                f'<line x1="{left:.1f}" y1="{py:.1f}" x2="{right:.1f}" y2="{py:.1f}" '
                f'stroke="{_GRID}"/>'
            )
            out.append(_text(left - 6, py + 4, y_fmt(t), anchor="end", color=_AXIS))
    if xa is not None:
        for t in xa.ticks:
            px = xa(t)
            out.append(
                f'<line x1="{px:.1f}" y1="{top:.1f}" x2="{px:.1f}" y2="{bottom:.1f}" '
                f'stroke="{_GRID}"/>'
            )
            out.append(_text(px, bottom + 16, x_fmt(t), anchor="middle", color=_AXIS))
    out.append(
        f'<path d="M{left:.1f},{top:.1f} V{bottom:.1f} H{right:.1f}" fill="none" stroke="{_AXIS}"/>'
    )
    if x_label:
        out.append(_text((left + right) / 2, bottom + 36, x_label, anchor="middle", color=_AXIS))
    if y_label:
        cy = (top + bottom) / 2
        out.append(
            _text(
                16,
                cy,
                y_label,
                anchor="middle",
                color=_AXIS,
                extra=f' transform="rotate(-90 16 {cy:.1f})"',
            )
        )
    return out


def _no_data(box: tuple[float, float, float, float]) -> str:
    left, top, right, bottom = box
    return _text((left + right) / 2, (top + bottom) / 2, "no data", anchor="middle", color="#888")


def _spans_and_markers(
    xa: _Axis,
    box: tuple[float, float, float, float],
    spans: Sequence[Span],
    markers: Sequence[Marker],
) -> tuple[list[str], list[str]]:
    """Shaded phases (drawn behind the data) and event lines (drawn over it)."""
    left, top, right, bottom = box
    behind: list[str] = []
    for s in spans:
        x0, x1 = xa(s.start), xa(s.end)
        if x1 - x0 < 0.5:
            continue
        # The label goes in the legend (`_span_legend`): inside the plot it would cover data.
        behind.append(
            f'<rect x="{x0:.1f}" y="{top:.1f}" width="{x1 - x0:.1f}" height="{bottom - top:.1f}" '
            f'fill="{_esc(s.color)}"><title>{_esc(s.label)}</title></rect>'
        )
    over: list[str] = []
    # Labels of close markers would overlap: alternate their heights.
    last_x = -1e9
    level = 0
    for m in sorted(markers, key=lambda m: m.x):
        px = xa(m.x)
        if not left <= px <= right:
            continue
        level = level + 1 if px - last_x < 150 else 0
        last_x = px
        ly = top + 12 + 13 * (level % 3)
        over.append(
            f'<line x1="{px:.1f}" y1="{top:.1f}" x2="{px:.1f}" y2="{bottom:.1f}" '
            f'stroke="{_esc(m.color)}" stroke-width="1.3" stroke-dasharray="4 3"/>'
        )
        anchor = "end" if px > right - 160 else "start"
        dx = -4 if anchor == "end" else 4
        over.append(
            _text(
                px + dx,
                ly,
                m.label,
                anchor=anchor,
                size=11,
                color=m.color,
                extra=' paint-order="stroke" stroke="#fff" stroke-width="3"',
            )
        )
    return behind, over


def _span_legend(spans: Sequence[Span]) -> list[tuple[str, str, str]]:
    """One legend swatch per distinct labelled kind of span."""
    seen: dict[tuple[str, str], None] = {}
    for s in spans:
        if s.label:
            seen[(s.label, s.color)] = None
    return [(label, color, "box") for label, color in seen]


def _finite(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]


# ---- charts ----------------------------------------------------------------------------------


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    x_label: str = "",
    y_label: str = "",
    x_range: tuple[float, float] | None = None,
    y_range: tuple[float, float] | None = None,
    log_x: bool = False,
    x_fmt: Formatter = fmt_num,
    y_fmt: Formatter = fmt_num,
    y_ticks: Sequence[float] | None = None,
    spans: Sequence[Span] = (),
    markers: Sequence[Marker] = (),
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """Lines (or steps) of several series on shared axes, with optional phases and events.

    `y_ticks` replaces the automatic ticks (e.g. whole numbers for counts)."""
    clean = [(s, _finite(s.points)) for s in series]
    if log_x:
        clean = [(s, [(x, y) for x, y in pts if x > 0]) for s, pts in clean]
    xs = [x for _, pts in clean for x, _ in pts]
    ys = [y for _, pts in clean for _, y in pts]
    legend = [(s.label, s.color, "dash" if s.dashed else "line") for s in series]
    legend += _span_legend(spans)
    extra_top = 16 * _legend_rows(legend, width)
    box = _plot_box(width, height, extra_top)
    left, top, right, bottom = box
    if x_range is not None:
        x_lo, x_hi = x_range
    elif xs:
        x_lo, x_hi = min(xs), max(xs)
    else:
        x_lo, x_hi = (1.0, 10.0) if log_x else (0.0, 1.0)
    if y_range is not None:
        y_lo, y_hi = y_range
    elif ys:
        y_lo, y_hi = min(0.0, min(ys)), max(ys)
        y_hi = y_hi * 1.05 if y_hi > 0 else y_hi
    else:
        y_lo, y_hi = 0.0, 1.0
    xa = _Axis(x_lo, x_hi, left, right, log=log_x)
    xa.ticks = _log_ticks(xa.lo, xa.hi) if log_x else nice_ticks(xa.lo, xa.hi, 10)
    ya = _Axis(y_lo, y_hi, bottom, top)
    ya.ticks = (
        [t for t in y_ticks if ya.lo <= t <= ya.hi]
        if y_ticks is not None
        else nice_ticks(ya.lo, ya.hi, 5)
    )
    out = _svg_open(title, width, height)
    out += _legend(legend, width)
    behind, over = _spans_and_markers(xa, box, spans, markers)
    out += behind
    out += _axes(xa, ya, box, x_label, y_label, x_fmt, y_fmt)
    if not xs:
        out.append(_no_data(box))
    clip = f"clip{next(_ids)}"
    out.append(
        f'<clipPath id="{clip}"><rect x="{left}" y="{top - 2}" width="{right - left}" '
        f'height="{bottom - top + 4}"/></clipPath><g clip-path="url(#{clip})">'
    )
    for s, pts in clean:
        if not pts:
            continue
        coords: list[str] = []
        prev_y: float | None = None
        for x, y in pts:
            px, py = xa(x), ya(y)
            if s.step and prev_y is not None:
                coords.append(f"{px:.1f},{prev_y:.1f}")
            coords.append(f"{px:.1f},{py:.1f}")
            prev_y = py
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(
            f'<polyline points="{" ".join(coords)}" fill="none" stroke="{_esc(s.color)}" '
            f'stroke-width="{s.width}" stroke-linejoin="round"{dash}/>'
        )
        if len(pts) == 1:
            # A lone point draws no line: show it as a dot.
            out.append(
                f'<circle cx="{xa(pts[0][0]):.1f}" cy="{ya(pts[0][1]):.1f}" r="3.5" '
                f'fill="{_esc(s.color)}"/>'
            )
    out.append("</g>")
    out += over
    out.append("</svg>")
    return "\n".join(out)


def _legend_rows(items: Sequence[tuple[str, str, str]], width: int) -> int:
    """How many extra legend rows `_legend` needs beyond the first."""
    x, rows = float(_MARGIN_L), 0
    for label, _, _ in items:
        w = 26 + len(label) * _CHAR_W + 18
        if x + w > width - _MARGIN_R and x > _MARGIN_L:
            x, rows = float(_MARGIN_L), rows + 1
        x += w
    return rows


def cdf_points(values: Sequence[float], floor: float = 0.0) -> list[tuple[float, float]]:
    """The empirical CDF as (value, % of values ≤ it); values under `floor` count at `floor`."""
    ordered = sorted(max(v, floor) for v in values if math.isfinite(v))
    n = len(ordered)
    out: list[tuple[float, float]] = []
    for i, v in enumerate(ordered):
        if i + 1 < n and ordered[i + 1] == v:
            continue  # one point per distinct value: its last rank
        out.append((v, 100.0 * (i + 1) / n))
    if out:
        out.insert(0, (out[0][0], 0.0))
    return out


def cdf_chart(
    title: str,
    groups: Sequence[tuple[str, Sequence[float], str]],
    *,
    x_label: str,
    floor: float = 0.1,
    x_fmt: Formatter = fmt_ms,
    markers: Sequence[Marker] = (),
    dashed: Collection[str] = (),
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """Cumulative distributions of (label, values, colour) on a log x axis; the groups
    whose label is in `dashed` are drawn thinner and dashed (a subset of another, say).

    Values under `floor` (a request dispatched at once waits ~0 ms) are drawn at the floor,
    so the height of the first step reads as "this share never queued".
    """
    series = [
        Series(
            label,
            cdf_points(values, floor),
            color,
            step=True,
            dashed=label in dashed,
            width=1.5 if label in dashed else 2.0,
        )
        for label, values, color in groups
    ]
    hi = max((v for _, values, _ in groups for v in values if math.isfinite(v)), default=floor * 10)
    return line_chart(
        title,
        series,
        x_label=x_label,
        y_label="% of requests ≤ x",
        x_range=(floor, max(hi, floor * 10)),
        y_range=(0.0, 100.0),
        log_x=True,
        x_fmt=x_fmt,
        y_fmt=lambda v: f"{v:g}%",
        markers=markers,
        width=width,
        height=height,
    )


def bar_chart(
    title: str,
    starts: Sequence[float],
    layers: Sequence[Bars],
    *,
    bucket: float = 1.0,
    x_label: str = "",
    y_label: str = "",
    x_range: tuple[float, float] | None = None,
    x_fmt: Formatter = fmt_num,
    spans: Sequence[Span] = (),
    markers: Sequence[Marker] = (),
    overlay: Sequence[Series] = (),
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """Stacked bars: bucket `i` spans [starts[i], starts[i] + bucket); layers stack upward.

    `overlay` lines are drawn on the same axes over the bars (e.g. a share or a limit).
    """
    legend = [(b.label, b.color, "box") for b in layers]
    legend += [(s.label, s.color, "dash" if s.dashed else "line") for s in overlay]
    legend += _span_legend(spans)
    extra_top = 16 * _legend_rows(legend, width)
    box = _plot_box(width, height, extra_top)
    left, top, right, bottom = box
    totals = [sum(b.values[i] for b in layers if i < len(b.values)) for i in range(len(starts))]
    over_y = [y for s in overlay for _, y in _finite(s.points)]
    if x_range is not None:
        x_lo, x_hi = x_range
    elif starts:
        x_lo, x_hi = min(starts), max(starts) + bucket
    else:
        x_lo, x_hi = 0.0, 1.0
    y_hi = max([*totals, *over_y, 0.0])
    xa = _Axis(x_lo, x_hi, left, right)
    xa.ticks = nice_ticks(xa.lo, xa.hi, 10)
    ya = _Axis(0.0, y_hi * 1.08 if y_hi > 0 else 1.0, bottom, top)
    ya.ticks = nice_ticks(ya.lo, ya.hi, 5)
    out = _svg_open(title, width, height)
    out += _legend(legend, width)
    behind, over = _spans_and_markers(xa, box, spans, markers)
    out += behind
    out += _axes(xa, ya, box, x_label, y_label, x_fmt, fmt_num)
    if not starts or y_hi <= 0:
        out.append(_no_data(box))
    px_per_bucket = abs(xa(x_lo + bucket) - xa(x_lo))
    gap = min(2.0, px_per_bucket * 0.15)
    for i, x in enumerate(starts):
        base = 0.0
        x0 = xa(x) + gap / 2
        w = max(px_per_bucket - gap, 0.8)
        for layer in layers:
            v = layer.values[i] if i < len(layer.values) else 0.0
            if v <= 0 or not math.isfinite(v):
                continue
            y0, y1 = ya(base), ya(base + v)
            out.append(
                f'<rect x="{x0:.1f}" y="{y1:.1f}" width="{w:.1f}" height="{y0 - y1:.1f}" '
                f'fill="{_esc(layer.color)}"><title>{_esc(layer.label)}: {fmt_num(v)} '
                f"at {_esc(x_fmt(x))}</title></rect>"
            )
            base += v
    for s in overlay:
        pts = _finite(s.points)
        if pts:
            coords = " ".join(f"{xa(x):.1f},{ya(y):.1f}" for x, y in pts)
            dash = ' stroke-dasharray="6 4"' if s.dashed else ""
            out.append(
                f'<polyline points="{coords}" fill="none" stroke="{_esc(s.color)}" '
                f'stroke-width="{s.width}"{dash}/>'
            )
    out += over
    out.append("</svg>")
    return "\n".join(out)


def timeline_chart(
    title: str,
    lanes: Sequence[tuple[str, Sequence[Band]]],
    colors: Mapping[str, str],
    *,
    x_range: tuple[float, float] | None = None,
    x_label: str = "",
    x_fmt: Formatter = fmt_num,
    markers: Sequence[Marker] = (),
    width: int = WIDTH,
    lane_height: int = 26,
) -> str:
    """One horizontal lane per name, coloured by state over time (`colors[state]`)."""
    legend = [(state, color, "box") for state, color in colors.items()]
    extra_top = 16 * _legend_rows(legend, width)
    # Room for marker labels above the first lane.
    label_room = 40 if markers else 8
    height = _MARGIN_T + extra_top + label_room + max(len(lanes), 1) * lane_height + _MARGIN_B
    name_w = max((len(name) for name, _ in lanes), default=0) * _CHAR_W + 16
    left = max(float(_MARGIN_L), name_w)
    top = _MARGIN_T + extra_top
    right, bottom = width - _MARGIN_R, height - _MARGIN_B
    box = (left, top, right, bottom)
    ends = [b.end for _, bands in lanes for b in bands]
    starts = [b.start for _, bands in lanes for b in bands]
    if x_range is not None:
        x_lo, x_hi = x_range
    elif ends:
        x_lo, x_hi = min(starts), max(ends)
    else:
        x_lo, x_hi = 0.0, 1.0
    xa = _Axis(x_lo, x_hi, left, right)
    xa.ticks = nice_ticks(xa.lo, xa.hi, 10)
    out = _svg_open(title, width, height)
    out += _legend(legend, width)
    out += _axes(xa, None, box, x_label, "", x_fmt, fmt_num)
    if not lanes:
        out.append(_no_data(box))
    for i, (name, bands) in enumerate(lanes):
        y = top + label_room + i * lane_height
        out.append(_text(left - 8, y + lane_height / 2 + 4, name, anchor="end"))
        out.append(
            f'<rect x="{left:.1f}" y="{y + 3:.1f}" width="{right - left:.1f}" '
            f'height="{lane_height - 6}" fill="#f4f4f4"/>'
        )
        for band in bands:
            x0, x1 = xa(band.start), xa(band.end)
            color = colors.get(band.state, "#999")
            out.append(
                f'<rect x="{x0:.1f}" y="{y + 3:.1f}" width="{max(x1 - x0, 1.0):.1f}" '
                f'height="{lane_height - 6}" fill="{_esc(color)}"><title>{_esc(name)}: '
                f"{_esc(band.state)} {_esc(x_fmt(band.start))} – {_esc(x_fmt(band.end))}"
                f"</title></rect>"
            )
    _, over = _spans_and_markers(xa, box, (), markers)
    out += over
    out.append("</svg>")
    return "\n".join(out)


def box_chart(
    title: str,
    groups: Sequence[BoxGroup],
    *,
    y_label: str = "",
    log_y: bool = False,
    y_fmt: Formatter = fmt_num,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> str:
    """Box plots: box p25–p75, a line at the median, whiskers p5–p95, a dot at p99."""
    legend = [
        ("p25–p75", "#bbb", "box"),
        ("median", "#222", "line"),
        ("whiskers p5–p95, dot p99", "#777", "line"),
    ]
    box = _plot_box(width, height)
    left, top, right, bottom = box
    values = [v for g in groups for v in g.values if math.isfinite(v) and (v > 0 or not log_y)]
    lo = min(values, default=1.0)
    hi = max(values, default=10.0)
    if not log_y:
        lo = min(lo, 0.0)
    ya = _Axis(lo, hi * (1.5 if log_y else 1.08), bottom, top, log=log_y)
    ya.ticks = _log_ticks(ya.lo, ya.hi) if log_y else nice_ticks(ya.lo, ya.hi, 5)
    out = _svg_open(title, width, height)
    out += _legend(legend, width)
    out += _axes(None, ya, box, "", y_label, fmt_num, y_fmt)
    if not groups:
        out.append(_no_data(box))
    slot = (right - left) / max(len(groups), 1)
    for i, g in enumerate(groups):
        cx = left + slot * (i + 0.5)
        vals = [v for v in g.values if math.isfinite(v) and (v > 0 or not log_y)]
        out.append(_text(cx, bottom + 16, g.label, anchor="middle"))
        out.append(_text(cx, bottom + 31, f"n={len(vals)}", anchor="middle", size=11, color="#666"))
        if not vals:
            out.append(_text(cx, (top + bottom) / 2, "no data", anchor="middle", color="#888"))
            continue
        p = {q: ya(percentile(vals, q)) for q in (5, 25, 50, 75, 95, 99)}
        half = min(slot * 0.25, 60)
        color = _esc(g.color)
        out.append(
            f'<line x1="{cx:.1f}" y1="{p[5]:.1f}" x2="{cx:.1f}" y2="{p[95]:.1f}" '
            f'stroke="{color}" stroke-width="1.5"/>'
        )
        for q in (5, 95):
            out.append(
                f'<line x1="{cx - half / 2:.1f}" y1="{p[q]:.1f}" x2="{cx + half / 2:.1f}" '
                f'y2="{p[q]:.1f}" stroke="{color}" stroke-width="1.5"/>'
            )
        out.append(
            f'<rect x="{cx - half:.1f}" y="{p[75]:.1f}" width="{2 * half:.1f}" '
            f'height="{max(p[25] - p[75], 1.0):.1f}" fill="{color}" fill-opacity="0.35" '
            f'stroke="{color}" stroke-width="1.5"/>'
        )
        out.append(
            f'<line x1="{cx - half:.1f}" y1="{p[50]:.1f}" x2="{cx + half:.1f}" y2="{p[50]:.1f}" '
            f'stroke="#222" stroke-width="2.5"/>'
        )
        out.append(f'<circle cx="{cx:.1f}" cy="{p[99]:.1f}" r="3" fill="{color}"/>')
        med = percentile(vals, 50)
        out.append(_text(cx + half + 6, p[50] + 4, y_fmt(med), size=11, color="#333"))
    out.append("</svg>")
    return "\n".join(out)


# ---- the page --------------------------------------------------------------------------------

_CSS: Final = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, 'Noto Sans', sans-serif;
       margin: 0 auto; max-width: 1000px; padding: 24px; color: #222; background: #fafafa; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.8em; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
p.lead { color: #444; line-height: 1.5; }
figure { margin: 12px 0 20px; background: #fff; border: 1px solid #e2e2e2; border-radius: 6px;
         padding: 6px; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { font-size: 0.92em; color: #555; padding: 4px 8px 6px; line-height: 1.45; }
figure pre { border: none; margin: 0; padding: 4px 8px; }
pre { background: #fff; border: 1px solid #e2e2e2; border-radius: 6px; padding: 12px;
      overflow-x: auto; font-size: 12.5px; line-height: 1.4; }
.meta { color: #666; font-size: 0.9em; }
"""


def page(
    title: str,
    intro: str,
    sections: Sequence[tuple[str, Sequence[tuple[str, str]]]],
    appendix: Sequence[tuple[str, str]] = (),
    meta: str = "",
) -> str:
    """A whole HTML document: sections of (markup, caption) figures, then preformatted
    appendices.

    `intro`, captions, section names and appendix texts are plain text (escaped here); the
    markup is inserted as it is: the chart functions' output, or other trusted HTML.
    """
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_esc(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head><body>",
        f"<h1>{_esc(title)}</h1>",
    ]
    if meta:
        out.append(f'<p class="meta">{_esc(meta)}</p>')
    for para in intro.split("\n\n"):
        if para.strip():
            out.append(f'<p class="lead">{_esc(para.strip())}</p>')
    for name, figures in sections:
        out.append(f"<h2>{_esc(name)}</h2>")
        for svg, caption in figures:
            out.append("<figure>")
            out.append(svg)
            if caption:
                out.append(f"<figcaption>{_esc(caption)}</figcaption>")
            out.append("</figure>")
    for name, text in appendix:
        out.append(f"<h2>{_esc(name)}</h2>")
        out.append(f"<pre>{_esc(text)}</pre>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
