"""Widget plumbing shared by the panels: send only what changed, batched per widget.

Every trait change on a widget is one comm message to the browser. A panel refreshed once a second
would otherwise resend every value; here a widget is touched only when its shown value differs, and
all its changes go out as one message (`hold_sync`). That keeps a panel at a handful of messages per
second, far below Jupyter's default iopub_msg_rate_limit of 1000 msg/s.
"""
from __future__ import annotations

import html

from ..i18n import _


def set_changed(widget, **traits) -> bool:
    """Set the traits whose value differs, in one message. Returns whether anything was sent."""
    changed = {k: v for k, v in traits.items() if getattr(widget, k) != v}
    if not changed:
        return False
    with widget.hold_sync():
        for name, value in changed.items():
            setattr(widget, name, value)
    return True


def set_visible(widget, visible: bool) -> None:
    set_changed(widget.layout, display=None if visible else "none")


def fmt_bytes(n: float | None) -> str:
    """Three significant digits (1.02 GiB, 23.5 GiB, 512 MiB): small changes stay visible."""
    if n is None:
        return _("n/a")
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:#.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def escape(text: str) -> str:
    return html.escape(text, quote=False)


def in_kernel() -> bool:
    """True inside a Jupyter (IPython) kernel, where displaying a widget makes sense."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def display_widget(widget) -> bool:
    """Display `widget` in the running cell when inside a kernel; elsewhere do nothing (no text repr)."""
    if not in_kernel():
        return False
    from IPython.display import display

    display(widget)
    return True


class Meter:
    """One row: name, a bar, and the value as text."""

    def __init__(self, name: str, maximum: float = 100.0):
        import ipywidgets as w

        self.name = w.Label(name, layout=w.Layout(width="11em"))
        self.bar = w.FloatProgress(value=0.0, min=0.0, max=maximum, layout=w.Layout(width="14em"))
        self.text = w.Label("", layout=w.Layout(width="18em"))
        self.box = w.HBox([self.name, self.bar, self.text])

    def set(self, value: float | None, text: str, style: str = "") -> None:
        """`value` in the bar's units (None: empty bar); `text` shown next to it."""
        v = 0.0 if value is None else round(min(max(float(value), self.bar.min), self.bar.max), 1)
        set_changed(self.bar, value=v, bar_style=style)
        set_changed(self.text, value=text)

    def show(self, visible: bool) -> None:
        set_visible(self.box, visible)


def level_style(percent: float | None, warn: float = 75.0, danger: float = 90.0) -> str:
    """Bar colour for a 'fullness' reading."""
    if percent is None:
        return ""
    return "danger" if percent >= danger else "warning" if percent >= warn else "success"
