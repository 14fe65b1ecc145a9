"""The training step, written once for the whole package.

    step = TrainStep(model, optimizer, loss_fn, precision)   # precision: e.g. MixedPrecision(device, enabled=False)
    loss = step(inputs, targets)                              # one optimizer step; the batch's mean loss, detached
    losses = step.group([(x1, y1), (x2, y2)], chunk_size=16)  # one optimizer step over two batches, in chunks of 16

One step is: zero_grad; for every chunk of every batch of the group, forward + loss under the precision's
autocast, weighted by the chunk's share of the group's samples, and backward; unscale; clip; optimizer step.
Splitting a group into batches (gradient accumulation) or a batch into chunks (out-of-memory recovery) does not
change the update: the weighted chunk losses add up to the mean loss of all the group's samples, so their
gradients add up to its gradient (up to float rounding).

The batch conventions every step shares live here too: `move_batch` (a batch, nested containers kept, to a
device), `as_pair` (a loader's batch as (inputs, targets), through a `batch_fn` for dict batches), `pair_on` (both),
`batch_len`, `split`, `forward` (tuple inputs as positional arguments, dict inputs as keywords), and `check_optimizer_holds`
(an optimizer must update the model's own parameters).

`precision` is any object with `autocast()`, `backward(loss)`, `unscale_(optimizer)` and `step(optimizer)`;
`course_utils.amp.MixedPrecision(...)` builds one (`Float32` with enabled=False: the same calls, doing nothing
extra). There is no "no precision" case. The `Trainer`, `ResilientStep`, `find_max_batch_size`, the AMP helpers
and the speed ladder all run their steps through `TrainStep`.

Importing this module touches no device.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .i18n import _

Batch = tuple[Any, Any]  # (inputs, targets); inputs a tensor or a tuple/list of tensors (several model inputs)


def batch_len(x) -> int:
    """Number of samples in `x`: a tensor's first dimension, or that of the first tensor of a tuple/list/dict."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError(_("a batch must have a batch dimension (got a 0-d tensor)"))
        return x.shape[0]
    values = list(x.values()) if isinstance(x, Mapping) else x
    if isinstance(values, (list, tuple)) and values and all(isinstance(t, torch.Tensor) for t in values):
        return batch_len(values[0])
    raise TypeError(_("a batch must be a tensor or a tuple/list/dict of tensors, got {type}").format(
        type=type(x).__name__))


def split(x, size: int) -> list:
    """`x` (a tensor or a tuple/list/dict of tensors) cut into consecutive chunks of `size` samples (views)."""
    if isinstance(x, torch.Tensor):
        return list(x.split(size))
    if isinstance(x, Mapping):
        parts = {k: split(t, size) for k, t in x.items()}
        return [dict(zip(parts, p)) for p in zip(*parts.values())]
    parts = [split(t, size) for t in x]
    if hasattr(x, "_fields"):  # a namedtuple
        return [type(x)(*p) for p in zip(*parts)]
    return [type(x)(p) for p in zip(*parts)]


def forward(model: nn.Module, inputs):
    """`model(inputs)`; `model(*inputs)` for a tuple/list of tensors (a model with several inputs), and
    `model(**inputs)` for a dict (keyword inputs, as Hugging Face models take them)."""
    if isinstance(inputs, torch.Tensor):  # the usual case first: one cheap test
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, (list, tuple)) else model(inputs)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters `optimizer` updates, group by group: the ones to clip."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def move_batch(batch, device: torch.device, non_blocking: bool = True):
    """Move a batch (a tensor, or a tuple, list, namedtuple or mapping of them, nested) to `device`, keeping
    each container's type. Tensors already there are not copied."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
        try:
            return type(batch)(moved)  # dict, OrderedDict, a Hugging Face BatchEncoding...
        except TypeError:  # a mapping type that cannot be built from a dict (defaultdict needs its factory)
            copy_ = copy.copy(batch)
            copy_.update(moved)
            return copy_
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple: built from positional fields
        return type(batch)(*(move_batch(b, device, non_blocking) for b in batch))
    if isinstance(batch, (list, tuple)):
        moved = [move_batch(b, device, non_blocking) for b in batch]
        for build in (lambda: type(batch)(moved), lambda: type(batch)(*moved)):  # from an iterable, or fields
            try:
                return build()
            except TypeError:
                pass
        return moved if isinstance(batch, list) else tuple(moved)
    return batch


def as_pair(batch, batch_fn=None):
    """(inputs, targets) of one loader batch: `batch_fn(batch)` when given, else the batch itself."""
    if batch_fn is not None:
        batch = batch_fn(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch
    if isinstance(batch, Mapping):
        raise TypeError(_("the loader yields dicts (keys {keys}), and the Trainer needs (inputs, targets): say which "
                          "entries they are with batch_fn, e.g. Trainer(..., batch_fn=lambda b: (b[\"input_ids\"], "
                          "b[\"labels\"])); inputs may be a dict too, passed to the model as keyword arguments").format(
            keys=sorted(map(str, batch))))
    raise TypeError(_("a batch must be (inputs, targets), got a {type}{size}; pass batch_fn=... to turn the "
                      "loader's batches into (inputs, targets)").format(
        type=type(batch).__name__, size=_(" of {n} items").format(n=len(batch)) if isinstance(batch, (tuple, list))
        else ""))


def pair_on(batch, device: torch.device, batch_fn=None):
    """(inputs, targets) of one loader batch on `device`: `move_batch(as_pair(batch, batch_fn), device)`, with
    the usual case (a pair of tensors already there, no batch_fn) answered by one test."""
    if batch_fn is None and type(batch) is tuple and len(batch) == 2:
        x, y = batch
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.device == device and y.device == device:
            return batch
    return move_batch(as_pair(batch, batch_fn), device)


def check_optimizer_holds(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must update the model's own parameters (all of them, or a subset for fine-tuning)."""
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in params if id(p) not in own]
    if foreign:
        raise ValueError(_("the optimizer holds {foreign} of its {total} parameter tensors that are not this model's "
                           "parameters, so training would change nothing the model uses: build the optimizer from "
                           "this model, e.g. torch.optim.SGD(model.parameters(), lr=0.1), after creating the model "
                           "(a subset, for fine-tuning, is fine)").format(foreign=len(foreign), total=len(params)))


