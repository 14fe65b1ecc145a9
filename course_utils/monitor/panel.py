"""`DeviceMonitor`: a live panel of GPU, PyTorch-allocator and host readings for a notebook.

    with DeviceMonitor():          # shows the panel, updates it about once a second
        trainer(5)                 # ... while this cell runs

    monitor = DeviceMonitor().start()   # or keep it running across cells
    monitor                              # (display it)
    monitor.stop()

One per kernel: starting a monitor stops the one already running (kept in a module-level registry),
so re-running the cell replaces the old panel's thread instead of adding a second one. The old
panel then reads "stopped".

The thread only sets widget values (never prints or displays, which would land in whatever cell is
running), only when a shown value changed, one message per widget per refresh; the history chart is
re-rendered at most every `chart_interval` seconds.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..i18n import N_, _
from . import loop
from .chart import LineChart, plot_text
from ._widgets import Meter, display_widget, escape, fmt_bytes, level_style, set_changed, set_visible
from .sampler import Sampler
from .stats import Snapshot

_SERIES = [(N_("GPU util"), "tab:green"), (N_("GPU memory"), "tab:purple"), (N_("PyTorch reserved"), "tab:orange"),
           (N_("CPU"), "tab:blue"), (N_("RAM"), "tab:gray")]  # drawn as plot_text(label)


def _pct(part, whole) -> float | None:
    return 100.0 * part / whole if part is not None and whole else None


class DeviceMonitor:
    """Live GPU / PyTorch / CPU-RAM panel, refreshed from a daemon thread while cells run.

    Sections: "whole GPU (NVML)" — utilization, memory, temperature and power of the GPU, counting
    every process on it; "this kernel (PyTorch)" — what this kernel's caching allocator holds
    (allocated, reserved, peak); "host" — CPU and RAM, against container limits when set. Sections
    without data (no GPU, CUDA not used yet) are hidden and a note says why.

    Args:
        interval: seconds between refreshes (default 1).
        chart_interval: minimum seconds between history-chart redraws (default 2).
        history: seconds of history kept for the chart (default 120).
        device: the CUDA device to watch; default: the current device of the thread calling
            `start()` if CUDA is initialised by then, else cuda:0.
        sampler: a `Sampler` to use instead of the default one (all three sources).
    """

    KIND = "DeviceMonitor"

    def __init__(self, interval: float = 1.0, chart_interval: float = 2.0, history: float = 120.0,
                 device=None, sampler: Sampler | None = None):
        if not (isinstance(chart_interval, (int, float)) and chart_interval > 0):
            raise ValueError(_("chart_interval must be a positive number of seconds, got {value!r}").format(
                value=chart_interval))
        if not (isinstance(history, (int, float)) and history > 0):
            raise ValueError(_("history must be a positive number of seconds, got {value!r}").format(value=history))
        self._auto_device = device is None and sampler is None
        self.sampler = sampler if sampler is not None else Sampler(device=device)
        self._loop = loop.Loop(self._tick, interval, name="course_utils DeviceMonitor", on_error=self._failed)
        self.chart_interval = float(chart_interval)
        self._history_seconds = float(history)
        self.history: deque[Snapshot] = deque(maxlen=max(2, int(history / self._loop.interval) + 1))
        self.latest: Snapshot | None = None
        self.samples = 0
        self._last_chart = float("-inf")
        # Made here, in the caller's thread: importing matplotlib the first time may log "building the
        # font cache", which from the monitor thread would land in whatever cell is running.
        self._chart = LineChart([(plot_text(label), color) for label, color in _SERIES],
                                xlabel=plot_text(N_("seconds ago")), ylabel="%", ylim=(0, 105))  # 100 % stays visible
        self._build()

    # --- widgets -------------------------------------------------------------------------
    def _build(self) -> None:
        import ipywidgets as w

        self._status = w.Label(_("not started"))
        self._gpu_title = w.HTML(_("<b>whole GPU (NVML)</b>"))
        self._gpu = {k: Meter(n) for k, n in (("util", _("utilization")), ("mem", _("memory used")),
                                              ("temp", _("temperature")), ("power", _("power")))}
        self._torch_title = w.HTML(_("<b>this kernel (PyTorch)</b>"))
        self._torch = {k: Meter(n) for k, n in (("alloc", _("allocated")), ("reserved", _("reserved")),
                                                ("peak", _("peak allocated")))}
        self._host_title = w.HTML(_("<b>host CPU and RAM</b>"))
        self._host = {k: Meter(n) for k, n in (("cpu", _("CPU busy")), ("ram", _("RAM used")),
                                               ("rss", _("this kernel's RAM")))}
        self._notes = w.HTML("", layout=w.Layout(display="none"))
        self._error = w.HTML("", layout=w.Layout(display="none"))
        self._image = w.Image(format="png", layout=w.Layout(display="none", width="432px"))
        self._gpu_box = w.VBox([self._gpu_title] + [m.box for m in self._gpu.values()],
                               layout=w.Layout(display="none"))
        self._torch_box = w.VBox([self._torch_title] + [m.box for m in self._torch.values()],
                                 layout=w.Layout(display="none"))
        self._host_box = w.VBox([self._host_title] + [m.box for m in self._host.values()],
                                layout=w.Layout(display="none"))
        self.widget = w.VBox([w.HBox([w.HTML(_("<b>Device monitor</b>") + "&nbsp;"), self._status]),
                              self._gpu_box, self._torch_box, self._host_box, self._notes, self._error,
                              self._image])
        self.widget.add_class("course-device-monitor")

    def _show(self, snap: Snapshot) -> None:
        g, t, h = snap.gpu, snap.torch, snap.host
        set_visible(self._gpu_box, g is not None)
        if g is not None:
            name = g.name or "GPU"
            if g.mig:
                name = _("{name} (MIG slice)").format(name=name)
            set_changed(self._gpu_title, value=_("<b>whole GPU (NVML)</b> · {name} · all processes").format(
                name=escape(name)))
            na = _("n/a")
            self._gpu["util"].set(g.utilization, na if g.utilization is None else f"{g.utilization:.0f} %")
            mem = _pct(g.memory_used, g.memory_total)
            self._gpu["mem"].set(mem, na if mem is None else
                                 f"{fmt_bytes(g.memory_used)} / {fmt_bytes(g.memory_total)}", level_style(mem))
            self._gpu["temp"].set(g.temperature, na if g.temperature is None else f"{g.temperature:.0f} °C",
                                  level_style(g.temperature, 80, 90))
            power = _pct(g.power, g.power_limit)
            self._gpu["power"].set(power, na if g.power is None else f"{g.power:.0f} W" + (
                f" / {g.power_limit:.0f} W" if g.power_limit else ""))
        set_visible(self._torch_box, t is not None)
        if t is not None:
            set_changed(self._torch_title, value=_("<b>this kernel (PyTorch)</b> · {device}").format(device=t.device))
            for key, value in (("alloc", t.allocated), ("reserved", t.reserved), ("peak", t.peak)):
                pct = _pct(value, t.total)
                self._torch[key].set(pct, f"{fmt_bytes(value)} / {fmt_bytes(t.total)}", level_style(pct))
        set_visible(self._host_box, h is not None)
        if h is not None:
            cpus = (_("{count:g} CPUs") if h.cpu_count != 1 else _("{count:g} CPU")).format(count=h.cpu_count)
            limits = [x for x, on in ((_("CPU quota {count:g}").format(count=h.cpu_count), h.cpu_limited),
                                      (_("memory limit {size}").format(size=fmt_bytes(h.ram_total)), h.ram_limited))
                      if on]
            title = _("<b>host CPU and RAM</b>")
            if limits:
                title += _(" · container: {limits}").format(limits=_(", ").join(limits))
            set_changed(self._host_title, value=title)
            cpu = _("n/a") if h.cpu_percent is None else _("{percent:.1f} % of {cpus}").format(
                percent=h.cpu_percent, cpus=cpus)
            if h.cpu_percent is not None and h.kernel_cpu_percent is not None:  # who is busy: this kernel or others
                cpu += _(" (this kernel {mine:.0f} %, other processes {others:.0f} %)").format(
                    mine=h.kernel_cpu_percent, others=h.cpu_percent - h.kernel_cpu_percent)
            self._host["cpu"].set(h.cpu_percent, cpu)
            ram = _pct(h.ram_used, h.ram_total)
            self._host["ram"].set(ram, f"{fmt_bytes(h.ram_used)} / {fmt_bytes(h.ram_total)}", level_style(ram))
            rss = _pct(h.process_rss, h.ram_total)
            self._host["rss"].set(rss, fmt_bytes(h.process_rss))
        set_changed(self._notes, value="<br>".join(f"<small>{escape(n)}</small>" for n in snap.notes))
        set_visible(self._notes, bool(snap.notes))

    def _draw_chart(self) -> None:
        snaps = list(self.history)
        now = snaps[-1].time
        x = [s.time - now for s in snaps]
        ys = [[s.gpu and s.gpu.utilization for s in snaps],
              [s.gpu and _pct(s.gpu.memory_used, s.gpu.memory_total) for s in snaps],
              [s.torch and _pct(s.torch.reserved, s.torch.total) for s in snaps],
              [s.host and s.host.cpu_percent for s in snaps],
              [s.host and _pct(s.host.ram_used, s.host.ram_total) for s in snaps]]
        # the x axis widens in a few steps up to the full history, so the axes are redrawn rarely
        span = next((w for w in (30.0, 60.0) if -x[0] <= w and w < self._history_seconds), self._history_seconds)
        set_changed(self._image, value=self._chart.render(x, ys, xlim=(-span, 0.0)))
        set_visible(self._image, True)

    # --- the loop ------------------------------------------------------------------------
    def refresh(self) -> Snapshot:
        """Take one sample and update the panel now (what the thread does every `interval`)."""
        snap = self.sampler.sample()
        self.latest = snap
        self.history.append(snap)
        self._show(snap)
        self.samples += 1
        set_changed(self._status, value=_("updated {time} · sample {number}").format(
            time=time.strftime("%H:%M:%S", time.localtime(snap.time)), number=self.samples))
        if time.monotonic() - self._last_chart >= self.chart_interval and len(self.history) >= 2:
            self._last_chart = time.monotonic()
            self._draw_chart()
        return snap

    def _tick(self) -> None:
        self.refresh()

    def _failed(self, exc: BaseException) -> None:
        set_changed(self._error, value=_("<b>monitor stopped:</b> {error}: {message}").format(
            error=escape(type(exc).__name__), message=escape(str(exc))))
        set_visible(self._error, True)
        set_changed(self._status, value=_("stopped after an error"))
        loop.release(self.KIND, self)

    @property
    def running(self) -> bool:
        return self._loop.running

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the thread, if one did."""
        return self._loop.error

    @classmethod
    def current(cls) -> "DeviceMonitor | None":
        """The monitor running in this kernel, if any."""
        return loop.current(cls.KIND)

    def start(self) -> "DeviceMonitor":
        """Start refreshing (idempotent). Stops any other DeviceMonitor running in this kernel first."""
        if self.running:
            return self
        loop.claim(self.KIND, self)
        if self._auto_device and torch.cuda.is_initialized():  # current device is per thread: read it here
            index = torch.cuda.current_device()
            for source in (self.sampler.nvml, self.sampler.torch):
                if source is not None and hasattr(source, "index"):
                    source.index = index
        set_visible(self._error, False)
        set_changed(self._status, value=_("starting"))
        self._loop.start()
        return self

    def stop(self) -> None:
        """Stop refreshing and wait for the thread to end (idempotent). The panel keeps its last values."""
        self._loop.stop()
        loop.release(self.KIND, self)
        if self._loop.error is None:
            set_changed(self._status, value=_("stopped at {time}").format(time=time.strftime("%H:%M:%S")))

    def show(self) -> "DeviceMonitor":
        """Display the panel in the running cell (inside a Jupyter kernel; elsewhere a no-op)."""
        display_widget(self.widget)
        return self

    def __enter__(self) -> "DeviceMonitor":
        self.show()
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"DeviceMonitor({state}, every {self._loop.interval:g} s, {len(self.history)} samples)"
