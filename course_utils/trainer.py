"""`Trainer`: a training run as a callable object.

    trainer = Trainer(model, optimizer, loss_fn, train_loader)
    history = trainer(3)          # train 3 more epochs, get their 3 mean losses back as floats

Design: `__call__` owns the epoch loop; `train_step` owns one optimisation step; everything that watches
the run (progress bars, live plots, early stopping, custom logging) hangs off `Callback` hooks, so
extending the trainer means adding a callback, not editing the loop. The options cover what the course
teaches: mixed precision, gradient accumulation, out-of-memory recovery, evaluation, checkpoints with an
exact resume, a graceful Ctrl-C, and the live monitor.
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
from pathlib import Path

import torch
from torch import nn

from .device import get_device


class Callback:
    """Override the hooks you need. `loss` in on_step_end is a detached 0-d tensor on the device:
    keep a reference if you like, but calling `.item()` on it every step would force a CPU-GPU sync."""

    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_epoch_start(self, trainer: "Trainer", epoch: int) -> None: ...
    def on_step_end(self, trainer: "Trainer", step: int, loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: dict) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...


class CheckpointError(RuntimeError):
    """A checkpoint file could not be read (missing, truncated, corrupt, or not a Trainer checkpoint)."""


def move_batch(batch, device: torch.device, non_blocking: bool = True):
    """Move a batch (tensor, or tuple/list/dict of them) to `device`. Tensors already there are not copied."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


