"""Will the step fit? A check before the first training step, with the numbers.

`check_fits(model, optimizer, batch, loss_fn)` predicts the step's peak with `estimate_training_memory` (fake
tensors: nothing is allocated) and compares what the step still needs with the memory free for it: a
`SimulatedGPU`'s budget left, or on CUDA the device's free memory plus what PyTorch's cache holds unused. The
`Trainer` runs it before its first step through the `MemoryCheck` callback, which warns (`MemoryWarning`, shown
at the learner's own call, not inside the package) when the step will not fit.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..callbacks import Callback
from ..errors import learner_stacklevel
from ..i18n import N_, _
from ..step import batch_len
from .estimate import MemoryEstimate, estimate_training_memory
from .resilient import ResilientStep
from .simulated import active_simulated_gpu
from .sizes import format_bytes


class MemoryWarning(UserWarning):
    """A training step is predicted not to fit in the memory free for it."""


@dataclass
class FitCheck:
    """What one training step needs beyond what is already allocated, and what is free for it."""
    needed: int           # the predicted peak minus the parameters and the batch, which already exist
    free: int
    where: str            # "the simulated GPU", "cuda:0" (in English; shown translated)
    estimate: MemoryEstimate
    batch_size: int

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    def __str__(self) -> str:
        e = self.estimate
        return _("one step on batches of {batch_size} needs about {needed} more than the model and the batch "
                 "(predicted peak {peak}: gradients {gradients}, optimizer state {state}, activations "
                 "{activations}), and {where} has {free} free").format(
            batch_size=self.batch_size, needed=format_bytes(self.needed), peak=format_bytes(e.total),
            gradients=format_bytes(e.gradients), state=format_bytes(e.optimizer_state),
            activations=format_bytes(e.activations), where=_(self.where), free=format_bytes(self.free))


def free_for_training(device: torch.device) -> tuple[int, str] | None:
    """(bytes free for tensors, where) on `device`: a SimulatedGPU's budget left, or CUDA's free memory plus the
    unused part of PyTorch's cache; None where nothing is known (a CPU without a simulated budget)."""
    sim = active_simulated_gpu()
    if sim is not None:
        return max(sim.budget - sim.memory_allocated(), 0), N_("the simulated GPU")
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, str(device)
    return None


def check_fits(model: nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn, device: torch.device,
               autocast_dtype: torch.dtype | None = None) -> FitCheck | None:
    """Predict whether a training step on `batch` (inputs, targets) fits; None when it cannot be told (no
    memory figure for this device, or a model the estimator cannot run on fake tensors)."""
    free = free_for_training(device)
    if free is None:
        return None
    sim = active_simulated_gpu()
    try:
        with sim.paused() if sim is not None else contextlib.nullcontext():
            estimate = estimate_training_memory(model, optimizer, batch, loss_fn, autocast_dtype=autocast_dtype)
    except (RuntimeError, TypeError, ValueError):
        return None
    needed = estimate.total - estimate.parameters - estimate.batch
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    return FitCheck(needed, free[0], free[1], estimate, batch_len(inputs))


def warn_if_too_big(check: FitCheck | None, remedy: str) -> None:
    """A `MemoryWarning` with the numbers when `check` says the step will not fit, shown at the learner's call."""
    if check is not None and not check.fits:
        warnings.warn(_("Memory check before the first step: {check}. It will likely run out of memory: "
                        "{remedy}").format(check=check, remedy=remedy), MemoryWarning,
                      stacklevel=learner_stacklevel())


class MemoryCheck(Callback):
    """The Trainer's check before its first step: does the step fit in the memory free for it? `result` keeps the
    answer (a `FitCheck`, or None where nothing is known: a CPU without a SimulatedGPU, a model the estimator
    cannot run). A `MemoryWarning` with the numbers when it will not fit, except with oom_recovery=True, where
    running out is the plan, not a surprise. Every Trainer has one."""

    order = -100  # before the other callbacks see the first batch

    def __init__(self):
        self.result: FitCheck | None = None
        self.checked = False

    @property
    def checked(self) -> bool:
        """Whether the first batch was checked; set it to False to check the next batch again."""
        return self._checked

    @checked.setter
    def checked(self, value: bool) -> None:
        self._checked = value
        if value and type(self).on_batch_start is MemoryCheck.on_batch_start:
            self.on_batch_start = None  # done: the Trainer's next call leaves this hook out (no call every batch)
        else:  # to check again, or a subclass's own on_batch_start: keep the hook
            self.__dict__.pop("on_batch_start", None)

    def on_batch_start(self, trainer, batch) -> None:
        if self.checked:
            return
        self.checked = True
        precision = trainer.precision
        self.result = check_fits(trainer.model, trainer.optimizer, batch, trainer.loss_fn, trainer.device,
                                 autocast_dtype=precision.dtype if precision.enabled else None)
        if not isinstance(trainer.step, ResilientStep):
            warn_if_too_big(self.result, _("use a smaller batch_size (with accumulate=k for the same update), "
                                           "mixed_precision=True, activation checkpointing "
                                           "(course_utils.memory.checkpointed), or oom_recovery=True."))
