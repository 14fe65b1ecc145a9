"""`ResilientStep`: a training step that survives OOM by splitting the batch into micro-batches."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..amp import MixedPrecision
from ..i18n import _
from ..step import Batch, TrainStep, batch_len, optimizer_params, raised_in_optimizer_step
from ..errors import first_line
from .oom import free_memory, is_oom_error
from .sizes import format_bytes


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


class _BufferGuard:
    """Copies of the buffers a training-mode forward changes (the running statistics of BatchNorm and its
    kind), taken before each attempt of a step and put back if it runs out of memory. The modules are found at
    the first step and the copies allocated once; each step is then one identity test and one foreach copy (a
    copy per buffer in one call: benchmarks/bench_peers.py measures what it costs per step). A model without such
    modules at its first step costs nothing. Buffers of modules in eval mode are copied too: they do not change,
    and telling them apart would cost a test per module per step.

    `model.to(...)`, `.half()` and the like replace every buffer by a new tensor: the test of the first one
    notices it and the buffers are found again. A lazy module's buffers are found once it has its first values.
    Anything else new since the buffers were found (a buffer or a module assigned anew, a `.to()` that left the
    first buffer as it was) is noticed only when the statistics are put back, when the model is walked again
    (testing every buffer every step costs more than the copy): what was copied is put back, and a warning names
    the statistics that could not be."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.saved: list[torch.Tensor] = []    # the buffers copied at each save
        self.shadows: list[torch.Tensor] = []  # their copies
        self.first: tuple[dict, str] | None = None  # where the first of them is: its module's buffers and key
        self.look_again = True  # find the buffers at the next save: the first, or a lazy one had no values yet

    def _tracked(self) -> list[tuple[str, dict, str, torch.Tensor]]:
        """(name, its module's buffers, key, buffer) of every buffer of the modules with running statistics, found
        now."""
        return [(f"{name}.{key}".lstrip("."), m._buffers, key, b) for name, m in self.model.named_modules()
                if getattr(m, "track_running_stats", False) for key, b in m._buffers.items() if b is not None]

    def _find(self) -> None:
        found = self._tracked()
        self.look_again = any(is_lazy(b) for *_, b in found)
        found = [entry for entry in found if not is_lazy(entry[3])]
        self.first = found[0][1:3] if found else None
        self.saved = [b for *_, b in found]
        self.shadows = [torch.empty_like(b) for b in self.saved]

    def save(self) -> None:
        if self.look_again:
            self._find()
        elif self.first is None:  # nothing to guard at the first step (a module added since: see restore)
            return
        elif self.first[0].get(self.first[1]) is not self.saved[0]:  # replaced: model.to(...) and the like
            self._find()
        if self.saved:  # (buffers need no grad: no autograd to turn off)
            torch._foreach_copy_(self.shadows, self.saved)

    def restore(self) -> None:
        position = {id(b): i for i, b in enumerate(self.saved)}
        now = [(name, b) for name, _d, _k, b in self._tracked() if not is_lazy(b)]
        keep = [position[id(b)] for _name, b in now if id(b) in position]
        if keep:
            with torch.no_grad():
                torch._foreach_copy_([self.saved[i] for i in keep], [self.shadows[i] for i in keep])
        missed = [name for name, b in now if id(b) not in position]
        if missed:
            warnings.warn(_("out of memory: the running statistics {buffers} were not put back to their values "
                            "before the failed attempt, which keeps its update of them: they are new since the "
                            "statistics were copied (a buffer or module assigned anew, a .to() that left the first "
                            "buffer as it was, or a lazy module's first step). A num_batches_tracked among them "
                            "also changes what a BatchNorm with momentum=None averages next").format(
                buffers=", ".join(missed)), stacklevel=3)
        if missed or len(keep) != len(self.saved):
            self._find()


# --- the OOM-resilient training step -----------------------------------------------------------

