"""The CPU memory a piece of code really uses, counted by PyTorch's own allocator: the independent measurement that
`estimate_training_memory` (and `SimulatedGPU`, which shares its bookkeeping) is checked against on a machine
without a GPU.

    peak = profiled_peak(lambda: train_step(x, y), model, optimizer, x, y)

`torch.profiler.profile(profile_memory=True)` records every allocation and free the CPU allocator makes (c10's
`reportMemoryUsage`, the same events the profiler's memory views are built from), each with its size and time. The
peak is what was alive before `fn` ran (`resident`: the storages of the modules, optimizers and tensors given,
counted once each) plus the largest running total of those events. Nothing here uses the estimator's fake tensors
or `SimulatedGPU`'s ledger, so an error they share cannot cancel out. CPU tensors only: a CUDA run has
`torch.cuda.max_memory_allocated` for the same question.

Two limits, both from what the profiler records. It sees the allocations of the thread that calls `fn` (not those
of threads you start, nor of DataLoader worker processes). And it cannot see a free of memory allocated before
profiling began: if `fn` frees or replaces a resident storage (gradients that `zero_grad(set_to_none=True)` drops,
say), the peak would be counted too high, so `profiled_peak` refuses; clear such tensors before the call.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ..i18n import _
from .sizes import format_bytes

__all__ = ["profiled_peak", "resident_bytes"]


def resident_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages behind `objects` (modules: parameters, gradients and buffers; optimizers: their
    state; tensors, sparse ones included; tuples, lists and dicts of these): what is alive before a step starts."""
    return sum(storage.nbytes() for storage in _storages(objects).values())


def _storages(objects: tuple) -> dict[int, torch.UntypedStorage]:
    """{address: storage} of the distinct storages behind `objects` (see `resident_bytes`)."""
    seen: dict[int, torch.UntypedStorage] = {}

    def add(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)): its indices and values
                add([obj._indices(), obj._values()])
                return
            if obj.layout != torch.strided:
                raise TypeError(_("resident_bytes counts strided and sparse COO tensors, not {layout}").format(
                    layout=obj.layout))
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage
        elif isinstance(obj, nn.Module):
            for t in [*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters() if p.grad is not None)]:
                add(t)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                add(list(state.values()))
        elif isinstance(obj, dict):
            add(list(obj.values()))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                add(item)

    for obj in objects:
        add(obj)
    seen.pop(0, None)  # empty storages have no address
    return seen


def profiled_peak(fn: Callable[[], Any], *resident: Any) -> int:
    """Peak bytes of CPU memory while `fn()` runs: `resident_bytes(*resident)` plus the largest running total of
    the allocations and frees torch.profiler records during `fn()`. ValueError if `fn` freed or replaced one of the
    resident storages (the profiler cannot see that free)."""
    # Held during the call: a resident storage that fn drops stays allocated, so no new tensor can take its
    # address and the drop is seen below (a freed gradient's block is often reused for the next one at once).
    storages = _storages(resident)
    before = sum(storage.nbytes() for storage in storages.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    after = _storages(resident)
    gone = sum(storage.nbytes() for address, storage in storages.items() if address not in after)
    if gone:
        raise ValueError(_("profiled_peak: the call freed or replaced {size} of the memory given as resident "
                           "(gradients dropped by zero_grad(set_to_none=True), say). The profiler cannot see frees "
                           "of memory allocated before it started, so the peak would be counted too high: free "
                           "those tensors before the call (optimizer.zero_grad(set_to_none=True))").format(
            size=format_bytes(gone)))
    events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")),
                    key=lambda event: event[0])  # by time; equal times keep the order they were recorded in
    running = peak = 0
    for _time, nbytes in events:  # a free is a negative size
        running += nbytes
        peak = max(peak, running)
    return before + peak
