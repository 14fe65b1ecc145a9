"""`TrainingProgress`: a progress bar with rate and time left, and a live loss curve.

As a `Trainer` callback:

    trainer = Trainer(model, opt, loss_fn, loader, callbacks=[TrainingProgress(epochs=5)])
    trainer(5)

or standalone:

    with TrainingProgress(total_steps=1000) as progress:
        for batch in batches:
            loss = step(batch)
            progress.update(loss)          # O(1): keeps a reference, no .item()

Per step this only appends `(step, loss)` to a deque. A thread wakes about once a second, turns the
pending loss tensors into floats in one go (one CPU-GPU sync per second, in that thread, instead of
one per step in the training loop), updates the bar and text, and redraws the curve at most every
`chart_interval` seconds. Interactive matplotlib backends cannot do this: they redraw only once the
cell has finished.
"""
from __future__ import annotations

import math
import time
from collections import deque

import torch

from ..callbacks import Callback
from ..i18n import N_, _
from . import loop
from .chart import LineChart, plot_text
from ._widgets import display_widget, escape, fmt_duration, set_changed, set_visible

_MAX_POINTS = 4000  # loss points kept for the curve; older ones are averaged in pairs beyond this
_MAX_PENDING = 100_000  # losses waiting for the next refresh


class TrainingProgress(Callback):
    """Progress bar (steps, rate, elapsed, time left) and live loss curve for a training run.

    Args:
        total_steps: steps in the run (from `start()`, or from the Trainer's `on_train_start`), for the
            bar and the time left. As a Trainer callback it can instead come from `epochs` x
            len(train_loader); if neither is known the bar follows the current epoch.
        epochs: epochs the coming `trainer(epochs)` call will run (the Trainer does not tell callbacks).
        interval: seconds between refreshes (default 1).
        chart_interval: minimum seconds between loss-curve redraws (default 2).
        display: show the panel in the running cell when training starts (inside a kernel only).
        smoothing: weight of the newest loss in the smoothed curve (exponential moving average).
    """

    KIND = "TrainingProgress"

    def __init__(self, total_steps: int | None = None, *, epochs: int | None = None, interval: float = 1.0,
                 chart_interval: float = 2.0, display: bool = True, smoothing: float = 0.05):
        for name, value in (("total_steps", total_steps), ("epochs", epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(_("{name} must be a non-negative int or None, got {value!r}").format(name=name,
                                                                                                    value=value))
        if not (isinstance(chart_interval, (int, float)) and chart_interval > 0):
            raise ValueError(_("chart_interval must be a positive number of seconds, got {value!r}").format(
                value=chart_interval))
        if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ValueError(_("smoothing must be in (0, 1], got {value!r}").format(value=smoothing))
        self.total_steps = total_steps
        self.epochs = epochs
        self.chart_interval = float(chart_interval)
        self.smoothing = float(smoothing)
        self.auto_display = display
        self._loop = loop.Loop(self._tick, interval, name="course_utils TrainingProgress", on_error=self._failed)
        # (step, loss) appended by the training thread, drained by the refresh; bounded so that update()
        # without a running thread cannot pile up tensors forever (the oldest are dropped)
        self._pending: deque = deque(maxlen=_MAX_PENDING)
        self.steps = 0                      # steps seen by update(); only the training thread writes it
        self.loss_steps: list[float] = []   # the curve, as floats, filled by the monitor thread
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.epoch_logs: list[tuple[int, int, dict]] = []  # (epoch, step, logs)
        self._ema_sum, self._ema_count = 0.0, 0
        self._epoch: int | None = None
        self._epoch_first_step = 0
        self._steps_per_epoch: int | None = None
        self._run_first = 0                 # the step this run started at
        self._run_total: int | None = None  # the step this run will end at, when known
        self._start_time: float | None = None
        self._start_steps = 0
        self._rate_window: deque = deque(maxlen=16)  # (time, steps) at refreshes
        self._last_chart = float("-inf")
        # made in the caller's thread (see DeviceMonitor): matplotlib's first import may log
        self._chart = LineChart([(plot_text(N_("loss")), "tab:blue"), (plot_text(N_("smoothed")), "tab:red")],
                                xlabel=plot_text(N_("step")), ylabel=plot_text(N_("loss")),
                                widths=[0.8, 1.8], alphas=[0.35, 1.0],
                                legend="upper right")  # a falling loss leaves that corner empty
        self._displayed = False
        self._build()

    # --- the per-step path (training thread) ---------------------------------------------
    def update(self, loss: torch.Tensor | float | None = None, steps: int = 1, step: int | None = None) -> None:
        """Record `steps` finished steps (or jump to absolute `step`) and, optionally, the last loss.

        Cheap enough to call every step: no sync, no widget traffic. `loss` must hold one number
        (a 0-d or 1-element tensor on any device, or a Python number); it is detached so the autograd
        graph is not kept alive.
        """
        if step is not None:
            self.steps = step
        else:
            self.steps += steps
        if loss is None:
            return
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:  # metadata only, no sync
                raise ValueError(_("loss must be a single number, got a tensor of shape {shape}").format(
                    shape=tuple(loss.shape)))
            loss = loss.detach()
        elif not isinstance(loss, (int, float)):
            raise TypeError(_("loss must be a tensor, a number or None, got {type}").format(type=type(loss).__name__))
        self._pending.append((self.steps, loss))  # deque.append is atomic: no lock on the hot path

    # --- Trainer callback hooks --------------------------------------------------------------
    def on_train_start(self, trainer) -> None:
        try:
            self._steps_per_epoch = len(trainer.train_loader)
        except TypeError:  # a loader without a length
            self._steps_per_epoch = None
        self.steps = trainer.batches_trained
        if getattr(trainer, "epochs_this_call", None):  # course_utils.Trainer says how many epochs this call runs
            self.epochs = trainer.epochs_this_call
        if self.auto_display and not self._displayed:
            self.show()
        self.start()

    def on_epoch_start(self, trainer) -> None:
        self._epoch = trainer.epoch
        self._epoch_first_step = self.steps

    def on_batch_end(self, trainer, loss: torch.Tensor) -> None:
        self.update(loss, step=trainer.batches_trained)

    def on_epoch_end(self, trainer, logs: dict) -> None:
        self.epoch_logs.append((trainer.epoch - 1, self.steps, dict(logs)))

    def on_train_end(self, trainer) -> None:
        self.stop()

    # --- widgets -------------------------------------------------------------------------
    def _build(self) -> None:
        import ipywidgets as w

        self._bar = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="24em"))
        self._bar_text = w.Label("")
        self._text = w.HTML("")
        self._image = w.Image(format="png", layout=w.Layout(display="none", width="432px"))
        self.widget = w.VBox([w.HBox([self._bar, self._bar_text]), self._text, self._image])
        self.widget.add_class("course-training-progress")

    def _total(self) -> tuple[int | None, int]:
        """(the step the bar ends at, the step it starts from); (None, 0) when unknown."""
        if self._run_total is not None:
            return self._run_total, self._run_first
        if self._steps_per_epoch:
            return self._epoch_first_step + self._steps_per_epoch, self._epoch_first_step
        return None, 0

    def _drain(self) -> None:
        """Move pending losses into the float lists. CPU-GPU sync point: once per refresh, in this thread."""
        items = [self._pending.popleft() for _i in range(len(self._pending))]
        if not items:
            return
        values = [v for _step, v in items]
        if all(isinstance(v, torch.Tensor) for v in values) and len({v.device for v in values}) == 1:
            floats = torch.stack([v.reshape(()) for v in values]).float().cpu().tolist()
        else:
            floats = [float(v) for v in values]
        keep = 1.0 - self.smoothing
        for (step, _loss), value in zip(items, floats):
            if math.isfinite(value):  # a NaN/inf loss is shown as such but does not poison the average
                self._ema_sum = keep * self._ema_sum + self.smoothing * value
                self._ema_count += 1
            self.loss_steps.append(step)
            self.losses.append(value)
            # debiased like TensorBoard's smoothing: the average starts at 0, so divide by the weight it has
            self.smoothed.append(self._ema_sum / (1.0 - keep ** self._ema_count) if self._ema_count else value)
        if len(self.losses) > _MAX_POINTS:  # halve the resolution; keeps memory and drawing time bounded
            for name in ("loss_steps", "losses", "smoothed"):
                xs = getattr(self, name)
                setattr(self, name, [(xs[i] + xs[i + 1]) / 2 for i in range(0, len(xs) - 1, 2)] + (
                    [xs[-1]] if len(xs) % 2 else []))

    def refresh(self) -> None:
        """Update bar, text and (at most every chart_interval s) the curve now; what the thread does."""
        self._drain()
        now, steps = time.monotonic(), self.steps
        self._rate_window.append((now, steps))
        t0, s0 = self._rate_window[0]
        rate = (steps - s0) / (now - t0) if now - t0 > 0.2 and steps >= s0 else None
        elapsed = now - self._start_time if self._start_time is not None else 0.0
        total, first = self._total()
        if total:
            done = min(max(steps - first, 0), total - first)
            set_changed(self._bar, max=max(total - first, 1), value=done)
            left = (total - steps) / rate if rate else None
            text = _("{done}/{total} steps").format(done=steps - first, total=total - first)
            timing = _("{elapsed} elapsed, {left} left").format(elapsed=fmt_duration(elapsed), left=fmt_duration(left))
        else:
            set_changed(self._bar, max=1, value=0, bar_style="info")
            text = _("{steps} steps").format(steps=steps)
            timing = _("{elapsed} elapsed").format(elapsed=fmt_duration(elapsed))
        rate_text = _("{rate:.1f} steps/s").format(rate=rate) if rate else _("? steps/s")
        set_changed(self._bar_text, value=f"{text} · {rate_text} · {timing}")
        parts = []
        if self._epoch is not None:
            if self.epochs:
                parts.append(_("epoch {epoch} (this run: {epochs})").format(epoch=self._epoch + 1, epochs=self.epochs))
            else:
                parts.append(_("epoch {epoch}").format(epoch=self._epoch + 1))
        if self.losses:
            parts.append(_("loss {loss:.4g} (smoothed {smoothed:.4g})").format(loss=self.losses[-1],
                                                                               smoothed=self.smoothed[-1]))
        if self.epoch_logs:
            epoch, _step, logs = self.epoch_logs[-1]
            shown = ", ".join(f"{k} {_number(v)}" for k, v in logs.items())
            parts.append(_("epoch {epoch} done: {logs}").format(epoch=epoch + 1, logs=shown))
        set_changed(self._text, value=escape(" · ".join(parts)))
        if self.losses and now - self._last_chart >= self.chart_interval:
            self._last_chart = now
            self._draw_chart()

    def _draw_chart(self) -> None:
        xlim = None
        if self._run_total is not None:  # the whole run's width up front: no rescaling as it proceeds
            xlim = (min(self.loss_steps[0], self._run_first), max(self._run_total, self.loss_steps[-1]))
        set_changed(self._image, value=self._chart.render(self.loss_steps, [self.losses, self.smoothed], xlim))
        set_visible(self._image, True)

    def _tick(self) -> None:
        self.refresh()

    def _failed(self, exc: BaseException) -> None:
        set_changed(self._bar, bar_style="danger")
        set_changed(self._text, value=_("<b>progress display stopped:</b> {error}: {message}").format(
            error=escape(type(exc).__name__), message=escape(str(exc))))
        loop.release(self.KIND, self)

    # --- lifecycle -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._loop.running

    @property
    def error(self) -> BaseException | None:
        return self._loop.error

    def start(self) -> "TrainingProgress":
        """Start refreshing (idempotent); stops any other TrainingProgress running in this kernel."""
        if self.running:
            return self
        loop.claim(self.KIND, self)
        self._run_first = self.steps
        if self.total_steps is not None:
            self._run_total = self._run_first + self.total_steps
        elif self.epochs is not None and self._steps_per_epoch is not None:
            self._run_total = self._run_first + self.epochs * self._steps_per_epoch
        else:
            self._run_total = None
        self._start_time = time.monotonic()
        self._rate_window.clear()
        set_changed(self._bar, bar_style="")
        self._loop.start()
        return self

    def stop(self) -> None:
        """Stop the thread and draw the final state (bar, text and curve) once more."""
        was_running = self.running
        self._loop.stop()
        loop.release(self.KIND, self)
        if was_running and self._loop.error is None:
            self._last_chart = float("-inf")
            self.refresh()
            total, _first = self._total()
            set_changed(self._bar, bar_style="success" if total and self.steps >= total else "")

    def show(self) -> "TrainingProgress":
        """Display the panel in the running cell (inside a Jupyter kernel; elsewhere a no-op)."""
        self._displayed = display_widget(self.widget) or self._displayed
        return self

    def __enter__(self) -> "TrainingProgress":
        if self.auto_display and not self._displayed:
            self.show()
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _repr_mimebundle_(self, **kwargs):
        self._displayed = True
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        return f"TrainingProgress({self.steps} steps, {'running' if self.running else 'stopped'})"


def _number(value) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return escape(str(value))
