"""`find_max_batch_size`: doubling then binary search with real training steps."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from ..i18n import _, pad
from .limit import limit_gpu_memory
from .oom import free_memory, is_oom_error
from ..amp import MixedPrecision
from ..step import TrainStep
from .simulated import SimulatedGPU, active_simulated_gpu, optimizer_params
from .sizes import BytesLike, format_bytes


# --- finding the largest batch that fits -------------------------------------------------------

class Trial(NamedTuple):
    """One trial of `find_max_batch_size`: batch size, whether it fit, peak bytes (None if unknown), and for a
    trial that ran out, the allocation that did not fit (None if unknown): the peak of such a trial is what was
    allocated before it, so it is below the budget."""
    size: int
    ok: bool
    peak_bytes: int | None
    refused_bytes: int | None = None


@dataclass
class BatchSizeSearch:
    """Result of `find_max_batch_size`."""
    batch_size: int              # the recommendation: largest_ok reduced by the safety margin
    largest_ok: int
    smallest_failed: int | None  # None when max_size itself fit
    safety_margin: float
    trials: list[Trial] = field(default_factory=list)

    def __str__(self) -> str:
        more = _(", smallest that failed: {size}").format(size=self.smallest_failed) if self.smallest_failed else ""
        if self.safety_margin:
            more += _(", safety margin {margin:.0%}").format(margin=self.safety_margin)
        lines = [_("batch size {size} (largest that fit: {largest}{more})").format(
            size=self.batch_size, largest=self.largest_ok, more=more)]
        for t in self.trials:
            peak = format_bytes(t.peak_bytes) if t.peak_bytes is not None else "?"
            line = _("  {size:>7}  {verdict} peak {peak}").format(
                size=t.size, verdict=pad(_("fits") if t.ok else "OOM", 5), peak=peak)
            if t.refused_bytes is not None:
                line += _(", then {refused} more did not fit").format(refused=format_bytes(t.refused_bytes))
            lines.append(line)
        return "\n".join(lines)


def _batch_maker(source, device: torch.device) -> Callable[[int], tuple]:
    """size -> (inputs, targets) on `device`, from a callable or a dataset (samples reused cyclically
    when size exceeds the dataset)."""
    if callable(source) and not hasattr(source, "__getitem__"):
        def make(n: int):
            batch = source(n)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError(_("make_batch(n) must return (inputs, targets)"))
            return tuple(b.to(device) if isinstance(b, torch.Tensor) else b for b in batch)
        return make
    if hasattr(source, "images") and hasattr(source, "labels"):
        images, labels = source.images, source.labels
        def make(n: int):
            idx = torch.arange(n) % len(labels)
            return images[idx].to(device), labels[idx].to(device)
        return make
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        if len(source) == 0:
            raise ValueError(_("the dataset is empty"))
        def make(n: int):
            items = [source[i % len(source)] for i in range(n)]
            xs, ys = zip(*items)
            y = torch.stack(ys) if isinstance(ys[0], torch.Tensor) else torch.tensor(ys)
            return torch.stack(xs).to(device), y.to(device)
        return make
    raise TypeError(_("make_batch_or_dataset must be a callable size -> (inputs, targets), or a dataset "
                      "(with .images/.labels, or indexable with len()); got {kind}").format(
                          kind=type(source).__name__))


class _Snapshot:
    """Host copies of a model's parameters and buffers, their gradients, and an optimizer's state
    and hyperparameters. `restore()` writes them back in place where the tensor still exists (same
    objects, same storages) and re-creates the rest on their original devices."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors = [(t, _host_copy(t)) for t in list(model.parameters()) + list(model.buffers())]
        params = list(dict.fromkeys(list(model.parameters()) + list(optimizer_params(optimizer))))
        self.grads = [(p, None if p.grad is None else _host_copy(p.grad)) for p in params]
        self.state = {p: {k: _SavedTensor(_host_copy(v), v.device) if isinstance(v, torch.Tensor) else _deepcopy(v)
                          for k, v in s.items()}
                      for p, s in optimizer.state.items()}
        self.groups = [{k: _deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    @torch.no_grad()
    def restore(self) -> None:  # host-to-device copies when on a GPU
        for t, saved in self.tensors:
            t.copy_(saved)
        for p, saved in self.grads:
            if saved is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == saved.shape and p.grad.dtype == saved.dtype:
                p.grad.copy_(saved)
            else:
                p.grad = saved.to(p.device, copy=True)
        opt_state = self.optimizer.state
        for p in list(opt_state):
            if p not in self.state:
                del opt_state[p]
        for p, saved in self.state.items():
            current = opt_state.setdefault(p, {})
            for k in list(current):
                if k not in saved:
                    del current[k]
            for k, v in saved.items():
                cur = current.get(k)
                if isinstance(v, _SavedTensor):
                    value, device = v
                    if isinstance(cur, torch.Tensor) and cur.shape == value.shape and cur.dtype == value.dtype \
                            and cur.device == device:
                        cur.copy_(value)
                    else:
                        current[k] = value.to(device, copy=True)
                else:
                    current[k] = _deepcopy(v)
        for g, saved in zip(self.optimizer.param_groups, self.groups):
            g.update(_deepcopy(saved))


class _SavedTensor(NamedTuple):
    value: torch.Tensor  # on the host
    device: torch.device  # where it lived


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)  # from a GPU: CPU-GPU sync point here


def _deepcopy(v):
    import copy
    return copy.deepcopy(v)


def find_max_batch_size(make_batch_or_dataset, model: nn.Module, optimizer: torch.optim.Optimizer,
                        loss_fn: Callable, *, start: int = 1, max_size: int = 4096,
                        safety_margin: float = 0.0, budget: BytesLike | None = None,
                        device: str | torch.device | None = None, precision: Any = None,
                        steps_per_trial: int = 2) -> BatchSizeSearch:
    """The largest batch size whose training step fits in memory, found by trying.

    Doubles from `start` until a size fails (or `max_size` fits), then binary-searches between the
    last size that fit and the first that failed. Each trial runs `steps_per_trial` real training
    steps (zero_grad, forward, backward, optimizer step; the second one runs with the optimizer
    state that the first created), catches out-of-memory errors with `is_oom_error`, and frees memory
    outside the `except` block. Any other error propagates.

    Trials run inside whatever memory context the caller set: a `SimulatedGPU` on the CPU (peaks are
    its numbers), or a CUDA device (peaks from torch.cuda.max_memory_allocated, whose peak counter
    this resets). `budget` wraps the search in `SimulatedGPU(budget)` on CPU or `limit_gpu_memory`
    on CUDA for you. Afterwards the model's parameters and buffers, their gradients, the optimizer's
    state and hyperparameters and the CPU/CUDA random number generators are restored exactly.

    `make_batch_or_dataset` is a callable size -> (inputs, targets), or a dataset. The result's
    `batch_size` is the largest size that fit reduced by `safety_margin` (0.1 = 10% headroom).
    """
    if not isinstance(start, int) or start < 1:
        raise ValueError(_("start must be a positive int, got {start!r}").format(start=start))
    if not isinstance(max_size, int) or max_size < start:
        raise ValueError(_("max_size must be an int >= start ({start}), got {max_size!r}").format(
            start=start, max_size=max_size))
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(_("safety_margin must be in [0, 1), got {safety_margin!r}").format(
            safety_margin=safety_margin))
    if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(_("steps_per_trial must be a positive int, got {steps_per_trial!r}").format(
            steps_per_trial=steps_per_trial))
    first = next(iter(model.parameters()), None)
    if device is not None:
        dev = torch.device(device)
    else:
        dev = first.device if first is not None else torch.device("cpu")
    make = _batch_maker(make_batch_or_dataset, dev)

    if budget is None:
        ctx = nullcontext()
    elif dev.type == "cuda":
        ctx = limit_gpu_memory(budget, dev)
    else:
        ctx = SimulatedGPU(budget, model=model, optimizer=optimizer)
    with ctx:
        sim = active_simulated_gpu()
        with sim.paused() if sim is not None else nullcontext():
            snapshot = _Snapshot(model, optimizer)  # host copies: they would not live on the GPU
        rng_devices = []
        if dev.type == "cuda":
            rng_devices = [dev.index if dev.index is not None else torch.cuda.current_device()]
        try:
            with torch.random.fork_rng(devices=rng_devices):
                step = TrainStep(model, optimizer, loss_fn,
                                 precision if precision is not None else MixedPrecision(dev, enabled=False))
                trials = _search(step, make, start, max_size, steps_per_trial, sim, dev)
        finally:
            optimizer.zero_grad(set_to_none=True)
            snapshot.restore()
    ok = [t.size for t in trials if t.ok]
    failed = [t.size for t in trials if not t.ok]
    if not ok:
        raise RuntimeError(_("even a batch of 1 sample does not fit in memory: the model, its gradients and "
                             "optimizer state plus one sample's activations are too big for this budget"))
    largest = max(ok)
    bigger_failed = [s for s in failed if s > largest]
    chosen = max(1, int(largest * (1.0 - safety_margin)))
    return BatchSizeSearch(chosen, largest, min(bigger_failed) if bigger_failed else None, safety_margin, trials)


def _search(step: TrainStep, make, start, max_size, steps, sim, dev) -> list[Trial]:
    trials: list[Trial] = []

    def attempt(n: int) -> bool:
        trials.append(_trial(step, make, n, steps, sim, dev))
        return trials[-1].ok

    lo, hi = 0, None  # largest size that fit, smallest that failed
    n = start
    while True:
        if attempt(n):
            lo = n
            if n >= max_size:
                break
            n = min(2 * n, max_size)
        else:
            hi = n
            break
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return trials


def _trial(step: TrainStep, make, n, steps, sim, dev) -> Trial:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    failed, refused = False, None
    with sim.measure_peak() if sim is not None else nullcontext() as reading:
        try:
            inputs, targets = make(n)
            for _i in range(steps):
                step(inputs, targets)
            del inputs, targets
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failed = True
            refused = getattr(exc, "requested", None)  # a SimulatedGPU's error says what did not fit (an int)
    # outside the except block: the failed trial's tensors are unreachable now
    step.optimizer.zero_grad(set_to_none=True)
    reset = getattr(step.precision, "reset", None)
    if callable(reset):
        reset(step.optimizer)
    if failed:
        free_memory()
    peak = reading.bytes if sim is not None else torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return Trial(n, not failed, peak, refused)
