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

import copy
import math
import weakref
from pathlib import Path

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed
from .amp import MixedPrecision
from .callbacks import HOOKS, Callback, Checkpoint, LRScheduler, StopTraining, overridden, warn_unknown_hooks
from .checkpoint import CheckpointError, EpochPosition, NonFiniteLossError
from .device import get_device
from .loader_state import LoaderState
from .memory import MemoryCheck, ResilientStep
from .signals import GO_ON, INTERRUPT, PREEMPTED_EXIT, STOP, TERMINATE, DeferredStop
from .step import TrainStep, batch_len, check_optimizer_holds, forward, move_batch, pair_on
from .i18n import _

__all__ = ["Callback", "CheckpointError", "NonFiniteLossError", "StopTraining", "Trainer", "move_batch",
           "read_checkpoint"]


def read_checkpoint(path, map_location=None) -> dict:
    """Load a Trainer checkpoint with `weights_only=True`, or raise CheckpointError naming the file."""
    return ckpt.load(path, map_location=map_location)


def _reason(stop: StopTraining | None) -> str:
    """Why training stopped, in words: the StopTraining's message, or a default when it has none."""
    return (str(stop) if stop is not None else "") or _("a callback raised StopTraining")


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
    callback's `StopTraining` takes effect at the next step boundary (after a SIGTERM, once the Checkpoint
    callback has saved, the trainer raises SystemExit with status 143, SIGTERM's): the step in progress (all batches of an accumulation group) finishes, then training
    stops, so every stop lies between two optimizer steps. Calling the trainer again, or loading the checkpoint
    in a new process, continues from there and ends bit-identical to an uninterrupted run (weights, optimizer,
    loss history, random state), for the course's TensorLoader, torch DataLoaders (with or without workers,
    samplers, generators), torchdata's StatefulDataLoader and lists; `course_utils.loader_state` says what
    cannot be restored (random draws inside persistent workers; an arbitrary iterable's order), at save time.
    A second Ctrl-C interrupts at once, possibly inside a step: that step is dropped and the resume is not exact.

    A non-finite loss (inf or nan) is noticed at the end of its epoch, where the Trainer reads the loss anyway
    (no extra sync per step): training stops with a `NonFiniteLossError` naming the first bad batch, and no
    checkpoint is ever written with non-finite weights (the last good one stays). `callbacks.CheckFinite()` checks
    every step instead, at the cost of a sync per step. Under fp16 a GradScaler skips such steps: that is its job.

    Under `torchrun` the same script trains data-parallel (`course_utils.distributed`): the model is wrapped in
    DistributedDataParallel (`trainer.train_model`; `trainer.model` stays your module), each process gets its
    share of every epoch, and the loader's `batch_size` is per process, as in PyTorch: the global batch is
    `world_size x batch_size x accumulate`. Losses and validation figures are global; rank 0 prints and writes
    checkpoints (`trainer.is_main`), with every rank's random and loader state, so a resume in a new torchrun
    continues each rank exactly. A stop wished on any rank (Ctrl-C, StopTraining, at a step or at an epoch's end)
    stops every rank at the same step, with its reason; agreeing costs no blocking round trip per step
    (`distributed.StopVote`: a small asynchronous all-reduce about every quarter second, or every step when steps
    take longer), so all ranks stop together within about half a second of the wish (2 steps where steps take
    longer than a quarter second), or at the epoch's end.
    `sync_batchnorm=True` converts BatchNorm layers to SyncBatchNorm (GPUs only).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, train_loader,
                 device=None, callbacks=(), *, val_loader=None, mixed_precision=False, accumulate: int = 1,
                 grad_clip: float | None = None, oom_recovery: bool = False, checkpoint=None, scheduler=None,
                 sync_batchnorm: bool = False, batch_fn=None, resume: bool = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be a function of a batch, got {type(batch_fn).__name__}")
        check_optimizer_holds(model, optimizer)
        device = device if isinstance(device, torch.device) else get_device(device)
        # One process, or (under torchrun) this rank of the group: one GPU per local rank, or the CPU with gloo.
        self.process = distributed.join(device.type)
        self.device = self.process.device_for(device)
        # the model on the device, and what the step runs: the model itself, or its DistributedDataParallel wrapper
        self.model, self.train_model = self.process.wrap(model, self.device, sync_batchnorm)
        train_loader = self.process.shard(train_loader)  # this rank's share of every epoch
        val_loader = self.process.shard(val_loader) if val_loader is not None else None
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.accumulate = accumulate
        self.batch_fn = batch_fn
        self.precision = _precision(mixed_precision, self.device)
        self.train_step = TrainStep(self.train_model, optimizer, loss_fn, self.precision, grad_clip)
        self.step = ResilientStep.around(self.train_step) if oom_recovery else self.train_step
        self.callbacks: list[Callback] = [MemoryCheck(), *callbacks]  # does the first step fit? (warns if not)
        if scheduler is not None:
            self.callbacks.append(LRScheduler(scheduler))
        if checkpoint is not None:
            self.callbacks.append(Checkpoint(checkpoint))
        self._loader = LoaderState(train_loader)
        self._vote = self.process.stop_vote()  # one process: its own wish, at once
        self.history: list[float] = []
        self.logs: list[dict] = []
        self.epoch = 0               # finished epochs
        self.batches_trained = 0     # batches trained on, over all epochs
        self.optimizer_steps = 0     # optimizer steps taken (one per `accumulate` batches)
        self.batch_in_epoch = 0      # batches of the current epoch trained on
        self.position: EpochPosition | None = None  # where an interrupted epoch stopped
        self.interrupted = False
        self._interrupt = DeferredStop()  # the current call's (never entered outside a call: never requested)
        self._preempted = False           # a SIGTERM on some rank: this call ends with SystemExit(143)
        self.stop_reason: str | None = None
        self.epochs_this_call = 0
        self._requested: str | None = None  # a StopTraining raised on this rank, acted on at the step boundary
        self._losses: list[torch.Tensor] = []  # this epoch's batch losses (device tensors: kept, never read per step)
        self._first_loss_batch = 0   # the batch of the epoch that _losses[0] belongs to
        self.at_step_boundary = False  # True in on_batch_end of a step's last batch: a consistent point to save
        self._pass_over = False
        if resume:
            self._resume()

    def _resume(self) -> None:
        """resume=True: continue from the Checkpoint callback's file if it exists, else start fresh. The same
        command then serves the first launch and every restart (torchrun --max-restarts, a preempted job)."""
        paths = [cb.path for cb in self.callbacks if isinstance(cb, Checkpoint)]
        if not paths:
            raise ValueError("resume=True continues from the checkpoint file: pass checkpoint='run.pt' (or a "
                             "Checkpoint callback) too")
        if not paths[0].exists():
            if self.is_main:
                print(_("No checkpoint at '{name}' yet: starting from scratch.").format(name=paths[0].name))
            return
        try:
            self.load_checkpoint(paths[0])
        except CheckpointError as exc:  # a restart would fail the same way: say how to get going again
            raise CheckpointError(_("{error}. resume=True starts fresh only when there is no file: move '{name}' "
                                    "away to start from scratch, or put back a good copy").format(
                error=str(exc).rstrip("."), name=paths[0].name)) from None
        if self.is_main:
            print(_("Resumed from '{name}' at {where}.").format(name=paths[0].name, where=self.where()))

    # --- callbacks ---------------------------------------------------------------------------

    def _connect(self) -> dict[str, list]:
        """The callbacks' overridden hooks, in `order` (a hook nobody overrides is an empty list: nothing to
        call, nothing to test for); the step's two hooks are connected to the trainer's."""
        ordered = sorted(self.callbacks, key=lambda cb: getattr(cb, "order", 0))
        for cb in ordered:
            warn_unknown_hooks(cb)
        hooks = {name: [getattr(cb, name) for cb in ordered if overridden(cb, name)] for name in HOOKS}
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
        """Call every hook in `fns` (the step's own events loop over theirs in place: an empty list costs no
        call)."""
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

    def train_epoch(self, interrupt: DeferredStop | None = None, hooks: dict | None = None) -> float | None:
        """Train one epoch; returns its mean loss, or None if it stopped early (its position kept for a resume)."""
        hooks = hooks if hooks is not None else self._connect()
        if interrupt is None:  # called on its own: never entered, so only a StopTraining is ever wished
            interrupt = DeferredStop()
        self._interrupt = interrupt  # where a callback's StopTraining is noted
        self.model.train()
        batches = self._loader.epoch(self.epoch)  # positioned where an interrupted epoch stopped, if one did
        position, self.position = self.position, None
        if position is None:
            self._loss_sum = torch.zeros((), device=self.device)  # running sum stays on the device: no per-step sync
            self._samples = self.batch_in_epoch = 0
        else:
            ckpt.set_rng_state(position.rng)
            self._loss_sum = torch.tensor(position.loss_sum, device=self.device)  # this rank's own float32 sum
            self._samples = position.samples_done
            self.batch_in_epoch = position.batches_done
        self._losses, self._first_loss_batch = [], self.batch_in_epoch
        self._pass_over = False
        try:
            for group in self._groups(batches, hooks["on_batch_start"]):  # one step's batches
                self._step(group, hooks["on_after_optimizer_step"], hooks["on_batch_end"])
                wish = self._vote(interrupt.wish)  # another rank's wish arrives a few steps later
                if wish != GO_ON:  # (after the last, smaller group the loader's pass is over: `finished`)
                    return self._stop_inside_epoch(wish, finished=self._pass_over)
        except KeyboardInterrupt:  # a second Ctrl-C, anywhere (maybe inside a step): that step is dropped
            return self._stop_inside_epoch(INTERRUPT)
        wish = self._vote.settle(interrupt.wish)  # epoch end: every rank's last wishes
        if wish != GO_ON:
            return self._stop_inside_epoch(wish, finished=True)
        if self._samples == 0:
            raise ValueError("train_loader produced no batches")
        mean = self.process.mean(self._loss_sum, self._samples)  # the one CPU-GPU sync point of the epoch
        if not math.isfinite(mean) and self.precision.scaler is None:
            self._raise_non_finite(mean)
        return mean

    def _stop_inside_epoch(self, wish: int, finished: bool = False) -> None:
        """Stop between two steps of this epoch (every rank at the same one) and keep the position. `finished`:
        after the epoch's last step, before it is closed (its mean, validation and epoch-end hooks run on resume)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._vote.settle()  # nothing left in flight
        loss_sum = self._loss_sum.item()  # CPU-GPU sync point here (a stop is rare)
        bad = not math.isfinite(loss_sum) and self.precision.scaler is None
        if self.process.agree(bad):  # every rank is here: decide together
            self._raise_non_finite(loss_sum)
        if wish == STOP:
            self.stop_reason = self._agreed_reason()
        self._preempted = wish == TERMINATE  # a SIGTERM on any rank: every rank saves and exits with 143
        self._requested = None
        self.position = EpochPosition(self.batch_in_epoch, self._samples, loss_sum, ckpt.rng_state(),
                                      self._loader.state_dict(self.batch_in_epoch, finished))
        self._loader.load_state_dict(self.position.loader)  # a next call continues here, also in this process
        return None

    def _raise_non_finite(self, mean: float) -> None:
        """The epoch's loss is not finite: name the first bad batch (over all ranks) and stop."""
        bad = None
        if self._losses:
            finite = torch.stack([x.float() for x in self._losses]).isfinite()
            if not finite.all():
                index = int((~finite).nonzero()[0])
                bad = (self._first_loss_batch + index + 1, float(self._losses[index]))
        found = [(b, rank) for rank, b in enumerate(self.process.gather(bad)) if b is not None]
        (batch, value), rank = min(found) if found else ((self.batch_in_epoch, mean), 0)
        where = _("epoch {epoch}, batch {batch}").format(epoch=self.epoch + 1, batch=batch)
        if self.process.world_size > 1:
            where += _(" on rank {rank}").format(rank=rank)
        raise NonFiniteLossError(_(
            "the loss became {value} at {where}: training stopped (the Trainer reads the loss at an epoch's end "
            "and when it stops). The weights are probably not finite any more; no checkpoint was written (the last "
            "good one is kept). Usual causes: a "
            "learning rate too high, log or division by zero in the loss, float16 overflow (mixed_precision='fp16' "
            "scales the loss). callbacks=[CheckFinite()] stops at the bad step itself (one sync a step).").format(
            value=value, where=where))

    def _groups(self, batches, batch_start):
        """The epoch's batches as (inputs, targets) on the device, in groups of `accumulate` (one optimizer step
        each; the last group may be smaller), each batch shown to the on_batch_start hooks as it is drawn. No batch
        is drawn beyond the group being trained, so a stop between groups leaves nothing drawn and untrained."""
        group, device, batch_fn, accumulate = [], self.device, self.batch_fn, self.accumulate
        for batch in batches:
            batch = pair_on(batch, device, batch_fn)
            for fn in batch_start:
                self._call(fn, batch)
            group.append(batch)
            if len(group) == accumulate:
                yield group
                group = []
        self._pass_over = True  # the loader's pass is over (a periodic save now must say so)
        if group:  # the last, smaller group of the epoch
            yield group

    def _step(self, group, after_step, batch_end) -> None:
        losses = self.step.group(group)
        self.optimizer_steps += 1
        for fn in after_step:
            self._call(fn)
        last = len(group) - 1
        for i, ((_inputs, targets), loss) in enumerate(zip(group, losses)):
            n = batch_len(targets)
            self._loss_sum.add_(loss, alpha=n)  # one fused op: sum += n * loss
            self._losses.append(loss)
            self._samples += n
            self.batch_in_epoch += 1
            self.batches_trained += 1
            self.at_step_boundary = i == last  # the group's last batch: all of the step is counted
            try:
                for fn in batch_end:
                    self._call(fn, loss)
            finally:
                self.at_step_boundary = False

    def __call__(self, epochs: int = 1) -> list[float]:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
        losses = []
        self.interrupted = False
        self.stop_reason = None
        self._requested = None
        self.epochs_this_call = epochs
        hooks = self._connect()
        interrupt = self._interrupt = DeferredStop()
        self._preempted = False
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
                        logs.update(val_loss=val["loss"], val_accuracy=val["accuracy"])
                    self.history.append(mean_loss)
                    self.logs.append(logs)
                    losses.append(mean_loss)
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    self._losses = []
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
            raise SystemExit(PREEMPTED_EXIT)
        return losses

    def where(self) -> str:
        """Where training stands, in words: 'epoch 2, batch 13 of 40'."""
        try:
            total = len(self.train_loader)
        except TypeError:
            return _("epoch {epoch}, batch {batch}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch)
        return _("epoch {epoch}, batch {batch} of {total}").format(epoch=self.epoch + 1, batch=self.batch_in_epoch,
                                                                   total=total)

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
            inputs, targets = pair_on(batch, self.device, self.batch_fn)
            with self.precision.autocast():
                logits = forward(self.model, inputs)  # the model itself: no DistributedDataParallel collectives
            total_loss += self.loss_fn(logits.float(), targets) * len(targets)
            correct += (logits.argmax(1) == targets).sum()
            count += len(targets)
        self.model.train(was_training)
        sums = torch.stack([total_loss, correct, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
        total_loss, correct, count = self.process.all_sum(sums).tolist()  # CPU-GPU sync point here
        if count == 0:
            raise ValueError("the evaluation loader produced no batches")
        return {"loss": total_loss / count, "accuracy": correct / count}

    @property
    def is_main(self) -> bool:
        """True in a single process, and on rank 0 of a distributed run (the rank that prints and saves)."""
        return self.process.is_main

    # --- checkpoints -----------------------------------------------------------------------------

    def _here(self) -> EpochPosition:
        """Where training is inside the current epoch, at a step boundary (a periodic checkpoint's position)."""
        return EpochPosition(self.batch_in_epoch, self._samples, self._loss_sum.item(), ckpt.rng_state(),
                             self._loader.state_dict(self.batch_in_epoch, self._pass_over))

    def _rank_state(self) -> dict:
        """What differs between ranks: the random generators, the loader's position, where the epoch stopped."""
        position = self.position
        if position is None and self.at_step_boundary:  # saving while training: here, inside the epoch
            position = self._here()
        return {"rng": ckpt.rng_state(),
                "loader": position.loader if position is not None else self._loader.state_dict(),
                "position": position.to_dict() if position is not None else None}

    def state_dict(self) -> dict:
        """Everything needed to continue this run exactly: the state of each part (`checkpoint.PARTS`: weights,
        optimizer, precision with its loss scale, the step's micro-batch size), the callbacks' states, the
        counters (`checkpoint.COUNTERS`), and for every rank its random generators and loader position (a
        collective in a distributed run: every rank calls it)."""
        if self.position is not None or self.at_step_boundary:
            self._loader.warn_if_inexact()
        return {"format": ckpt.FORMAT, "optimizer_class": type(self.optimizer).__name__,
                **{name: getattr(self, name).state_dict() for name in ckpt.PARTS},
                "callbacks": [{"class": type(cb).__name__, "state": cb.state_dict()} for cb in self.callbacks],
                **{name: copy.deepcopy(getattr(self, name)) for name in ckpt.COUNTERS},
                "world_size": self.process.world_size,
                "ranks": self.process.gather(self._rank_state())}  # rank 0's first

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`: all of it or, if anything does not fit, none of it (ValueError naming why)."""
        mine = ckpt.check_trainer_state(state, self.model, self.optimizer, self.callbacks, self.process.world_size,
                                        self.process.rank)
        self._loader.check(mine["loader"])
        before = {name: copy.deepcopy(getattr(self, name).state_dict()) for name in ckpt.PARTS}  # to put back
        before.update({name: copy.deepcopy(getattr(self, name)) for name in ckpt.COUNTERS},
                      callbacks=[{"class": type(cb).__name__, "state": copy.deepcopy(cb.state_dict())}
                                 for cb in self.callbacks])
        where = (ckpt.rng_state(), self._loader.snapshot(), self.position, self.batch_in_epoch)
        try:
            self._apply(state)
            ckpt.set_rng_state(mine["rng"])
            self._loader.load_state_dict(mine["loader"])
            self.position = EpochPosition.from_dict(mine["position"]) if mine["position"] is not None else None
            self.batch_in_epoch = self.position.batches_done if self.position is not None else 0
        except BaseException:  # half-way: put everything back as it was
            self._apply(before)
            ckpt.set_rng_state(where[0])
            self._loader.restore(where[1])
            self.position, self.batch_in_epoch = where[2:]
            raise

    def _apply(self, state: dict) -> None:
        """Load the parts, callbacks and counters of `state` (already checked)."""
        for name in ckpt.PARTS:
            getattr(self, name).load_state_dict(state[name])
        for cb, saved in ckpt.match_callbacks(self.callbacks, state["callbacks"]):
            cb.load_state_dict(saved)
        for name in ckpt.COUNTERS:
            setattr(self, name, copy.deepcopy(state[name]))

    def _check_finite(self, path: Path) -> None:
        """Refuse to save non-finite weights or a non-finite running loss (a sync: once per save)."""
        tensors = [t for t in self.model.state_dict().values() if t.is_floating_point()]
        weights_ok = bool(torch.stack([t.isfinite().all() for t in tensors]).all()) if tensors else True
        if self.position is not None:
            loss_ok = math.isfinite(self.position.loss_sum)
        else:  # between epochs, or a periodic save while training (the running sum: read once per save)
            loss_ok = not self.at_step_boundary or self.precision.scaler is not None \
                or math.isfinite(self._loss_sum.item())
        if not self.process.agree(not (weights_ok and loss_ok)):  # every rank saves, or none (a round trip)
            return
        what = _("the weights") if not weights_ok else _("the loss of the interrupted epoch")
        raise NonFiniteLossError(_("not saving '{name}': {what} are not finite (inf or nan), and a checkpoint must "
                                   "never hold them; the file keeps the last good state.").format(
            name=path.name, what=what))

    def save_checkpoint(self, path) -> Path:
        """Write the full state to `path` atomically: a temporary file in the same folder, flushed to disk,
        then renamed over the target, so a crash mid-write never leaves a half-written checkpoint. Non-finite
        weights are never written (`NonFiniteLossError`; the file keeps its last good state). In a distributed
        run every rank calls it (the state gathers every rank's generators and loader position), rank 0 writes
        the file, and all ranks wait for it (a barrier) before going on."""
        path = Path(path)
        self._check_finite(path)
        state = self.state_dict()
        if self.is_main:
            ckpt.save(state, path)
        self.process.barrier()
        return path

    def load_checkpoint(self, path, map_location=None) -> "Trainer":
        """Restore a checkpoint written by `save_checkpoint` (loaded with weights_only=True: no code runs).
        Tensors are mapped to `map_location` (default: this trainer's device) on the way in. Everything is
        checked before anything changes: a checkpoint that does not fit leaves the trainer as it was."""
        state = ckpt.load(path, map_location=map_location if map_location is not None else self.device)
        try:
            self.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise CheckpointError(_("checkpoint '{path}' does not fit this trainer: {message}").format(
                path=path, message=exc)) from None
        return self
