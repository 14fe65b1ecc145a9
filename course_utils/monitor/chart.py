"""Small line charts rendered to PNG bytes with matplotlib's Agg canvas, for an ipywidgets.Image.

Why not a live matplotlib plot: interactive backends redraw only when the kernel is idle, i.e. after
the training cell has finished. An image widget whose bytes a thread replaces updates meanwhile.

No pyplot: a `Figure` with its own `FigureCanvasAgg` does not touch pyplot's global figure list or
the notebook's backend. The figure and its lines are made once and only their data changes, which
keeps a redraw at a few milliseconds.
"""
from __future__ import annotations

import io
from typing import Sequence


class LineChart:
    """A fixed set of named lines; `render(x, ys)` returns PNG bytes."""

    def __init__(self, series: Sequence[tuple[str, str]], *, xlabel: str = "", ylabel: str = "",
                 ylim: tuple[float, float] | None = None, size: tuple[float, float] = (4.8, 1.7), dpi: int = 90,
                 widths: Sequence[float] | None = None, alphas: Sequence[float] | None = None,
                 legend: str = "upper left"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._fig = Figure(figsize=size, dpi=dpi)
        self._canvas = FigureCanvasAgg(self._fig)
        self._ax = self._fig.add_subplot()
        self._ylim = ylim
        self._lines = []
        for i, (label, color) in enumerate(series):
            (line,) = self._ax.plot([], [], label=label, color=color,
                                    linewidth=widths[i] if widths else 1.5, alpha=alphas[i] if alphas else 1.0)
            self._lines.append(line)
        self._ax.set_xlabel(xlabel, fontsize=8)
        self._ax.set_ylabel(ylabel, fontsize=8)
        self._ax.tick_params(labelsize=7)
        self._ax.grid(True, alpha=0.3)
        if ylim is not None:
            self._ax.set_ylim(*ylim)
        self._legend = None
        self._legend_loc = legend  # a fixed place: loc="best" is slow on long lines and warns about it
        self._fig.subplots_adjust(left=0.12, right=0.95, top=0.95, bottom=0.25)

    def render(self, x: Sequence[float], ys: Sequence[Sequence[float | None]]) -> bytes:
        """Draw each line (None values become gaps) against `x`; lines with no data are left out of the legend."""
        if len(ys) != len(self._lines):
            raise ValueError(f"expected {len(self._lines)} series, got {len(ys)}")
        shown = []
        for line, y in zip(self._lines, ys):
            y = [float("nan") if v is None else v for v in y]
            line.set_data(list(x), y)
            has_data = any(v == v for v in y)  # v == v is False for NaN
            line.set_visible(has_data)
            if has_data:
                shown.append(line)
        self._ax.relim(visible_only=True)
        self._ax.autoscale_view(scalex=True, scaley=self._ylim is None)
        if x:
            lo, hi = min(x), max(x)
            self._ax.set_xlim(lo, hi if hi > lo else lo + 1)
        if self._legend is not None:
            self._legend.remove()
        self._legend = (self._ax.legend(handles=shown, fontsize=7, loc=self._legend_loc, frameon=False,
                                        ncols=max(1, len(shown))) if shown else None)
        buffer = io.BytesIO()
        self._canvas.print_png(buffer)
        return buffer.getvalue()
