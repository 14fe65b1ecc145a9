"""Callbacks: code that watches a `Trainer` run or acts on it, without editing the loop.

A callback overrides the hooks it needs. The Trainer calls them in this order:

    on_train_start                         once per call of trainer(epochs)
      on_epoch_start                       every epoch
        on_batch_start(batch)              every batch, once it is on the device
        on_after_backward                  every optimizer step: gradients complete (scaled under fp16)
        on_before_optimizer_step           after unscaling and clipping, just before optimizer.step()
        on_after_optimizer_step            after it
        on_batch_end(loss)                 every batch: its mean loss, a detached tensor on the device
      on_epoch_end(logs)                   logs: {"loss": ..., "val_loss": ..., "val_accuracy": ...}
    on_train_end                           always, also after Ctrl-C or StopTraining

With `accumulate=k`, an optimizer step follows every k batches. A hook may raise `StopTraining` to end the run
(the rest of the callbacks still get that event first): raised inside an epoch, it takes effect at the next step
boundary (the step in progress, all batches of its group, is finished first), so the run stops between two
optimizer steps and resumes exactly; raised in on_train_start, on_epoch_start or on_epoch_end, it stops before
the next epoch. A method named like a hook that is not one (`on_step_end`) is never called: the Trainer warns,
naming the nearest hook. A callback done with a hook may set it to None (`self.on_batch_start = None`): the
Trainer's next call leaves it out. Callbacks run in the order of their `order` attribute
(lower first; the list order among equals), so a scheduler steps before a checkpoint is written whatever
order they were passed in. `state_dict()` / `load_state_dict()` put a callback's own state in the Trainer's
checkpoints.

In a distributed run every rank runs the callbacks. A StopTraining raised on any rank stops every rank at the
same step, with its reason: within about half a second of the one where it was raised (2 steps where steps take
longer than a quarter second), or at the epoch's end (ranks agree without waiting at every step), or at once
between epochs.

Hooks get no tensors' values: calling `.item()` on `loss` every batch is a CPU-GPU sync, so keep the tensor
or sum it on the device instead.
"""
from __future__ import annotations

import difflib
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .epoch import NonFiniteLossError
from .errors import learner_stacklevel
from .i18n import _

if TYPE_CHECKING:  # for annotations only: this module does not import the trainer
    from .trainer import Trainer

HOOKS = ("on_train_start", "on_epoch_start", "on_batch_start", "on_after_backward", "on_before_optimizer_step",
         "on_after_optimizer_step", "on_batch_end", "on_epoch_end", "on_train_end")


class StopTraining(Exception):
    """Raise from any callback hook to end training; the message says why (kept in `trainer.stop_reason`)."""


class Callback:
    """Override the hooks you need; the others cost nothing (the Trainer only calls overridden ones)."""

    order = 0

    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_epoch_start(self, trainer: "Trainer") -> None: ...
    def on_batch_start(self, trainer: "Trainer", batch) -> None: ...
    def on_after_backward(self, trainer: "Trainer") -> None: ...
    def on_before_optimizer_step(self, trainer: "Trainer") -> None: ...
    def on_after_optimizer_step(self, trainer: "Trainer") -> None: ...
    def on_batch_end(self, trainer: "Trainer", loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, trainer: "Trainer", logs: dict) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...

    @property
    def state_name(self) -> str:
        """What a checkpoint calls this callback's state: its class name. A state goes back only to a callback
        of the same name."""
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """This callback's state for a checkpoint (plain values and tensors only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""


def overridden(callback: Callback, hook: str) -> bool:
    """Whether `callback` does something at `hook`: its class defines it (not only `Callback`), and the callback
    has not set it to None since (done with it: the Trainer leaves it out from its next call on)."""
    return getattr(type(callback), hook, None) is not getattr(Callback, hook) and getattr(callback, hook) is not None


def warn_unknown_hooks(callback) -> None:
    """Warn (once per callback) about methods named like hooks that are not hooks: they would never be called."""
    if getattr(callback, "_hooks_checked", False):
        return
    try:
        callback._hooks_checked = True
    except AttributeError:  # __slots__: check every time, it is cheap
        pass
    for name in dir(type(callback)):
        if name in HOOKS or name.startswith("_") or not callable(getattr(type(callback), name, None)):
            continue
        near = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.0 if name.startswith("on_") else 0.85)
        if near:  # an on_... method, or one spelled almost like a hook (onbatch_end)
            warnings.warn(_("{callback}.{name} is not a Trainer hook, so it is never called; did you mean "
                            "{near}? The hooks are: {hooks}").format(
                callback=type(callback).__name__, name=name, near=near[0], hooks=", ".join(HOOKS)),
                UserWarning, stacklevel=learner_stacklevel())


def hook_lists(callbacks) -> dict[str, list]:
    """Every hook's list of the callbacks' bound methods that override it, in `order` (a hook nobody overrides is
    an empty list: nothing to call, nothing to test for); warns about methods named like a hook that is not one."""
    ordered = sorted(callbacks, key=lambda cb: getattr(cb, "order", 0))
    for cb in ordered:
        warn_unknown_hooks(cb)
    return {name: [getattr(cb, name) for cb in ordered if overridden(cb, name)] for name in HOOKS}


class LRScheduler(Callback):
    """Step a learning-rate scheduler every epoch (`interval="epoch"`) or after every optimizer step
    (`interval="step"`, e.g. for OneCycleLR or a warm-up). Its state goes into checkpoints. A scheduler that
    steps on a measured value (`ReduceLROnPlateau`) gets `logs[monitor]` every epoch (default "val_loss" when
    there is a val_loader, else "loss")."""

    order = -10  # before callbacks that read the learning rate or save a checkpoint

    def __init__(self, scheduler, interval: str = "epoch", monitor: str | None = None):
        if interval not in ("epoch", "step"):
            raise ValueError(_("interval must be 'epoch' or 'step', got {interval!r}").format(interval=interval))
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(_("scheduler must have a step() method, got {kind}").format(kind=type(scheduler).__name__))
        self.scheduler, self.interval, self.monitor = scheduler, interval, monitor
        self.on_value = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or monitor is not None
        if self.on_value and interval == "step":
            raise ValueError(_("a scheduler that steps on a measured value (ReduceLROnPlateau) steps once per epoch: "
                               "use interval='epoch'"))

    def on_after_optimizer_step(self, trainer) -> None:
        if self.interval == "step":
            self.scheduler.step()

    def on_epoch_end(self, trainer, logs) -> None:
        if self.interval != "epoch":
            return
        if self.on_value:
            self.scheduler.step(logs[self.monitor or ("val_loss" if "val_loss" in logs else "loss")])
        else:
            self.scheduler.step()

    @property
    def state_name(self) -> str:
        """'LRScheduler(StepLR)': a StepLR's state never goes to another kind of scheduler."""
        return f"{type(self).__name__}({type(self.scheduler).__name__})"

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


