"""Small line charts rendered to PNG bytes with matplotlib's Agg canvas, for an ipywidgets.Image.

Why not a live matplotlib plot: interactive backends redraw only when the kernel is idle, i.e. after
the training cell has finished. An image widget whose bytes a thread replaces updates meanwhile.

No pyplot: a `Figure` with its own `FigureCanvasAgg` does not touch pyplot's global figure list or
the notebook's backend.

Cost matters, because the drawing thread holds the GIL while matplotlib lays out text and so delays
the training loop: a full redraw of even this small figure is tens of milliseconds of Python. So the
axes, ticks, labels and legend are drawn once into a cached background (blitting) and each render
only restores it, draws the lines and encodes the PNG (fast zlib level). The background is redrawn
only when the axis limits or the set of lines with data change; limits grow in steps, not every call.
"""
from __future__ import annotations

import io
import math
from typing import Sequence

from ..i18n import _, plot_label_language


def plot_text(message: str) -> str:
    """`message` for drawing into a chart image: translated when matplotlib can draw the language, else
    English (without a CJK font, Chinese would come out as empty boxes). Mark the literal with `N_()`."""
    return message if plot_label_language() == "en" else _(message)


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


class LineChart:
    """A fixed set of named lines; `render(x, ys)` returns PNG bytes.

    `xlim`/`ylim` fix an axis; otherwise it follows the data, growing with headroom (x doubles its
    span, y by a margin) and shrinking y only when the data's span falls below 40 % of the axis span.
    """

    def __init__(self, series: Sequence[tuple[str, str]], *, xlabel: str = "", ylabel: str = "",
                 xlim: tuple[float, float] | None = None, ylim: tuple[float, float] | None = None,
                 size: tuple[float, float] = (4.8, 1.7), dpi: int = 90, widths: Sequence[float] | None = None,
                 alphas: Sequence[float] | None = None, legend: str = "upper left"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._fig = Figure(figsize=size, dpi=dpi)
        self._canvas = FigureCanvasAgg(self._fig)
        self._ax = self._fig.add_subplot()
        self._fixed_x, self._fixed_y = xlim, ylim
        self._xlim: tuple[float, float] | None = xlim
        self._ylim: tuple[float, float] | None = ylim
        self._lines = []
        for i, (label, color) in enumerate(series):
            (line,) = self._ax.plot([], [], label=label, color=color, animated=True,  # animated: not in background
                                    linewidth=widths[i] if widths else 1.5, alpha=alphas[i] if alphas else 1.0)
            self._lines.append(line)
        self._ax.set_xlabel(xlabel, fontsize=8)
        self._ax.set_ylabel(ylabel, fontsize=8)
        self._ax.tick_params(labelsize=7)
        self._ax.grid(True, alpha=0.3)
        self._legend = None
        self._legend_loc = legend  # a fixed place: loc="best" is slow on long lines and warns about it
        self._fig.subplots_adjust(left=0.12, right=0.95, top=0.95, bottom=0.25)
        self._background = None
        self._drawn_state = None  # (xlim, ylim, visible lines) the background was drawn for
        self.full_redraws = 0

    def _grow_x(self, x: Sequence[float]) -> tuple[float, float]:
        lo, hi = min(x), max(x)
        cur = self._xlim
        if cur is not None and cur[0] == lo and hi <= cur[1]:
            return cur
        return lo, lo + max(hi - lo, 1.0) * 2.0

    def _grow_y(self, values: list[float]) -> tuple[float, float]:
        lo, hi = min(values), max(values)
        span = hi - lo or max(abs(hi) * 0.1, 1e-3)
        cur = self._ylim
        if cur is not None and cur[0] <= lo and hi <= cur[1] and span >= 0.4 * (cur[1] - cur[0]):
            return cur
        # more headroom on a side the data just escaped through: it is likely to keep going that way
        below = 0.3 if cur is not None and lo < cur[0] else 0.08
        above = 0.3 if cur is not None and hi > cur[1] else 0.08
        new_lo = lo - below * span
        if lo >= 0 > new_lo:
            new_lo = 0.0  # a non-negative quantity (a loss, a percentage) keeps 0 as its floor
        return new_lo, hi + above * span

    def render(self, x: Sequence[float], ys: Sequence[Sequence[float | None]],
               xlim: tuple[float, float] | None = None) -> bytes:
        """Draw each line against `x` (None/NaN values become gaps). `xlim` fixes x for this call."""
        if len(ys) != len(self._lines):
            raise ValueError(_("expected {expected} series, got {got}").format(expected=len(self._lines), got=len(ys)))
        visible = []
        values = []
        for line, y in zip(self._lines, ys):
            y = [float("nan") if v is None else float(v) for v in y]
            line.set_data(list(x), y)
            finite = _finite(y)
            if finite:
                visible.append(line)
                values.extend(finite)
        if xlim is not None:
            self._xlim = xlim
        elif self._fixed_x is None and x:
            self._xlim = self._grow_x(x)
        if self._fixed_y is None and values:
            self._ylim = self._grow_y(values)
        state = (self._xlim, self._ylim, tuple(visible))
        if state != self._drawn_state:
            self._draw_background(visible)
            self._drawn_state = state
        else:
            self._canvas.restore_region(self._background)
        for line in visible:
            self._ax.draw_artist(line)
        return self._png()

    def _draw_background(self, visible) -> None:
        if self._xlim is not None:
            self._ax.set_xlim(*self._xlim)
        if self._ylim is not None:
            self._ax.set_ylim(*self._ylim)
        if self._legend is not None:
            self._legend.remove()
        self._legend = (self._ax.legend(handles=visible, fontsize=7, loc=self._legend_loc, frameon=False,
                                        ncols=max(1, len(visible))) if visible else None)
        self._canvas.draw()  # everything but the (animated) lines
        self._background = self._canvas.copy_from_bbox(self._fig.bbox)
        self.full_redraws += 1

    def _png(self) -> bytes:
        from PIL import Image  # a matplotlib dependency

        width, height = self._canvas.get_width_height()
        image = Image.frombuffer("RGBA", (width, height), self._canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        buffer = io.BytesIO()
        image.save(buffer, format="png", compress_level=1)  # fast zlib: a few ms instead of ~15
        return buffer.getvalue()
