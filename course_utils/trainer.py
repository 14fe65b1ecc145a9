"""`Trainer`: a training run as a callable object.

    trainer = Trainer(model, optimizer, loss_fn, train_loader)
    history = trainer(3)          # train 3 more epochs, get their 3 mean losses back as floats

This module is the loop. Each option becomes a part once, when the trainer is built, and the loop calls the parts
without asking which kind it holds: the precision (`course_utils.amp`), the process (`course_utils.distributed`),
the step (`course_utils.step.TrainStep`, or `course_utils.memory.ResilientStep` around it with `oom_recovery=True`)
and the callbacks (`course_utils.callbacks`: everything that watches or steers the run). Where the epoch stands is
an `course_utils.epoch.EpochTally`; a checkpoint is the state of the named parts (`course_utils.checkpoint`), with
the loader's position (`course_utils.loader_state`, for any loader); a Ctrl-C is a `course_utils.signals.DeferredStop`.
"""
from __future__ import annotations

import copy
import math
import weakref
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed
from .amp import precision_for
from .callbacks import Callback, Checkpoint, LRScheduler, StopTraining, hook_lists
from .checkpoint import CheckpointError
from .checkpoint import load as read_checkpoint
from .device import get_device
from .epoch import EpochTally, NonFiniteLossError, non_finite_error
from .evaluation import evaluate
from .i18n import _
from .loader_state import LoaderState
from .memory import MemoryCheck, ResilientStep
from .rng import set_rng_state
from .signals import GO_ON, INTERRUPT, PREEMPTED_EXIT, STOP, TERMINATE, DeferredStop, exit_preempted
from .step import TrainStep, batch_len, check_optimizer_holds, move_batch, pair_on

__all__ = ["Callback", "CheckpointError", "NonFiniteLossError", "StopTraining", "Trainer", "move_batch",
           "read_checkpoint"]


def _reason(stop: StopTraining | None) -> str:
    """Why training stopped, in words: the StopTraining's message, or a default when it has none."""
    return (str(stop) if stop is not None else "") or _("a callback raised StopTraining")


