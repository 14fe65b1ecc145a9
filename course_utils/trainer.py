"""`Trainer`: a training run as a callable object.

    trainer = Trainer(model, optimizer, loss_fn, train_loader)
    history = trainer(3)          # train 3 more epochs, get their 3 mean losses back as floats

Design: `__call__` owns the epoch loop; one `course_utils.step.TrainStep` (wrapped in a
`course_utils.memory.ResilientStep` with `oom_recovery=True`) owns the optimizer step; everything that watches
or steers the run (progress display, checkpoints, learning-rate schedules, early stopping, logging) is a
`course_utils.callbacks.Callback`. The options configure the step (precision, accumulation, clipping,
out-of-memory recovery); the loop has no branches for them. Checkpoints resume exactly, for any loader
(`course_utils.loader_state`), and a Ctrl-C stops between two steps.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed
from .amp import MixedPrecision
from .callbacks import HOOKS, Callback, Checkpoint, LRScheduler, StopTraining, overridden
from .checkpoint import CheckpointError, EpochPosition
from .device import get_device
from .loader_state import LoaderState
from .memory import ResilientStep, check_fits, warn_if_too_big
from .step import TrainStep, batch_len
from .i18n import _

__all__ = ["Callback", "CheckpointError", "StopTraining", "Trainer", "move_batch", "read_checkpoint"]


def move_batch(batch, device: torch.device, non_blocking: bool = True):
    """Move a batch (tensor, or tuple/list/dict of them) to `device`. Tensors already there are not copied."""
    if type(batch) is tuple and len(batch) == 2:  # the usual (inputs, targets): skip the work if already there
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.device == device and y.device == device:
            return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
    return batch


def read_checkpoint(path, map_location=None) -> dict:
    """Load a Trainer checkpoint with `weights_only=True`, or raise CheckpointError naming the file."""
    return ckpt.load(path, map_location=map_location)


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


def _reason(stop: StopTraining) -> str:
    return str(stop) or "a callback raised StopTraining"


def _precision(mixed_precision, device: torch.device) -> MixedPrecision:
    if isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if mixed_precision is False or mixed_precision is None:
        return MixedPrecision(device, enabled=False)  # float32: the same calls, doing nothing extra
    return MixedPrecision(device, "auto" if mixed_precision is True else mixed_precision)


class Trainer:
    """Train `model` with `optimizer` on `train_loader` batches of (inputs, targets).

    `history = trainer(epochs)` runs `epochs` more epochs and returns their mean training losses (floats).
    `trainer.history` keeps every epoch's mean loss across calls, `trainer.logs` every epoch's full log
    (loss, and val_loss / val_accuracy when `val_loader` is given), `trainer.epoch` counts finished epochs,
    `trainer.batches_trained` the batches trained on and `trainer.optimizer_steps` the optimizer steps.

    Options of the step:
      mixed_precision: False (float32), True/"auto" (bf16 where supported, else fp16 with a GradScaler),
          "bf16", "fp16", or a `course_utils.amp.MixedPrecision`.
      accumulate: one optimizer step every `accumulate` batches, each batch's loss weighted by its share of
          the group's samples, so the update equals one step on the concatenated batches.
      grad_clip: clip the total gradient norm of the optimizer's parameters to this value before each step.
      oom_recovery: on an out-of-memory error, run the same step again in smaller chunks
          (`course_utils.memory.ResilientStep`); no data is skipped and the update is unchanged. Works with
          `accumulate`: every batch of the group is split.
    Callbacks (`course_utils.callbacks`): anything else. Two are common enough to have a shortcut:
      scheduler: a learning-rate scheduler stepped once per epoch (`LRScheduler(s, interval="step")` steps
          it after every optimizer step).
      checkpoint: a file path (`Checkpoint(path)`): the full state is written there atomically after every
          epoch and when training stops early. `Trainer.load_checkpoint(path)` resumes exactly.

    Under `torchrun` the same script trains data-parallel (`course_utils.distributed`): the model is wrapped in
    DistributedDataParallel (`trainer.train_model`; `trainer.model` stays your module), each process gets its
    share of every epoch, and the loader's `batch_size` is per process, as in PyTorch: the global batch is
    `world_size x batch_size x accumulate`. Losses and validation figures are global; rank 0 prints and writes
    checkpoints (`trainer.is_main`). `sync_batchnorm=True` converts BatchNorm layers to SyncBatchNorm (GPUs only).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, train_loader,
                 device=None, callbacks=(), *, val_loader=None, mixed_precision=False, accumulate: int = 1,
                 grad_clip: float | None = None, oom_recovery: bool = False, checkpoint=None, scheduler=None,
                 sync_batchnorm: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
        device = device if isinstance(device, torch.device) else get_device(device)
        # Under torchrun: join the process group; one GPU per local rank (or the CPU, with gloo).
        self.process = distributed.setup(device.type)
        self.device = distributed.device_for(self.process, device.type) if self.process is not None else device
        if sync_batchnorm and self.process is not None and self.device.type != "cuda":
            raise ValueError("sync_batchnorm=True needs CUDA GPUs: SyncBatchNorm runs only on GPU modules "
                             f"(DistributedDataParallel refuses it on {self.device.type}); leave it off here")
        if sync_batchnorm and self.process is not None:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the same parameters, in new modules
        self.model = model.to(self.device)  # modules move in place; the optimizer's parameters stay the same objects
        self.train_model = self.model  # what the step runs: the model itself, or its DistributedDataParallel wrapper
        if self.process is not None:
            from torch.nn.parallel import DistributedDataParallel
            self.train_model = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
            train_loader = distributed.shard_loader(train_loader, self.process)
            val_loader = distributed.shard_loader(val_loader, self.process) if val_loader is not None else None
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.accumulate = accumulate
        self.precision = _precision(mixed_precision, self.device)
        self.train_step = TrainStep(self.train_model, optimizer, loss_fn, self.precision, grad_clip)
        self.step = ResilientStep.around(self.train_step) if oom_recovery else self.train_step
        self.callbacks: list[Callback] = list(callbacks)
        if scheduler is not None:
            self.callbacks.append(LRScheduler(scheduler))
        if checkpoint is not None:
            self.callbacks.append(Checkpoint(checkpoint))
        self._loader = LoaderState(train_loader)
        self.history: list[float] = []
        self.logs: list[dict] = []
        self.epoch = 0               # finished epochs
        self.batches_trained = 0     # batches trained on, over all epochs
        self.optimizer_steps = 0     # optimizer steps taken (one per `accumulate` batches)
        self.batch_in_epoch = 0      # batches of the current epoch trained on
        self.position: EpochPosition | None = None  # where an interrupted epoch stopped
        self.interrupted = False
        self.stop_reason: str | None = None
        self.epochs_this_call = 0
        self._memory_checked = False  # the memory check runs once, before this trainer's first step
        self.memory_check = None      # its result: a course_utils.memory.FitCheck, or None where nothing is known

    # --- callbacks ---------------------------------------------------------------------------

    def _connect(self) -> dict[str, list]:
        """The callbacks' overridden hooks, in `order`; the step calls its two hooks only if someone listens."""
        ordered = sorted(self.callbacks, key=lambda cb: getattr(cb, "order", 0))
        hooks = {name: [getattr(cb, name) for cb in ordered if overridden(cb, name)] for name in HOOKS}
        self.train_step.after_backward = self._caller(hooks["on_after_backward"])
        self.train_step.before_optimizer_step = self._caller(hooks["on_before_optimizer_step"])
        return hooks

    def _caller(self, fns: list):
        if not fns:
            return None
        return lambda: self._emit(fns)

    def _emit(self, fns: list, *args) -> None:
        """Call every hook in `fns`; a StopTraining from one is raised after all of them had the event."""
        stop = None
        for fn in fns:
            try:
                fn(self, *args)
            except StopTraining as exc:
                stop = stop or exc
        if stop is not None:
            raise stop

    # --- epochs ------------------------------------------------------------------------------

    def train_epoch(self, interrupt: _DeferInterrupt | None = None, hooks: dict | None = None) -> float | None:
        """Train one epoch; returns its mean loss, or None if it stopped early (its position kept for a resume)."""
        hooks = hooks if hooks is not None else self._connect()
        self.model.train()
        position, self.position = self.position, None
        batches = self._loader.epoch(self.epoch)  # positioned where an interrupted epoch stopped, if one did
        if position is None:
            self._loss_sum = torch.zeros((), device=self.device)  # running sum stays on the device: no per-step sync
            self._samples = self.batch_in_epoch = 0
        else:
            ckpt.set_rng_state(position.rng)
            main = self.process is None or self.process.is_main  # the saved sums are global: count them once
            self._loss_sum = torch.tensor(position.loss_sum if main else 0.0, device=self.device)
            self._samples = position.samples_done if main else 0
            self.batch_in_epoch = position.batches_done
        batch_start, batch_end = hooks["on_batch_start"], hooks["on_batch_end"]
        after_step = hooks["on_after_optimizer_step"]
        group: list = []
        try:
            for batch in batches:
                batch = move_batch(batch, self.device)
                if batch_start:
                    self._emit(batch_start, batch)
                group.append(batch)
                if len(group) < self.accumulate:
                    continue
                self._step(group, after_step, batch_end)
                group = []
                requested = interrupt is not None and interrupt.requested
                if self.process is not None:  # a Ctrl-C that reached one rank stops all of them here
                    requested = distributed.agree(requested, self.process)
                if requested:
                    raise KeyboardInterrupt
            if group:  # the last, smaller group of the epoch
                self._step(group, after_step, batch_end)
        except (KeyboardInterrupt, StopTraining) as exc:
            # Deferred Ctrl-C or StopTraining: we stop between two steps. An undeferred Ctrl-C (a second one) may
            # land inside a step: its gradients are dropped, finished steps are kept.
            self.optimizer.zero_grad(set_to_none=True)
            if isinstance(exc, StopTraining):
                self.stop_reason = _reason(exc)
            loss_sum, samples = self._global_sums()
            self.position = EpochPosition(self.batch_in_epoch, samples, loss_sum, ckpt.rng_state(),
                                          self._loader.state_dict(self.batch_in_epoch))
            self._loader.load_state_dict(self.position.loader)  # a next call continues here, also in this process
            return None
        if self._samples == 0:
            raise ValueError("train_loader produced no batches")
        if self.process is None:
            return (self._loss_sum / self._samples).item()  # the one CPU-GPU sync point of the epoch
        loss_sum, samples = self._global_sums()
        return loss_sum / samples

    def _global_sums(self) -> tuple[float, int]:
        """(sum of the loss over the epoch's samples so far, their number), over all ranks: a sync point."""
        sums = torch.stack([self._loss_sum.double(), torch.tensor(float(self._samples), dtype=torch.float64,
                                                                  device=self._loss_sum.device)])
        loss_sum, samples = distributed.all_sum(sums, self.process).tolist()
        return loss_sum, int(samples)

    def _step(self, group, after_step, batch_end) -> None:
        if not self._memory_checked:
            self._check_memory(group[0])
        losses = self.step.group(group)
        self.optimizer_steps += 1
        if after_step:
            self._emit(after_step)
        for (_inputs, targets), loss in zip(group, losses):
            n = batch_len(targets)
            self._loss_sum.add_(loss, alpha=n)  # one fused op: sum += n * loss
            self._samples += n
            self.batch_in_epoch += 1
            self.batches_trained += 1
            if batch_end:
                self._emit(batch_end, loss)

    def _check_memory(self, batch) -> None:
        """Before the first step: predict whether it fits (kept in `self.memory_check`) and warn, with the numbers,
        if it will not. With oom_recovery=True running out is the plan, not a surprise: no warning then."""
        self._memory_checked = True
        low = self.precision.dtype if self.precision.enabled else None
        self.memory_check = check_fits(self.model, self.optimizer, batch, self.loss_fn, self.device,
                                       autocast_dtype=low)
        if self.step is self.train_step:
            warn_if_too_big(self.memory_check, "use a smaller batch_size (with accumulate=k for the same update), "
                            "mixed_precision=True, activation checkpointing (course_utils.memory.checkpointed), "
                            "or oom_recovery=True.")

    def __call__(self, epochs: int = 1) -> list[float]:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
        losses = []
        self.interrupted = False
        self.stop_reason = None
        self.epochs_this_call = epochs
        hooks = self._connect()
        try:
            self._emit(hooks["on_train_start"])
            with _DeferInterrupt() as interrupt:
                for _epoch in range(epochs):
                    self._emit(hooks["on_epoch_start"])
                    mean_loss = self.train_epoch(interrupt, hooks)
                    if mean_loss is None:
                        self._stopped_early()
                        break
                    logs = {"loss": mean_loss}
                    if self.val_loader is not None:
                        val = self.evaluate(self.val_loader)
                        logs.update(val_loss=val["loss"], val_accuracy=val["accuracy"])
                    self.history.append(mean_loss)
                    self.logs.append(logs)
                    losses.append(mean_loss)
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    try:
                        self._emit(hooks["on_epoch_end"], logs)
                    except StopTraining as exc:
                        self.stop_reason = _reason(exc)
                        if self.is_main:
                            print(_("Training stopped after epoch {epoch}: {reason}.").format(
                                epoch=self.epoch, reason=self.stop_reason))
                        break
        finally:
            self._emit(hooks["on_train_end"])
        return losses

    def where(self) -> str:
        """Where training stands, in words: 'epoch 2, batch 13 of 40'."""
        try:
            total = len(self.train_loader)
        except TypeError:
            return _("epoch {epoch}, batch {batch}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch)
        return _("epoch {epoch}, batch {batch} of {total}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch,
                                                                   total=total)

    def _stopped_early(self) -> None:
        if not self.is_main:
            self.interrupted = self.stop_reason is None
            return
        if self.stop_reason is not None:
            print(_("Training stopped at {where}: {reason}. Call the trainer again to continue.").format(
                where=self.where(), reason=self.stop_reason))
            return
        self.interrupted = True
        saved = any(isinstance(cb, Checkpoint) for cb in self.callbacks)
        hint = "" if saved else _(" (pass checkpoint=... to also save it to a file)")
        print(_("Training interrupted at {where}. The model is usable; call the trainer again to continue "
                "where it stopped{hint}.").format(where=self.where(), hint=hint))

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        """Mean loss and accuracy over `loader`, in eval mode; one sync at the end. In a distributed run each
        rank evaluates its share and the sums are added over ranks: the same figures on every rank."""
        was_training = self.model.training
        self.model.eval()
        total_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        correct = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        for batch in loader:
            inputs, targets = move_batch(batch, self.device)
            with self.precision.autocast():
                logits = self.model(inputs)  # the model itself: no DistributedDataParallel collectives here
            total_loss += self.loss_fn(logits.float(), targets) * len(targets)
            correct += (logits.argmax(1) == targets).sum()
            count += len(targets)
        self.model.train(was_training)
        sums = torch.stack([total_loss, correct, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
        total_loss, correct, count = distributed.all_sum(sums, self.process).tolist()  # CPU-GPU sync point here
        if count == 0:
            raise ValueError("the evaluation loader produced no batches")
        return {"loss": total_loss / count, "accuracy": correct / count}

    @property
    def is_main(self) -> bool:
        """True in a single process, and on rank 0 of a distributed run (the rank that prints and saves)."""
        return self.process is None or self.process.is_main

    # --- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly: weights, optimizer, precision (loss scale), the
        step's micro-batch size, the callbacks' states, RNGs, the loader's position, the counters."""
        position = self.position
        if position is not None:
            self._loader.warn_if_inexact()
        return {
            "format": ckpt.FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict(),
            "step": self.step.state_dict(),
            "callbacks": [{"class": type(cb).__name__, "state": cb.state_dict()} for cb in self.callbacks],
            "epoch": self.epoch,
            "batches_trained": self.batches_trained,
            "optimizer_steps": self.optimizer_steps,
            "history": list(self.history),
            "logs": [dict(x) for x in self.logs],
            "world_size": self.process.world_size if self.process is not None else 1,
            # every rank's generators (they differ: dropout masks, augmentations), rank 0's first
            "rng": distributed.gather_objects(ckpt.rng_state(), self.process),
            "loader": position.loader if position is not None else self._loader.state_dict(),
            "position": position.to_dict() if position is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state["precision"])
        self.step.load_state_dict(state["step"])
        self._load_callbacks(state["callbacks"])
        self.epoch = state["epoch"]
        self.batches_trained = state["batches_trained"]
        self.optimizer_steps = state["optimizer_steps"]
        self.history = list(state["history"])
        self.logs = [dict(x) for x in state["logs"]]
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        rank = self.process.rank if self.process is not None else 0
        ckpt.set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
        world = self.process.world_size if self.process is not None else 1
        if state["position"] is not None and state.get("world_size", 1) != world:
            raise ValueError(f"the checkpoint stopped inside an epoch of a run with {state.get('world_size', 1)} "
                             f"process(es); resume it with the same number (this run has {world}), or resume "
                             "from a checkpoint written at the end of an epoch")
        self._loader.load_state_dict(state["loader"])
        self.position = EpochPosition.from_dict(state["position"]) if state["position"] is not None else None
        self.batch_in_epoch = self.position.batches_done if self.position is not None else 0

    def _load_callbacks(self, saved: list[dict]) -> None:
        """Give each saved callback state to this trainer's callback of the same class (in order)."""
        waiting: dict[str, list[Callback]] = {}
        for cb in self.callbacks:
            waiting.setdefault(type(cb).__name__, []).append(cb)
        for entry in saved:
            mine = waiting.get(entry["class"])
            if mine:
                mine.pop(0).load_state_dict(entry["state"])
            elif entry["state"]:
                raise ValueError(f"the checkpoint holds the state of a {entry['class']} callback, which this "
                                 f"trainer does not have; pass one (e.g. the same scheduler) to resume exactly")

    def save_checkpoint(self, path) -> Path:
        """Write the full state to `path` atomically: a temporary file in the same folder, flushed to disk,
        then renamed over the target, so a crash mid-write never leaves a half-written checkpoint. In a
        distributed run every rank calls it (the state gathers every rank's generators), rank 0 writes the
        file, and all ranks wait for it (a barrier) before going on."""
        state = self.state_dict()
        path = Path(path)
        if self.is_main:
            ckpt.save(state, path)
        distributed.barrier(self.process)
        return path

    def load_checkpoint(self, path, map_location=None) -> "Trainer":
        """Restore a checkpoint written by `save_checkpoint` (loaded with weights_only=True: no code runs).
        Tensors are mapped to `map_location` (default: this trainer's device) on the way in."""
        state = ckpt.load(path, map_location=map_location if map_location is not None else self.device)
        try:
            self.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(_("checkpoint '{path}' does not fit this trainer: {error}: {message}").format(
                path=path, error=type(exc).__name__, message=exc)) from None
        return self