class _DeferInterrupt:
    """While active, a first Ctrl-C (SIGINT, also Jupyter's "interrupt kernel") only sets a flag that the
    loop reads between steps, so a step is never cut in half; a second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handler(self, signum, frame):
        if self.requested:  # second Ctrl-C: the learner really wants out now
            signal.signal(signal.SIGINT, self._previous)
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        self.requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        return False


class Trainer:
    """Train `model` with `optimizer` on `train_loader` batches of (inputs, targets).

    `history = trainer(epochs)` runs `epochs` more epochs and returns their mean training losses (floats).
    `trainer.history` keeps every epoch's mean loss across calls, `trainer.logs` every epoch's full log
    (loss, and val_loss / val_accuracy when `val_loader` is given), `trainer.epoch` counts finished epochs.

    Options:
      mixed_precision: False (float32), True/"auto" (bf16 where supported, else fp16 with a GradScaler),
          "bf16", "fp16", or a `course_utils.amp.MixedPrecision`.
      accumulate: optimizer step every `accumulate` batches, each batch's loss weighted by its share of
          the group, so the update equals one step on the concatenated batches.
      grad_clip: clip the gradient norm to this value before each step.
      oom_recovery: on an out-of-memory error, retry the same step split into micro-batches
          (`course_utils.memory.ResilientStep`); no data is skipped and the update is unchanged.
      checkpoint: a file path; the full state is written there atomically after every epoch and when
          training is interrupted with Ctrl-C. `Trainer.load_checkpoint(path)` resumes exactly.
      progress: show a live progress bar and loss curve (`course_utils.monitor.TrainingProgress`).
      scheduler: a learning-rate scheduler stepped once per epoch (its state is checkpointed too).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, train_loader,
                 device=None, callbacks=(), *, val_loader=None, mixed_precision=False, accumulate: int = 1,
                 grad_clip: float | None = None, oom_recovery: bool = False, checkpoint=None,
                 progress: bool = False, scheduler=None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
        if oom_recovery and accumulate > 1:
            raise ValueError("use either oom_recovery or accumulate: oom_recovery already splits a batch into "
                             "micro-batches with gradient accumulation when it does not fit")
        self.device = device if isinstance(device, torch.device) else get_device(device)
        self.model = model.to(self.device)  # modules move in place; the optimizer's parameters stay the same objects
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.callbacks = list(callbacks)
        self.accumulate = accumulate
        self.grad_clip = grad_clip
        self.scheduler = scheduler
        self.checkpoint_path = Path(checkpoint) if checkpoint is not None else None
        self.precision = self._make_precision(mixed_precision)
        self.resilient = None
        if oom_recovery:
            from .memory import ResilientStep
            self.resilient = ResilientStep(model, optimizer, loss_fn, precision=self.precision, grad_clip=grad_clip)
        if progress:
            from .monitor import TrainingProgress
            self.callbacks.append(TrainingProgress())
        self.history: list[float] = []
        self.logs: list[dict] = []
        self.epoch = 0          # finished epochs
        self.global_step = 0    # finished batches
        self.interrupted = False
        self.epochs_this_call = 0
        self._resume: dict | None = None  # mid-epoch position restored from a checkpoint

    def _make_precision(self, mixed_precision):
        if mixed_precision is False or mixed_precision is None:
            return None
        from .amp import MixedPrecision
        if isinstance(mixed_precision, MixedPrecision):
            return mixed_precision
        dtype = "auto" if mixed_precision is True else mixed_precision
        precision = MixedPrecision(self.device, dtype)
        return precision if precision.enabled else None

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # --- one step -----------------------------------------------------------------------------

    def _forward_loss(self, inputs, targets) -> torch.Tensor:
        if self.precision is None:
            return self.loss_fn(self.model(inputs), targets)
        with self.precision.autocast():
            return self.loss_fn(self.model(inputs), targets)

    def _optimizer_step(self) -> None:
        params = self.model.parameters() if self.grad_clip is not None else None
        if self.precision is None:
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(params, self.grad_clip)
            self.optimizer.step()
        else:
            self.precision.step(self.optimizer, parameters=params, clip_grad_norm=self.grad_clip)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimisation step on one batch; returns its mean loss, detached, still on the device."""
        if self.resilient is not None:
            return self.resilient(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_loss(inputs, targets)
        if self.precision is None:
            loss.backward()
        else:
            self.precision.backward(loss)
        self._optimizer_step()
        return loss.detach()

    def _accumulated_step(self, group: list) -> list[torch.Tensor]:
        """One optimizer step over a group of batches; returns each batch's mean loss (detached)."""
        total = sum(len(t) for _, t in group)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for inputs, targets in group:
            loss = self._forward_loss(inputs, targets)
            weighted = loss * (len(targets) / total)  # this batch's share of the group mean
            if self.precision is None:
                weighted.backward()
            else:
                self.precision.backward(weighted)
            losses.append(loss.detach())
        self._optimizer_step()
        return losses

    # --- epochs ----------------------------------------------------------------------------------

    def _batches(self, skip: int):
        """Iterate the loader, skipping the first `skip` batches (those an interrupted run already trained on;
        the caller restores the epoch's starting RNG first, so the order is the one the run would have seen)."""
        it = iter(self.train_loader)
        for _ in range(skip):
            next(it)
        return it

    def _groups(self, batches):
        """Batches moved to the device, in groups of `accumulate` (the last group of an epoch may be smaller)."""
        group = []
        for batch in batches:
            group.append(move_batch(batch, self.device))
            if len(group) == self.accumulate:
                yield group
                group = []
        if group:
            yield group

    def train_epoch(self, interrupt: _DeferInterrupt | None = None) -> float | None:
        """Train one epoch; returns its mean loss, or None if interrupted (state kept for a resume)."""
        self.model.train()
        resume, self._resume = self._resume, None
        if resume is None:
            self._epoch_start_state = {"rng": _rng_state(), "loader": self._loader_state()}
            total = torch.zeros((), device=self.device)  # running sum stays on the device: no per-step sync
            count, done = 0, 0
            batches = self._batches(0)
        else:  # continue an interrupted epoch exactly where it stopped
            self._epoch_start_state = resume["epoch_start"]
            _set_rng_state(self._epoch_start_state["rng"])
            self._load_loader_state(self._epoch_start_state["loader"])
            batches = self._batches(resume["done"])  # same order as before the interruption
            _set_rng_state(resume["rng_now"])
            total = resume["loss_sum"].to(self.device)
            count, done = resume["count"], resume["done"]
        try:
            for group in self._groups(batches):
                if self.accumulate > 1:
                    losses = self._accumulated_step(group)
                else:
                    losses = [self.train_step(*group[0])]
                for loss, (_, targets) in zip(losses, group):
                    total += loss * len(targets)
                    count += len(targets)
                    done += 1
                    self.global_step += 1
                    self._emit("on_step_end", self.global_step, loss)
                if interrupt is not None and interrupt.requested:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            # Deferred Ctrl-C: we stop between two steps. An undeferred one (a second Ctrl-C, or raised by a
            # callback) may land inside a step: its gradients are dropped, finished steps are kept.
            self.optimizer.zero_grad(set_to_none=True)
            self._resume = {"epoch_start": self._epoch_start_state, "done": done, "count": count,
                            "loss_sum": total.detach().cpu(), "rng_now": _rng_state()}
            return None
        if count == 0:
            raise ValueError("train_loader produced no batches")
        return (total / count).item()  # the one CPU-GPU sync point of the epoch

    def __call__(self, epochs: int = 1) -> list[float]:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
        losses = []
        self.interrupted = False
        self.epochs_this_call = epochs
        self._emit("on_train_start")
        try:
            with _DeferInterrupt() as interrupt:
                for _ in range(epochs):
                    self._emit("on_epoch_start", self.epoch)
                    mean_loss = self.train_epoch(interrupt)
                    if mean_loss is None:
                        self._on_interrupt()
                        break
                    logs = {"loss": mean_loss}
                    if self.val_loader is not None:
                        val = self.evaluate(self.val_loader)
                        logs.update(val_loss=val["loss"], val_accuracy=val["accuracy"])
                    if self.scheduler is not None:
                        self.scheduler.step()
                    self.history.append(mean_loss)
                    self.logs.append(logs)
                    losses.append(mean_loss)
                    self.epoch += 1
                    self._emit("on_epoch_end", self.epoch - 1, logs)
                    if self.checkpoint_path is not None:
                        self.save_checkpoint(self.checkpoint_path)
        finally:
            self._emit("on_train_end")
        return losses

    def _on_interrupt(self) -> None:
        self.interrupted = True
        where = f"epoch {self.epoch + 1}, step {self.global_step}"
        if self.checkpoint_path is not None:
            self.save_checkpoint(self.checkpoint_path)
            print(f"Training interrupted at {where}. The model is usable; a checkpoint was saved to "
                  f"'{self.checkpoint_path.name}'. Call the trainer again to continue where it stopped.")
        else:
            print(f"Training interrupted at {where}. The model is usable; call the trainer again to continue "
                  "where it stopped (pass checkpoint=... to also save it to a file).")

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        """Mean loss and accuracy over `loader`, in eval mode; one sync at the end."""
        was_training = self.model.training
        self.model.eval()
        total_loss = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        for batch in loader:
            inputs, targets = move_batch(batch, self.device)
            logits = self.model(inputs) if self.precision is None else self._autocast_forward(inputs)
            total_loss += self.loss_fn(logits.float(), targets) * len(targets)
            correct += (logits.argmax(1) == targets).sum()
            count += len(targets)
        self.model.train(was_training)
        if count == 0:
            raise ValueError("the evaluation loader produced no batches")
        return {"loss": (total_loss / count).item(), "accuracy": correct.item() / count}

    def _autocast_forward(self, inputs):
        with self.precision.autocast():
            return self.model(inputs)

    # --- checkpoints -----------------------------------------------------------------------------

    def _loader_state(self):
        state_dict = getattr(self.train_loader, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def _load_loader_state(self, state) -> None:
        if state is not None and callable(getattr(self.train_loader, "load_state_dict", None)):
            self.train_loader.load_state_dict(state)

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly: weights, optimizer, scaler, scheduler, RNGs,
        the data order, the epoch counters and, after an interruption, the position inside the epoch."""
        return {
            "format": "course_utils.Trainer/1",
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict() if self.precision is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "resilient_micro_batch": self.resilient.micro_batch_size if self.resilient is not None else None,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "history": list(self.history),
            "logs": [dict(x) for x in self.logs],
            "rng": _rng_state(),
            "loader": self._loader_state(),
            "resume": self._resume,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.precision is not None and state.get("precision"):
            self.precision.load_state_dict(state["precision"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        if self.resilient is not None:
            self.resilient.micro_batch_size = state.get("resilient_micro_batch")
        self.epoch = state["epoch"]
        self.global_step = state["global_step"]
        self.history = list(state["history"])
        self.logs = [dict(x) for x in state["logs"]]
        _set_rng_state(state["rng"])
        self._load_loader_state(state["loader"])
        self._resume = state["resume"]

    def save_checkpoint(self, path) -> Path:
        """Write the full state to `path` atomically: a temporary file in the same folder, flushed to disk,
        then renamed over the target, so a crash mid-write never leaves a half-written checkpoint."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(self.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX and Windows
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    def load_checkpoint(self, path) -> "Trainer":
        """Restore a checkpoint written by `save_checkpoint` (loaded with weights_only=True: no code runs)."""
        state = read_checkpoint(path, map_location=self.device)
        try:
            self.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint '{path}' does not fit this trainer: {type(exc).__name__}: "
                                  f"{exc}") from None
        return self


def read_checkpoint(path, map_location=None) -> dict:
    """Load a Trainer checkpoint with `weights_only=True`, or raise CheckpointError naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, wrong file type, disallowed globals...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint '{path}' is truncated or corrupt and cannot be loaded "
                              f"({type(exc).__name__}: {first[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != "course_utils.Trainer/1":
        raise CheckpointError(f"'{path}' is a readable file but not a course_utils Trainer checkpoint")
    return state
