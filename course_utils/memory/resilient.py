"""`ResilientStep`: a training step that survives OOM by splitting the batch into micro-batches."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .oom import _first_line, free_memory, is_oom_error


# --- one training step, the way the course writes it ------------------------------------------

def _loss_of(model: nn.Module, loss_fn, inputs, targets) -> torch.Tensor:
    out = model(*inputs) if isinstance(inputs, (list, tuple)) else model(inputs)
    return loss_fn(out, targets)


def _backward_and_step(loss: torch.Tensor, optimizer, parameters, precision, grad_clip) -> None:
    if precision is None:
        loss.backward()
        if grad_clip is not None:
            nn.utils.clip_grad_norm_(parameters, grad_clip)
        optimizer.step()
    else:
        precision.backward(loss)
        precision.step(optimizer, parameters=parameters if grad_clip is not None else None,
                       clip_grad_norm=grad_clip)


def _batch_len(x) -> int:
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError("a batch must have a batch dimension (got a 0-d tensor)")
        return x.shape[0]
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return _batch_len(x[0])
    raise TypeError(f"a batch must be a tensor or a tuple/list of tensors, got {type(x).__name__}")


def _split(x, size: int) -> list:
    if isinstance(x, torch.Tensor):
        return list(x.split(size))  # views: no copy
    parts = [_split(t, size) for t in x]
    return [type(x)(p) for p in zip(*parts)]


# --- the OOM-resilient training step -----------------------------------------------------------

class ResilientStepOutOfMemoryError(torch.OutOfMemoryError):
    """ResilientStep could not recover: even micro-batches of one sample do not fit, or the
    optimizer step itself ran out of memory (smaller micro-batches cannot help there)."""


class ResilientStep:
    """One training step that survives running out of memory.

        step = ResilientStep(model, optimizer, loss_fn)        # precision=MixedPrecision(...) works too
        loss = step(inputs, targets)   # mean loss over the batch: a detached 0-d tensor on the device

    Normally: zero_grad, forward, backward, optimizer step. On an out-of-memory error in the forward
    or backward pass it leaves the `except` block (so the failed attempt's tensors are freed), frees
    memory, halves the micro-batch size and runs the same step again with gradient accumulation: the
    batch is split into consecutive chunks of `micro_batch_size` samples (the last may be smaller),
    each chunk's mean loss is weighted by chunk_size / batch_size, so the accumulated gradient, and
    hence the update, equals the full batch's (up to float rounding) and no sample is skipped. The
    size that worked is kept in `step.micro_batch_size` for later calls; `step.oom_count` counts the
    errors recovered. Models whose output for a sample depends on the rest of the batch (BatchNorm
    in training mode) get a different update from micro-batches, as they do on any GPU.

    `loss_fn` must return the batch mean (reduction="mean", the default of PyTorch's losses); pass
    `reduction="sum"` for a summed loss. `precision` is any object with `autocast()`,
    `backward(loss)` and `step(optimizer, parameters=..., clip_grad_norm=...)` (e.g.
    `course_utils.amp.MixedPrecision`); None means float32: `loss.backward()`, optional
    `clip_grad_norm_(grad_clip)`, `optimizer.step()`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 precision: Any = None, grad_clip: float | None = None, *, reduction: str = "mean"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be a positive number or None, got {grad_clip!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if precision is not None:
            missing = [m for m in ("autocast", "backward", "step") if not callable(getattr(precision, m, None))]
            if missing:
                raise TypeError(f"precision must have autocast(), backward(loss) and step(optimizer, ...); "
                                f"{type(precision).__name__} lacks {', '.join(missing)}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = precision
        self.grad_clip = grad_clip
        self.reduction = reduction
        self.micro_batch_size: int | None = None  # None: whole batches fit so far
        self.oom_count = 0

    def __call__(self, inputs, targets) -> torch.Tensor:
        n = _batch_len(inputs)
        if _batch_len(targets) != n:
            raise ValueError(f"inputs have {n} samples but targets have {_batch_len(targets)}")
        if n == 0:
            raise ValueError("empty batch")
        while True:
            micro = n if self.micro_batch_size is None else min(self.micro_batch_size, n)
            failure = None
            try:
                loss = self._attempt(inputs, targets, n, micro)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                if self._in_step:
                    raise ResilientStepOutOfMemoryError(
                        f"out of memory in the optimizer step (micro-batch size {micro}): micro-batches "
                        "only shrink activations, not the step's parameters, gradients and state. Some "
                        "parameters may already be updated. Original error: " + _first_line(exc)) from None
                failure = _first_line(exc)  # keep text only: the exception holds the tensors
            if failure is None:
                if micro < n:
                    self.micro_batch_size = micro
                return loss
            # Outside the except block: the exception and its traceback are gone, and with them the
            # failed attempt's activations. Now freeing memory can actually free it.
            self.oom_count += 1
            self.optimizer.zero_grad(set_to_none=True)
            free_memory()
            if micro == 1:
                raise ResilientStepOutOfMemoryError(
                    "out of memory even with micro-batches of 1 sample: the model, its gradients and "
                    "optimizer state plus one sample's activations do not fit. Try mixed precision, "
                    "activation checkpointing, a smaller model or a bigger GPU. Last error: " + failure)
            self.micro_batch_size = (micro + 1) // 2

    _in_step = False

    def _attempt(self, inputs, targets, n: int, micro: int) -> torch.Tensor:
        self._in_step = False
        self.optimizer.zero_grad(set_to_none=True)
        precision = self.precision
        total = None
        chunks = zip(_split(inputs, micro), _split(targets, micro)) if micro < n else [(inputs, targets)]
        for x, y in chunks:
            if precision is None:
                loss = _loss_of(self.model, self.loss_fn, x, y)
            else:
                with precision.autocast():
                    loss = _loss_of(self.model, self.loss_fn, x, y)
            if micro < n and self.reduction == "mean":
                loss = loss * (_batch_len(y) / n)  # chunk mean -> its share of the batch mean
            if precision is None:
                loss.backward()
            else:
                precision.backward(loss)
            part = loss.detach()
            total = part if total is None else total + part  # stays on the device: no sync
            del loss
        self._in_step = True
        params = [p for g in self.optimizer.param_groups for p in g["params"]] if self.grad_clip else None
        if precision is None:
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(params, self.grad_clip)
            self.optimizer.step()
        else:
            precision.step(self.optimizer, parameters=params, clip_grad_norm=self.grad_clip)
        self._in_step = False
        return total

    def __repr__(self) -> str:
        return (f"ResilientStep(micro_batch_size={self.micro_batch_size}, oom_count={self.oom_count}, "
                f"precision={self.precision!r})")