class Trainer:
    """Train `model` with `optimizer` on `train_loader` batches of (inputs, targets).

    `loss_fn(outputs, targets)` returns the batch's mean loss (PyTorch's default), or its sum for a loss built with
    reduction="sum" (micro-batches then add up, unweighted). `history = trainer(epochs)` runs `epochs` more epochs
    (an epoch a stop left unfinished counts as one of them) and returns their mean training losses (floats): each
    batch's loss stays on the device until the epoch's end, when all are read at once and added exactly
    (`math.fsum`, one rounding), so the mean is the same wherever a stop fell.
    `trainer.history` keeps every epoch's mean loss across calls, `trainer.logs` every epoch's full log
    (loss, and val_loss / val_accuracy when `val_loader` is given; val_accuracy only for a classifier), `trainer.epoch` counts finished epochs,
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
      batch_fn: turns each batch the loader yields into (inputs, targets), e.g. for dict batches (what Hugging
          Face datasets yield): `batch_fn=lambda b: (b["input_ids"], b["labels"])`. Inputs may be a tuple
          (`model(*inputs)`) or a dict (`model(**inputs)`).
    Callbacks (`course_utils.callbacks`): anything else. Two are common enough to have a shortcut:
      scheduler: a learning-rate scheduler stepped once per epoch (`LRScheduler(s, interval="step")` steps
          it after every optimizer step).
      checkpoint: a file path (`Checkpoint(path)`): the full state is written there atomically after every
          epoch and when training stops early. `Trainer.load_checkpoint(path)` resumes exactly;
          `Checkpoint(path, every_n_steps=N)` saves every N optimizer steps too.
      resume: True continues from the checkpoint file when it exists and starts fresh when it does not, so the
          same script serves the first launch and every restart.

    Stopping and resuming. A Ctrl-C (Jupyter's interrupt button), a SIGTERM (a scheduler preempting the job) or a
    callback's `StopTraining` takes effect at the next step boundary (the step in progress, all batches of an
    accumulation group, finishes first); after a SIGTERM, once the Checkpoint callback has saved, the trainer
    raises SystemExit(143), SIGTERM's status. Calling the trainer again, or loading the checkpoint in a new
    process, continues from there and ends bit-identical to an uninterrupted run (weights, optimizer, losses,
    random state) for the course's TensorLoader, torch DataLoaders, torchdata's StatefulDataLoader and lists;
    what cannot be restored is said at save time (`course_utils.loader_state`). A second Ctrl-C interrupts at
    once, possibly inside a step: that step is dropped and the resume is not exact.

    A non-finite loss (inf or nan) is noticed at the end of its epoch, where the loss is read anyway (no extra
    sync per step): a `NonFiniteLossError` names the first bad batch, and no checkpoint is ever written with
    non-finite weights. `callbacks.CheckFinite()` checks every step (a sync per step). Under fp16 a GradScaler
    skips such steps: that is its job.

    Under `torchrun` the same script trains data-parallel (`course_utils.distributed`): the model is wrapped in
    DistributedDataParallel (`trainer.train_model`; `trainer.model` stays your module), each process gets its
    share of every epoch, and `batch_size` is per process, as in PyTorch (the global batch is
    `world_size x batch_size x accumulate`). Losses and validation figures are global; rank 0 prints and writes
    checkpoints (`trainer.is_main`) holding every rank's random and loader state. A stop wished on any rank stops
    every rank at the same step, agreed without a blocking round trip per step (`distributed.StopVote`).
    `sync_batchnorm=True` converts BatchNorm layers to SyncBatchNorm (GPUs only).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, train_loader,
                 device=None, callbacks=(), *, val_loader=None, mixed_precision=False, accumulate: int = 1,
                 grad_clip: float | None = None, oom_recovery: bool = False, checkpoint=None, scheduler=None,
                 sync_batchnorm: bool = False, batch_fn=None, resume: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(_("model must be an nn.Module, got {kind}").format(kind=type(model).__name__))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(_("optimizer must be a torch.optim.Optimizer, got {kind}").format(
                kind=type(optimizer).__name__))
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(_("accumulate must be a positive int, got {accumulate!r}").format(accumulate=accumulate))
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(_("batch_fn must be a function of a batch, got {kind}").format(
                kind=type(batch_fn).__name__))
        check_optimizer_holds(model, optimizer)
        reduction = getattr(loss_fn, "reduction", "mean")  # nn losses say what they return; a function: a mean
        if reduction not in ("mean", "sum"):
            raise ValueError(_("loss_fn returns one loss per sample (reduction={reduction!r}); the Trainer needs one "
                               "number per batch: use reduction='mean' (or 'sum')").format(reduction=reduction))
        for cb in callbacks:
            if isinstance(cb, type):
                raise TypeError(_("callbacks=[{name}] passes the class, not a callback: create one, {name}(...)")
                                .format(name=cb.__name__))
        device = device if isinstance(device, torch.device) else get_device(device)
        # One process, or (under torchrun) this rank of the group: one GPU per local rank, or the CPU with gloo.
        self.process = distributed.join(device.type)
        self.device = self.process.device_for(device)
        # the model on the device, and what the step runs: the model itself, or its DistributedDataParallel wrapper
        self.model, self.train_model = self.process.wrap(model, self.device, sync_batchnorm)
        self.train_loader = self.process.shard(train_loader)  # this rank's share of every epoch
        self.val_loader = self.process.shard(val_loader) if val_loader is not None else None
        self.optimizer, self.loss_fn, self.accumulate, self.batch_fn = optimizer, loss_fn, accumulate, batch_fn
        self.precision = precision_for(mixed_precision, self.device)
        self.train_step = TrainStep(self.train_model, optimizer, loss_fn, self.precision, grad_clip,
                                    reduction=reduction)  # a summed loss: micro-batches add up, unweighted
        self.step = ResilientStep.around(self.train_step) if oom_recovery else self.train_step
        self.callbacks: list[Callback] = [MemoryCheck(), *callbacks]  # does the first step fit? (warns if not)
        if scheduler is not None:
            self.callbacks.append(LRScheduler(scheduler))
        if checkpoint is not None:
            self.callbacks.append(Checkpoint(checkpoint))
        self.loader_state = LoaderState(self.train_loader)  # where the loader is: saved, put back on resume
        self._vote = self.process.stop_vote()  # one process: its own wish, at once
        self.history: list[float] = []
        self.logs: list[dict] = []
        self.epoch = 0               # finished epochs
        self.batches_trained = 0     # batches trained on, over all epochs
        self.optimizer_steps = 0     # optimizer steps taken (one per `accumulate` batches)
        self.batch_in_epoch = 0      # batches of the current epoch trained on
        self.tally = EpochTally()    # the current epoch's batch losses and sizes
        self.position = None         # an `epoch.EpochPosition`: where an interrupted epoch stopped
        self.at_step_boundary = False  # True in on_batch_end of a step's last batch: a consistent point to save
        self.interrupted = False
        self.stop_reason: str | None = None
        self.epochs_this_call = 0
        self._interrupt = DeferredStop()  # the current call's (never entered outside a call: never requested)
        self._preempted = False           # a SIGTERM on some rank: this call ends with SystemExit(143)
        self._requested: str | None = None  # a StopTraining raised on this rank, acted on at the step boundary
        if resume:
            paths = [cb.path for cb in self.callbacks if isinstance(cb, Checkpoint)]
            if not paths:
                raise ValueError(_("resume=True continues from the checkpoint file: pass checkpoint='run.pt' (or a "
                                   "Checkpoint callback) too"))
            ckpt.resume(self, paths[0])

    # --- callbacks ---------------------------------------------------------------------------

    def _connect(self) -> dict[str, list]:
        """The callbacks' hooks (`callbacks.hook_lists`); the step's two hooks are connected to the trainer's."""
        hooks = hook_lists(self.callbacks)
        # The step calls back through a weak reference: no cycle trainer -> step -> trainer, so a trainer dropped
        # is freed at once, with its loader's workers (in a cycle they would wait for the garbage collector, whose
        # DataLoader shutdown then waits 5 s a worker).
        me = weakref.ref(self)

        def caller(fns):
            return (lambda: me()._emit(fns)) if fns else None  # no hook: the step calls nothing

        self.train_step.connect(after_backward=caller(hooks["on_after_backward"]),
                                before_optimizer_step=caller(hooks["on_before_optimizer_step"]))
        self._hooks = hooks
        return hooks

    def _emit(self, fns: list, *args) -> None:
        """Call every hook in `fns` (the loop's own events loop over theirs in place: an empty list costs no call)."""
        for fn in fns:
            self._call(fn, *args)

    def _call(self, fn, *args) -> None:
        """Call one hook. A StopTraining is noted (`_requested`), not raised: the Trainer acts on it at the next
        step boundary, or at once between epochs, after every hook had the event."""
        try:
            fn(self, *args)
        except StopTraining as exc:
            if self._requested is None:
                self._requested = _reason(exc)
            self._interrupt.stop()  # this rank's wish (the largest of StopTraining, Ctrl-C, SIGTERM): read per step

    def _agreed_reason(self) -> str:
        """The reason of the StopTraining every rank agreed on (raised on this rank or another): a collective,
        run only when all ranks stop at the same point."""
        reasons = self.process.gather(self._requested)
        return next((r for r in reasons if r is not None), _reason(None))

    def _stop_between_epochs(self, fns: list, *args) -> bool:
        """Run the hooks of a point between epochs; True (stop_reason set) if any rank raised StopTraining."""
        self._emit(fns, *args)
        wish = self._vote.settle(self._interrupt.wish)  # once an epoch: a round trip
        if wish == GO_ON:
            return False
        self._preempted = wish == TERMINATE  # a SIGTERM on any rank: every rank saves and exits with 143
        self.stop_reason = self._agreed_reason() if wish == STOP else None
        self._requested = None
        return True

    # --- epochs ------------------------------------------------------------------------------

    def __call__(self, epochs: int = 1) -> list[float]:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(_("epochs must be a non-negative int, got {epochs!r}").format(epochs=epochs))
        losses = []
        self.interrupted, self.stop_reason, self._requested, self._preempted = False, None, None, False
        self.epochs_this_call = epochs
        hooks = self._connect()
        interrupt = self._interrupt = DeferredStop()
        try:
            if self._stop_between_epochs(hooks["on_train_start"]):
                self._stopped_early(between_epochs=True)
                return losses
            with interrupt:
                for _epoch in range(epochs):
                    if self._stop_between_epochs(hooks["on_epoch_start"]):
                        self._stopped_early(between_epochs=True)
                        break
                    mean_loss = self.train_epoch(interrupt, hooks)
                    if mean_loss is None:
                        self._stopped_early()
                        break
                    logs = {"loss": mean_loss}
                    if self.val_loader is not None:
                        val = self.evaluate(self.val_loader)
                        logs["val_loss"] = val["loss"]
                        if val["accuracy"] is not None:  # a classifier
                            logs["val_accuracy"] = val["accuracy"]
                    self.history.append(mean_loss)
                    self.logs.append(logs)
                    losses.append(mean_loss)
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    self.tally = EpochTally()  # the epoch's batch losses are not needed any more
                    if self._stop_between_epochs(hooks["on_epoch_end"], logs):
                        if self.stop_reason is None:  # a Ctrl-C or SIGTERM during the epoch's end
                            self._stopped_early(between_epochs=True)
                        elif self.is_main:
                            print(_("Training stopped after epoch {epoch}: {reason}.").format(
                                epoch=self.epoch, reason=self.stop_reason))
                        break
        finally:
            self._emit(hooks["on_train_end"])
            self._requested = None
        if interrupt.terminated or self._preempted:  # preempted (a SIGTERM here or on another rank): the state is
            # saved (with a Checkpoint); leave with SIGTERM's status
            if self.is_main:
                print(_("Stopped by SIGTERM at {where}; exiting with status {status}.").format(
                    where=self.where(), status=PREEMPTED_EXIT), flush=True)
            exit_preempted(quietly=self.process.world_size > 1)  # a torchrun rank ignores SIGTERMs on its way out
        return losses

    def train_epoch(self, interrupt: DeferredStop | None = None, hooks: dict | None = None) -> float | None:
        """Train one epoch; returns its mean loss, or None if it stopped early (its position kept for a resume)."""
        hooks = hooks if hooks is not None else self._connect()
        if interrupt is None:  # called on its own: never entered, so only a StopTraining is ever wished
            interrupt = DeferredStop()
        self._interrupt = interrupt  # where a callback's StopTraining is noted
        self.model.train()
        batches = self.loader_state.epoch(self.epoch)  # positioned where an interrupted epoch stopped, if one did
        position, self.position = self.position, None
        if position is not None:
            set_rng_state(position.rng)
        self.tally = EpochTally(position, weighted=self.train_step.reduction == "mean")
        self.batch_in_epoch = self.tally.batches
        device, batch_fn, accumulate, vote = self.device, self.batch_fn, self.accumulate, self._vote
        batch_start, after_step, batch_end = (hooks[k] for k in ("on_batch_start", "on_after_optimizer_step",
                                                                  "on_batch_end"))
        group = []  # the step's batches: one optimizer step every `accumulate` of them
        try:
            for batch in batches:  # no batch is drawn beyond the step being trained: a stop leaves none untrained
                batch = pair_on(batch, device, batch_fn)  # (inputs, targets) on the device
                for fn in batch_start:
                    self._call(fn, batch)
                group.append(batch)
                if len(group) < accumulate:
                    continue
                self._train(group, after_step, batch_end)
                group = []
                wish = vote(interrupt.wish)  # another rank's wish arrives a few steps later
                if wish != GO_ON:
                    return self._stop_inside_epoch(wish)
            self.tally.pass_over = True  # the loader's pass is over (a periodic save now must say so)
            if group:  # the last, smaller group of the epoch
                self._train(group, after_step, batch_end)
        except KeyboardInterrupt:  # a second Ctrl-C, anywhere (maybe inside a step): that step is dropped
            return self._stop_inside_epoch(INTERRUPT)
        wish = vote.settle(interrupt.wish)  # epoch end: every rank's last wishes
        if wish != GO_ON:
            return self._stop_inside_epoch(wish, finished=True)
        if self.tally.samples == 0:
            raise ValueError(_("train_loader produced no batches"))
        values = self.tally.values()  # the one CPU-GPU sync point of the epoch: every batch's loss, read at once
        mean = self.process.mean(self.tally.total(values), self.tally.samples)
        if not math.isfinite(mean) and self.precision.scaler is None:
            raise non_finite_error(self.tally, self.process, self.epoch + 1, self.batch_in_epoch, mean)
        return mean

    def _train(self, group, after_step, batch_end) -> None:
        """One optimizer step on `group`; each of its batches is then counted and shown to on_batch_end."""
        losses = self.step.group(group)
        self.optimizer_steps += 1
        for fn in after_step:
            self._call(fn)
        tally, last = self.tally, len(group) - 1
        for i, loss in enumerate(losses):
            tally.losses.append(loss)  # kept on the device: read at the epoch's end, not now
            tally.sizes.append(batch_len(group[i][1]))
            self.batch_in_epoch += 1
            self.batches_trained += 1
            if batch_end:
                self._batch_end(batch_end, loss, i == last)

    def _batch_end(self, fns: list, loss, step_done: bool) -> None:
        self.at_step_boundary = step_done  # the group's last batch: all of the step is counted
        try:
            for fn in fns:
                self._call(fn, loss)
        finally:
            self.at_step_boundary = False

    def _stop_inside_epoch(self, wish: int, finished: bool = False) -> None:
        """Stop between two steps of this epoch (every rank at the same one) and keep the position. `finished`:
        after the epoch's last step, before it is closed (its mean, validation and epoch-end hooks run on resume)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._vote.settle()  # nothing left in flight
        self.position = self.tally.position(  # CPU-GPU sync point here (a stop is rare)
            self.loader_state.state_dict(self.batch_in_epoch, finished))
        value = self.tally.total(self.position.losses)
        bad = not math.isfinite(value) and self.precision.scaler is None
        if self.process.agree(bad):  # every rank is here: decide together
            self.position = None
            raise non_finite_error(self.tally, self.process, self.epoch + 1, self.batch_in_epoch, value)
        if wish == STOP:
            self.stop_reason = self._agreed_reason()
        self._preempted = wish == TERMINATE  # a SIGTERM on any rank: every rank saves and exits with 143
        self._requested = None
        self.loader_state.load_state_dict(self.position.loader)  # a next call continues here, also in this process
        return None

    def _stopped_early(self, between_epochs: bool = False) -> None:
        if not self.is_main:
            self.interrupted = self.stop_reason is None
            return
        if self.stop_reason is not None:
            if between_epochs:
                print(_("Training stopped before epoch {epoch}: {reason}.").format(epoch=self.epoch + 1,
                                                                                  reason=self.stop_reason))
                return
            print(_("Training stopped at {where}: {reason}. Call the trainer again to continue.").format(
                where=self.where(), reason=self.stop_reason))
            return
        self.interrupted = True
        saved = any(isinstance(cb, Checkpoint) for cb in self.callbacks)
        hint = "" if saved else _(" (pass checkpoint=... to also save it to a file)")
        print(_("Training interrupted at {where}. The model is usable; call the trainer again to continue "
                "where it stopped{hint}.").format(where=self.where(), hint=hint))

    def where(self) -> str:
        """Where training stands, in words: 'epoch 2, batch 13 of 40'."""
        try:
            total = len(self.train_loader)
        except TypeError:
            return _("epoch {epoch}, batch {batch}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch)
        return _("epoch {epoch}, batch {batch} of {total}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch,
                                                                   total=total)

    def evaluate(self, loader) -> dict:
        """Mean loss and accuracy over `loader` (`course_utils.evaluation.evaluate`, on the model itself: no
        DistributedDataParallel collectives); in a distributed run the sums are added over ranks."""
        return evaluate(self.model, loader, self.loss_fn, self.device, precision=self.precision,
                        batch_fn=self.batch_fn, all_sum=self.process.all_sum)

    @property
    def is_main(self) -> bool:
        """True in a single process, and on rank 0 of a distributed run (the rank that prints and saves)."""
        return self.process.is_main

    # --- checkpoints: the state of the named parts (`course_utils.checkpoint`) -------------------

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly, as a snapshot: training on afterwards does not change
        it (tensors copied, unlike `model.state_dict()`). A collective in a distributed run: every rank calls it.
        (`save_checkpoint` writes the state without the copy.)"""
        return copy.deepcopy(ckpt.trainer_state(self))

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`: all of it or, if anything does not fit, none of it (ValueError naming why)."""
        ckpt.load_trainer_state(self, state)

    def save_checkpoint(self, path) -> Path:
        """Write the full state to `path` atomically (a crash mid-write never leaves a half-written file); never
        non-finite weights (`NonFiniteLossError`: the file keeps its last good state). Every rank calls it."""
        return ckpt.save_trainer(self, path)

    def load_checkpoint(self, path, map_location=None) -> "Trainer":
        """Restore a checkpoint written by `save_checkpoint` (loaded with weights_only=True: no code runs), mapped
        to `map_location` (default: this trainer's device). One that does not fit leaves the trainer as it was."""
        ckpt.load_trainer(self, path, map_location)
        return self