class EarlyStopping(Callback):
    """Stop when `monitor` (a key of the epoch logs, e.g. "val_loss" or "val_accuracy") has not improved by
    more than `min_delta` for `patience` epochs. `mode`: "min" (losses) or "max" (accuracies)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(_("mode must be 'min' or 'max', got {mode!r}").format(mode=mode))
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(_("patience must be a positive int, got {patience!r}").format(patience=patience))
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.bad_epochs = 0

    def on_epoch_end(self, trainer, logs) -> None:
        if self.monitor not in logs:
            raise KeyError(_("EarlyStopping watches {monitor!r}, but the epoch logs have only {logs} (val_loss and "
                             "val_accuracy need Trainer(..., val_loader=...))").format(monitor=self.monitor,
                                                                                        logs=sorted(logs)))
        value = logs[self.monitor]
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.best_epoch, self.bad_epochs = value, trainer.epoch, 0
            return
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            raise StopTraining(_("{monitor} has not improved for {patience} epochs (best {best:.4g} after epoch "
                                 "{epoch})").format(monitor=self.monitor, patience=self.patience, best=self.best,
                                                    epoch=self.best_epoch))

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state) -> None:
        self.best, self.best_epoch, self.bad_epochs = state["best"], state["best_epoch"], state["bad_epochs"]


class CheckFinite(Callback):
    """Stop at the first step whose loss is inf or nan, with an error naming it. A debugging aid: it reads every
    loss on the CPU, a CPU-GPU sync point per step (the Trainer itself checks once per epoch, for free)."""

    def on_batch_end(self, trainer, loss) -> None:
        if not torch.isfinite(loss):  # CPU-GPU sync point here
            raise NonFiniteLossError(_("the loss is {value} at {where} (step {step}): stopped there, before the next "
                                       "step. The optimizer step of this batch has been taken.").format(
                value=float(loss), where=trainer.where(), step=trainer.optimizer_steps))


class Checkpoint(Callback):
    """Save the Trainer's full state to `path` after every epoch and when training stops early (Ctrl-C,
    StopTraining), atomically; `Trainer.load_checkpoint(path)` resumes exactly.

    `every_n_steps=N` also saves after every N-th optimizer step, at the step boundary (mid-epoch), so a process
    that dies without warning (SIGKILL, a lost node) loses at most N steps: the file always holds the last good
    state. Each save costs a write of the model and optimizer state and one CPU-GPU sync; measure it against the
    interval (benchmarks/bench_checkpoint.py). `Trainer(..., resume=True)` continues from the file if it exists."""

    order = 100  # last: after schedulers and early stopping have updated their state

    def __init__(self, path, every_n_steps: int | None = None):
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(_("every_n_steps must be a positive int or None, got {every_n_steps!r}").format(
                every_n_steps=every_n_steps))
        self.path = Path(path)
        if self.path.is_dir():
            raise IsADirectoryError(_("checkpoint {path} is a folder: give a file name in it, e.g. {example}").format(
                path=self.path, example=self.path / "run.pt"))
        self.every_n_steps = every_n_steps
        self._saved_this_call = False

    def on_train_start(self, trainer) -> None:
        self._saved_this_call = False

    def on_batch_end(self, trainer, loss) -> None:
        if self.every_n_steps is not None and trainer.at_step_boundary \
                and trainer.optimizer_steps % self.every_n_steps == 0:
            trainer.save_checkpoint(self.path)  # every rank: the same step on all of them

    def on_epoch_end(self, trainer, logs) -> None:
        trainer.save_checkpoint(self.path)
        self._saved_this_call = True

    def on_train_end(self, trainer) -> None:
        stopped = trainer.stop_reason is not None or trainer.interrupted  # (the same on every rank)
        # stopped inside an epoch: save where; between epochs before any epoch ended in this call (a stop at the
        # start): save too, so that the file a resume looks for is there
        if trainer.position is not None or (stopped and not self._saved_this_call):
            trainer.save_checkpoint(self.path)
            if trainer.is_main:
                print(_("Checkpoint saved to '{name}' ({where}).").format(name=self.path.name, where=trainer.where()))