def grad_accumulators(params) -> list:
    """The autograd nodes that add each parameter's gradient into its `.grad` (AccumulateGrad). Autograd keeps a
    parameter's node only while something holds it: freed with each step's graph, it is built again (with its
    metadata) by the next forward, a cost per parameter per step that a hand-written loop avoids by accident (its
    `loss` keeps the last graph alive into the next step). Holding them, as DistributedDataParallel does, builds
    them once. Under inference_mode there is no graph: nothing to hold; nor for a lazy module's parameter that has
    no values yet (the next connect, at the Trainer's next call, holds it)."""
    nodes = []
    with torch.enable_grad():
        for p in params:
            if p.requires_grad and not is_lazy(p) and not torch.is_inference(p):
                view = p.view_as(p)
                if view.grad_fn is not None:
                    nodes.append(view.grad_fn.next_functions[0][0])
    return nodes


def raised_in_optimizer_step(error: BaseException) -> bool:
    """Whether `error` was raised in a `TrainStep`'s update (unscale, clip, hook, optimizer step) rather than in
    its forward or backward pass: read from the error's traceback, so the step keeps no flag up to date."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is TrainStep._update.__code__:
            return True
        tb = tb.tb_next
    return False


def _autocast_loss(step: "TrainStep", inputs, targets) -> torch.Tensor:
    """Forward and loss of one chunk under the precision's autocast."""
    with step.precision.autocast():
        return step.loss_fn(forward(step.model, inputs), targets)


def _plain_loss(step: "TrainStep", inputs, targets) -> torch.Tensor:
    """Forward and loss of one chunk, with no autocast to enter (float32)."""
    return step.loss_fn(forward(step.model, inputs), targets)


def _clip_grad_norm(step: "TrainStep") -> None:
    step.grad_norm = nn.utils.clip_grad_norm_(optimizer_params(step.optimizer), step.grad_clip)