class ResilientStepOutOfMemoryError(torch.OutOfMemoryError):
    """ResilientStep could not recover: even micro-batches of one sample do not fit, or the
    optimizer step itself ran out of memory (smaller micro-batches cannot help there).

    `advice`: what ran out and what to do, in the learner's language; `error`: the first line of the original
    out-of-memory error; `first_step`: True when the optimizer's first step ran out (when Adam creates its state),
    False for a later optimizer step, None when the forward or backward pass did not fit."""

    def __init__(self, advice: str, error: str = "", first_step: bool | None = None):
        super().__init__(advice + (" " + _("Original error: {error}").format(error=error) if error else ""))
        self.advice, self.error, self.first_step = advice, error, first_step


class ResilientStep:
    """One training step that survives running out of memory.

        step = ResilientStep(model, optimizer, loss_fn)        # precision=MixedPrecision(...) works too
        loss = step(inputs, targets)   # mean loss over the batch: a detached 0-d tensor on the device
        losses = step.group(batches)   # one optimizer step over several batches (gradient accumulation)

    It runs a `course_utils.step.TrainStep`. On an out-of-memory error in the forward or backward pass it
    leaves the `except` block (so the failed attempt's tensors are freed), drops the gradients, puts back the
    buffers the failed forward changed (BatchNorm's running statistics), frees memory, halves the chunk size and
    runs the same step again: every batch is cut into consecutive chunks of `micro_batch_size` samples, each
    chunk's loss weighted by its share of the step's samples, so the update equals the whole step's (up to
    float rounding) and no sample is skipped. A step of several batches (`group`) is split the same way.
    After `regrow_after` clean steps in chunks it tries whole batches again (activations may have shrunk,
    or memory was freed elsewhere). `step.micro_batch_size` is the chunk size in use (None: whole batches),
    `step.oom_count` counts the errors recovered.

    Models whose output for a sample depends on the rest of the batch (BatchNorm in training mode) get a
    different update from chunks, as they do with gradient accumulation on any GPU. Statistics that are new since
    it found them at its first step (a BatchNorm module or buffer assigned anew later, a lazy module's first
    step; `model.to(...)` is noticed) cannot be put back at the next OOM: a warning names them.

    `loss_fn` must return the batch mean (reduction="mean", the default of PyTorch's losses); pass
    `reduction="sum"` for a summed loss. `precision` defaults to float32 (`MixedPrecision(device, enabled=False)`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 precision: Any = None, grad_clip: float | None = None, *, reduction: str = "mean",
                 regrow_after: int = 100):
        if not isinstance(model, nn.Module):
            raise TypeError(_("model must be an nn.Module, got {kind}").format(kind=type(model).__name__))
        if precision is None:
            precision = MixedPrecision(_device_of(model), enabled=False)
        self._setup(TrainStep(model, optimizer, loss_fn, precision, grad_clip, reduction=reduction), regrow_after)

    @classmethod
    def around(cls, step: TrainStep, regrow_after: int = 100) -> "ResilientStep":
        """Make an existing `TrainStep` resilient (the Trainer does this with `oom_recovery=True`)."""
        if not isinstance(step, TrainStep):
            raise TypeError(_("step must be a course_utils.step.TrainStep, got {kind}").format(
                kind=type(step).__name__))
        self = cls.__new__(cls)
        self._setup(step, regrow_after)
        return self

    def _setup(self, step: TrainStep, regrow_after: int) -> None:
        if isinstance(regrow_after, bool) or not isinstance(regrow_after, int) or regrow_after < 1:
            raise ValueError(_("regrow_after must be a positive int, got {regrow_after!r}").format(
                regrow_after=regrow_after))
        self.step = step
        self.regrow_after = regrow_after
        self.micro_batch_size: int | None = None  # None: whole batches fit so far
        self.oom_count = 0
        self.clean_steps = 0  # steps in a row that fit at the current chunk size
        self._buffers: _BufferGuard | None = None  # made at the first step

    @property
    def model(self) -> nn.Module:
        return self.step.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.step.optimizer

    @property
    def precision(self):
        return self.step.precision

    def __call__(self, inputs, targets) -> torch.Tensor:
        n = batch_len(inputs)
        if batch_len(targets) != n:
            raise ValueError(_("inputs have {inputs} samples but targets have {targets}").format(
                inputs=n, targets=batch_len(targets)))
        return self.group([(inputs, targets)])[0]

    def group(self, batches: list[Batch]) -> list[torch.Tensor]:
        """One optimizer step over `batches`, in chunks small enough to fit; each batch's mean loss."""
        first_step = not self.optimizer.state  # Adam & co. create their state on their first step
        if self._buffers is None:
            self._buffers = _BufferGuard(self.model)
        while True:
            chunk = self.micro_batch_size  # None: whole batches
            if chunk is not None and chunk >= max(batch_len(y) for _x, y in batches):
                chunk = None  # its chunks would be whole batches
            self._buffers.save()  # what the forward may change (BatchNorm statistics)
            failure = None
            try:
                losses = self.step.group(batches, chunk_size=chunk)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                if raised_in_optimizer_step(exc):
                    raise ResilientStepOutOfMemoryError(self._step_oom_message(first_step), first_line(exc),
                                                        first_step) from None
                if hasattr(self.step.model, "no_sync"):  # DistributedDataParallel: the ranks must agree
                    raise ResilientStepOutOfMemoryError(_(
                        "out of memory in a distributed run: every rank must split its batch the same way, and "
                        "the ranks cannot agree on a new split in the middle of a step (the others are already "
                        "waiting to exchange gradients). Stopping every rank instead of hanging: start again "
                        "with a smaller per-rank batch_size and accumulate=k for the same global batch."),
                        first_line(exc)) from None
                failure = first_line(exc)  # keep text only: the exception holds the tensors
            if failure is None:
                if chunk is not None:
                    self._clean_step()
                return losses
            # Outside the except block: the exception and its traceback are gone, and with them the
            # failed attempt's activations. Now freeing memory can actually free it.
            self.oom_count += 1
            self.optimizer.zero_grad(set_to_none=True)
            reset = getattr(self.precision, "reset", None)
            if callable(reset):
                reset(self.optimizer)
            self._buffers.restore()
            free_memory()
            largest = max(batch_len(y) for _x, y in batches)
            current = chunk if chunk is not None else largest
            if current <= 1:
                raise ResilientStepOutOfMemoryError(_(
                    "out of memory even with micro-batches of 1 sample: the model, its gradients and "
                    "optimizer state plus one sample's activations do not fit. Try mixed precision, "
                    "activation checkpointing, a smaller model or a bigger GPU."), failure)
            self.micro_batch_size = (current + 1) // 2
            self.clean_steps = 0

    def _clean_step(self) -> None:
        """A step that fit in chunks: after `regrow_after` of them in a row, try whole batches again."""
        self.clean_steps += 1
        if self.clean_steps >= self.regrow_after:
            self.micro_batch_size, self.clean_steps = None, 0

    def _step_oom_message(self, first_step: bool) -> str:
        opt = self.optimizer
        name = type(opt).__name__
        params = sum(p.numel() * p.element_size() for p in optimizer_params(opt))
        cause = _("out of memory in the optimizer step ({optimizer}). Smaller chunks cannot help: they only shrink "
                  "activations, not the parameters, gradients and optimizer state the step works on. ").format(
            optimizer=name)
        if first_step:
            cause += _("This was the optimizer's first step, when {optimizer} creates its state (Adam and AdamW: two "
                       "tensors the size of the parameters, 2 x {size} here; SGD with momentum: one). Fix: leave "
                       "room for that state (course_utils.memory.estimate_training_memory counts it), use an "
                       "optimizer with less state, or pass foreach=False to the optimizer (the default foreach "
                       "implementation allocates temporaries for all parameters at once). ").format(
                optimizer=name, size=format_bytes(params))
        else:
            cause += _("The optimizer's state already existed, so its temporaries did not fit: pass foreach=False "
                       "to the optimizer (the foreach implementation allocates temporaries for all parameters at "
                       "once), or free memory elsewhere. ")
        return cause + _("Some parameters may already be updated.")

    def state_dict(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "clean_steps": self.clean_steps,
                "oom_count": self.oom_count}

    def load_state_dict(self, state: dict) -> None:
        self.micro_batch_size = state.get("micro_batch_size")
        self.clean_steps = state.get("clean_steps", 0)
        self.oom_count = state.get("oom_count", 0)

    def __repr__(self) -> str:
        return (f"ResilientStep(micro_batch_size={self.micro_batch_size}, oom_count={self.oom_count}, "
                f"precision={self.precision!r})")