class TrainStep:
    """One optimizer step over a group of batches, each optionally cut into chunks.

    `connect(after_backward=..., before_optimizer_step=...)` sets two functions (of no arguments; None: nothing)
    run once per step: after the last backward (gradients complete, still scaled under fp16), and after unscaling
    and clipping, just before `optimizer.step()`. The Trainer connects its callbacks there.
    The update is one path: unscale (a no-op but under float16 scaling), the functions to run before the
    optimizer step (clipping when `grad_clip` is set, then the connected hook: each in the list only if there is
    one, so a plain step runs none), step. `grad_norm` holds the last step's total gradient norm when clipping
    (a device tensor: reading it is a CPU-GPU sync).

    `reduction` says what `loss_fn` returns: "mean" (PyTorch's default) is weighted by chunk size; "sum" is
    added as it is.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, precision,
                 grad_clip: float | None = None, *, reduction: str = "mean"):
        if not isinstance(model, nn.Module):
            raise TypeError(_("model must be an nn.Module, got {kind}").format(kind=type(model).__name__))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(_("optimizer must be a torch.optim.Optimizer, got {kind}").format(
                kind=type(optimizer).__name__))
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(_("grad_clip must be a positive number or None, got {grad_clip!r}").format(
                grad_clip=grad_clip))
        if reduction not in ("mean", "sum"):
            raise ValueError(_("reduction must be 'mean' or 'sum', got {reduction!r}").format(reduction=reduction))
        missing = [m for m in ("autocast", "backward", "unscale_", "step") if not callable(getattr(precision, m, None))]
        if missing:
            raise TypeError(_("precision must have autocast(), backward(loss), unscale_(optimizer) and "
                              "step(optimizer), e.g. course_utils.amp.MixedPrecision; {kind} lacks {missing}").format(
                                  kind=type(precision).__name__, missing=", ".join(missing)))
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = precision  # (a property: its setter chooses how the loss is computed)
        self.reduction = reduction
        self.grad_norm: torch.Tensor | None = None
        self._grad_clip = grad_clip
        self.connect()

    @property
    def precision(self):
        return self._precision

    @precision.setter
    def precision(self, precision) -> None:
        # A precision whose autocast() is a nullcontext (float32) has nothing to enter: its loss skips the `with`.
        # Module functions, not bound methods, so that the step holds no reference to itself (no cycle: a dropped
        # step frees its model and optimizer at once).
        self._precision = precision
        self._forward_loss = _plain_loss if isinstance(precision.autocast(), contextlib.nullcontext) \
            else _autocast_loss

    @property
    def grad_clip(self) -> float | None:
        return self._grad_clip

    @grad_clip.setter
    def grad_clip(self, value: float | None) -> None:
        self._grad_clip = value
        self.connect(*self._hooks)

    def connect(self, after_backward: Callable[[], None] | None = None,
                before_optimizer_step: Callable[[], None] | None = None) -> None:
        """The two per-step hooks (None: nothing). Both are kept as lists, chosen here, not tested every step.
        Also takes hold of the parameters' gradient accumulators (`grad_accumulators`), afresh: the Trainer
        connects at every call."""
        self._hooks = (after_backward, before_optimizer_step)
        self._accumulators = grad_accumulators(optimizer_params(self.optimizer))
        self._after_backward = [after_backward] if after_backward is not None else []
        self._clips = [_clip_grad_norm] if self._grad_clip is not None else []  # called with the step
        self._before_step = [before_optimizer_step] if before_optimizer_step is not None else []

    def __call__(self, inputs, targets) -> torch.Tensor:
        """One step on one batch; returns its mean loss (detached, on the device: no sync)."""
        return self.group([(inputs, targets)])[0]

    def group(self, batches: Sequence[Batch], chunk_size: int | None = None) -> list[torch.Tensor]:
        """One optimizer step over `batches`; returns each batch's mean loss (detached, on the device).

        `chunk_size`: run every batch in chunks of at most that many samples (None: whole batches).
        """
        self.optimizer.zero_grad(set_to_none=True)
        if chunk_size is None and len(batches) == 1:  # the usual step: one whole batch, nothing to weigh
            inputs, targets = batches[0]
            loss = self._forward_loss(self, inputs, targets)
            self._precision.backward(loss)
            losses = [loss.detach()]
        else:
            losses = self._weighted(batches, chunk_size)
        for fn in self._after_backward:
            fn()
        self._update()
        return losses

    def _update(self) -> None:
        """The update, once the gradients are in: unscale (a no-op but under float16 scaling), clip and the hook
        (each only if there is one), then the optimizer step. An error raised in here is the optimizer step's,
        not the forward's (`raised_in_optimizer_step`)."""
        precision, optimizer = self._precision, self.optimizer
        precision.unscale_(optimizer)  # fp16: gradients back in true units; otherwise nothing
        for clip in self._clips:  # clipping, then the hook (a plain step: neither)
            clip(self)
        for fn in self._before_step:
            fn()
        precision.step(optimizer)

    def _weighted(self, batches: Sequence[Batch], chunk_size: int | None) -> list[torch.Tensor]:
        """Backward of every chunk of every batch, each weighted by its share of all the samples."""
        sizes = [batch_len(y) for _x, y in batches]
        total = sum(sizes)
        if total == 0:
            raise ValueError(_("empty batch"))
        chunks = []  # (batch index, inputs, targets, samples) for every chunk of every batch
        for b, ((inputs, targets), n) in enumerate(zip(batches, sizes)):
            if chunk_size is None or chunk_size >= n:
                chunks.append((b, inputs, targets, n))
            else:
                chunks += [(b, x, y, batch_len(y)) for x, y in zip(split(inputs, chunk_size), split(targets, chunk_size))]
        # DistributedDataParallel all-reduces gradients in backward: only in the last one of the step
        no_sync = getattr(self.model, "no_sync", None)
        losses: list = [None] * len(batches)
        for i, (b, x, y, m) in enumerate(chunks):
            quiet = no_sync() if no_sync is not None and i < len(chunks) - 1 else contextlib.nullcontext()
            with quiet:
                loss = self._forward_loss(self, x, y)
                self.precision.backward(loss * (m / total if self.reduction == "mean" else 1.0))  # share of the group
            part = loss.detach()
            if m != sizes[b] and self.reduction == "mean":
                part = part * (m / sizes[b])  # chunk mean -> its share of the batch mean
            losses[b] = part if losses[b] is None else losses[b] + part  # stays on the device: no sync
        return losses

    def state_dict(self) -> dict:
        """Nothing to save: a TrainStep keeps no state between steps (`ResilientStep` keeps its chunk size)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self) -> str:
        return f"TrainStep(precision={self.precision!r}, grad_clip={self.grad_clip})"
