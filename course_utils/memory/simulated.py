"""`SimulatedGPU`: a GPU-sized memory budget on the CPU, counted from live tensor storages.

The counting machinery is public for the other modules of `course_utils.memory` (the estimator runs
it on fake tensors): `StorageLedger` (live storages and their bytes), `AllocationTracker` (the
dispatch mode that feeds a ledger) and `optimizer_params(optimizer)`.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..i18n import N_, _, pad
from ..step import optimizer_params
from .sizes import CUDA_BLOCK_BYTES, BytesLike, _round_up, format_bytes, parse_bytes

__all__ = [
    "AllocationTracker", "MemoryBreakdown", "PeakReading", "SimulatedGPU", "SimulatedOutOfMemoryError",
    "StorageLedger", "active_simulated_gpu", "optimizer_params",
]

# --- the storage ledger: live storages and their bytes -------------------------------------

class StorageLedger:
    """Live storages (by StorageImpl address) -> counted bytes, with current and peak totals.

    `allocated` is the counted total now, `peak` the highest total since `reset_peak()`. Each storage
    counts `count(nbytes)`: its size rounded up to `block` bytes. A weak reference per storage, with a
    callback, removes it when the storage dies: PyTorch keeps a storage's Python object alive exactly
    as long as the C++ storage, so this sees every free.
    """

    def __init__(self, block: int):
        self.block = block
        self.live: dict[int, list] = {}  # key -> [counted bytes, weakref to the storage]
        self.allocated = 0
        self.peak = 0

    def count(self, nbytes: int) -> int:
        """Bytes charged for a storage of `nbytes`: rounded up to the block size."""
        return _round_up(nbytes, self.block)

    def track(self, st: torch.UntypedStorage) -> int:
        """Count `st` if it is not counted yet and not empty; return the bytes added (0 if none)."""
        n = st.nbytes()
        if n == 0 or st._cdata in self.live:
            return 0
        counted = self.count(n)
        self.add(st, st._cdata, counted)
        return counted

    def reset_peak(self) -> None:
        """Start a new peak from the current total."""
        self.peak = self.allocated

    def add(self, st: torch.UntypedStorage, key: int, counted: int) -> None:
        self.live[key] = [counted, weakref.ref(st, partial(self._release, key))]
        self.allocated += counted

    def resize(self, key: int, counted: int) -> None:
        entry = self.live[key]
        self.allocated += counted - entry[0]
        entry[0] = counted

    def _release(self, key: int, ref: weakref.ref) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[1] is ref:
            del self.live[key]
            self.allocated -= entry[0]

    def note_peak(self) -> bool:
        if self.allocated > self.peak:
            self.peak = self.allocated
            return True
        return False


def _storage(t: Any) -> torch.UntypedStorage | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, ... have no single storage
        return None


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            if isinstance(o, torch.Tensor):
                yield o


# Per operator: which returns alias an input, and which arguments it writes to (schema annotations).
_OP_INFO: dict[Any, tuple[tuple[bool, ...], tuple[tuple[int, str, bool], ...]]] = {}


def _op_info(func) -> tuple[tuple[bool, ...], tuple[tuple[int, str, bool], ...]]:
    info = _OP_INFO.get(func)
    if info is None:
        schema = func._schema
        aliased = tuple(r.alias_info is not None for r in schema.returns)
        written = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                        if a.alias_info is not None and a.alias_info.is_write)
        info = _OP_INFO[func] = (aliased, written)
    return info


class AllocationTracker(TorchDispatchMode):
    """While entered, counts in `ledger` the storages that operators create or grow, and asks
    `check(grown, before)` after each op that grew the total (it may raise to refuse the allocation);
    `on_peak()` is called when the total reaches a new peak. Storages on the meta device (fake
    tensors) are counted only with `count_meta=True`; `precheck_resize(grown, before)` runs before a
    `resize_` that would grow a storage. Setting `paused` stops counting new storages.

    - a new output storage is counted once; views share their base's storage and add nothing;
    - in-place and `out=` ops (schema arguments marked as written) are checked for growth, which
      covers `resize_` and `out=` tensors that had to be enlarged;
    - an output that shares an input's storage without saying so (e.g. `_unsafe_view`) is not new.
    """

    def __init__(self, ledger: StorageLedger, check: Callable[[int, int], None] | None = None,
                 count_meta: bool = False, on_peak: Callable[[], None] | None = None,
                 precheck_resize: Callable[[int, int], None] | None = None):
        super().__init__()
        self.ledger = ledger
        self.check = check
        self.count_meta = count_meta
        self.on_peak = on_peak
        self.precheck_resize = precheck_resize
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.paused:
            return func(*args, **kwargs)
        ledger = self.ledger
        before = ledger.allocated
        aliased, written = _op_info(func)
        snapshot = None
        if written:
            snapshot = []
            for i, name, kwarg_only in written:
                value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
                for t in _tensors(value):
                    st = _storage(t)
                    if st is not None:
                        snapshot.append((st, st._cdata, st.nbytes()))
            if func is _RESIZE and self.precheck_resize is not None and snapshot:
                self._precheck_resize(args, snapshot[0])

        out = func(*args, **kwargs)

        if snapshot:
            for st, key, old in snapshot:
                n = st.nbytes()
                if n != old:
                    if key in ledger.live:
                        ledger.resize(key, ledger.count(n))
                    elif n > old and (self.count_meta or st.device.type != "meta"):
                        ledger.add(st, key, ledger.count(n))  # an outside tensor reallocated in here
            snapshot = None
        if len(aliased) == 1:
            if not aliased[0]:
                self._track_new(out, args, kwargs)
            elif func is _LIFT_FRESH:  # torch.tensor(data): made outside the dispatcher, new all the same
                self._track_new(out, (), {})
        elif aliased:
            for i, a in enumerate(aliased):
                if not a:
                    self._track_new(out[i], args, kwargs)

        grown = ledger.allocated - before
        if grown > 0:
            if self.check is not None:
                try:
                    self.check(grown, before)
                except BaseException:
                    # Drop the outputs that did not fit: this frame travels up with the traceback.
                    del out
                    raise
            if ledger.note_peak() and self.on_peak is not None:
                self.on_peak()
        return out

    def _track_new(self, obj, args, kwargs) -> None:
        ledger = self.ledger
        inputs = None
        for t in _tensors(obj):
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if key in ledger.live:
                continue
            n = st.nbytes()
            if n == 0 or (not self.count_meta and st.device.type == "meta"):
                continue
            if inputs is None:
                inputs = _input_keys(args, kwargs)
            if key in inputs:
                continue
            ledger.add(st, key, ledger.count(n))

    def _precheck_resize(self, args, snap) -> None:
        st, key, old = snap
        t, size = args[0], args[1]
        needed = (t.storage_offset() + math.prod(int(s) for s in size)) * t.element_size()
        if needed > old:
            counted = self.ledger.count(needed)
            grown = counted - (self.ledger.live[key][0] if key in self.ledger.live else 0)
            self.precheck_resize(grown, self.ledger.allocated)


_RESIZE = torch.ops.aten.resize_.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def _input_keys(args, kwargs) -> set[int]:
    keys = set()
    for group in (args, kwargs.values()):
        for a in group:
            for t in _tensors(a):
                st = _storage(t)
                if st is not None:
                    keys.add(st._cdata)
    return keys


# --- what is what: parameters, gradients, optimizer state ----------------------------------

@dataclass
class MemoryBreakdown:
    """Bytes of live storages by role. `activations` is everything else: activations saved for
    backward, temporaries, batches. Tensors shared between roles count once, in the first role."""
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def __str__(self) -> str:
        rows = [(_("parameters (and buffers)"), self.parameters), (_("gradients"), self.gradients),
                (_("optimizer state"), self.optimizer_state),
                (_("activations and temporaries"), self.activations), (_("total"), self.total)]
        return "\n".join(f"{pad(name, 28)}{pad(format_bytes(n), 12, '>')}" for name, n in rows)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    todo = list(optimizer.state.values())
    while todo:
        v = todo.pop()
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)




def _role_tensors(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]):
    """(parameters and buffers, gradients, optimizer state) of the given modules and optimizers."""
    params: list[torch.Tensor] = []
    for m in modules:
        params.extend(m.parameters())
        params.extend(m.buffers())
    optimizers = list(optimizers)
    for opt in optimizers:
        params.extend(optimizer_params(opt))
    grads = [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]
    state = [t for opt in optimizers for t in _state_tensors(opt)]
    return params, grads, state


# --- the simulated GPU -------------------------------------------------------------------

# The remark after the CUDA-worded message, in the current language (in Chinese too: read the CUDA part alone from
# the error's `cuda_message`, not by looking for this remark's English words).
SIMULATED_REMARK = N_("(Simulated by course_utils.memory.SimulatedGPU on the CPU: no real GPU was involved.)")


def _cuda_oom_message(grown: int, before: int, budget: int) -> str:
    """The out-of-memory message, worded as CUDA's caching allocator words it (c10/cuda/CUDACachingAllocator.cpp),
    so code and people that read CUDA's message read this one; a simulated GPU has no other processes and no cache.
    It stays in English in every language (it is PyTorch's text, and notebooks parse it). (Built here, apart from
    the `raise`, so that a traceback's last frame shows the raise and nothing else.)"""
    size = partial(format_bytes, english=True)
    return (f"CUDA out of memory. Tried to allocate {size(grown)}. GPU 0 has a total capacity of "
            f"{size(budget)} of which {size(max(budget - before, 0))} is free. "
            f"Of the allocated memory {size(before)} is allocated by PyTorch, and 0 bytes is reserved by "
            "PyTorch but unallocated.")


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """A `torch.OutOfMemoryError` raised by `SimulatedGPU`: caught by `except torch.OutOfMemoryError`
    (and `torch.cuda.OutOfMemoryError`, the same class), and its message starts like CUDA's. `cuda_message` is
    that CUDA-worded part alone (English in every language); the message adds `SIMULATED_REMARK`, translated."""

    def __init__(self, cuda_message: str, requested: int = 0, allocated: int = 0, budget: int = 0):
        super().__init__(cuda_message + " " + _(SIMULATED_REMARK))
        self.cuda_message = cuda_message
        self.requested = requested
        self.allocated = allocated
        self.budget = budget


@dataclass
class PeakReading:
    """Filled in by `SimulatedGPU.measure_peak()` when its block ends: `bytes` is the highest
    `memory_allocated()` inside the block (what was allocated when it began included); None until then."""
    bytes: int | None = None


_ACTIVE: list["SimulatedGPU"] = []  # entered SimulatedGPUs, innermost last


def active_simulated_gpu() -> "SimulatedGPU | None":
    """The innermost `SimulatedGPU` currently entered, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class SimulatedGPU:
    """A GPU-sized memory budget for code running on the CPU.

        model, opt = SimpleCNN(), torch.optim.Adam(model.parameters())
        with SimulatedGPU("64MiB", model=model, optimizer=opt) as gpu:
            loss = loss_fn(model(x), y); loss.backward(); opt.step()
            print(gpu.breakdown(), format_bytes(gpu.max_memory_allocated()))

    Counted: storages of tensors created inside the context (activations, autograd's saved tensors,
    gradients, lazily created optimizer state, temporaries, batches built inside), and the model and
    optimizer given (or `track()`ed) when it starts. Views add nothing; in-place ops add nothing
    unless they grow a storage (`resize_`, `out=`). Each storage counts once, rounded up to
    `block_bytes` as CUDA's caching allocator does, until it is freed. Tensors made outside and not
    tracked are not counted (`x.to("cpu")` on a CPU tensor is the same tensor: `track(x)` it).

    When an operator's new storages would take the total past the budget, they are dropped and a
    `SimulatedOutOfMemoryError` (a `torch.OutOfMemoryError`) is raised, worded as current CUDA PyTorch words
    it ("CUDA out of memory. Tried to allocate ... GPU 0 has a total capacity of ... of which ... is free. Of
    the allocated memory ... is allocated by PyTorch, ...") and saying it was simulated. (The check runs right after the
    operator, so the CPU did hold the memory for a moment; `resize_` is checked before it runs.)
    Not counted, unlike on a real GPU: the CUDA context, cuBLAS/cuDNN workspaces, kernels' internal
    scratch buffers, fragmentation in the caching allocator. Only operators run on this thread are
    seen; frees are seen from any thread.

    Costs one Python call per operator while active (see benchmarks/bench_memory.py).
    """

    def __init__(self, budget: BytesLike, *, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, block_bytes: int = CUDA_BLOCK_BYTES):
        self.budget = parse_bytes(budget)
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(_("block_bytes must be a positive int, got {block_bytes!r}").format(
                block_bytes=block_bytes))
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(_("model must be an nn.Module, got {kind}").format(kind=type(model).__name__))
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(_("optimizer must be a torch.optim.Optimizer, got {kind}").format(
                kind=type(optimizer).__name__))
        self._ledger = StorageLedger(block_bytes)
        self._modules: list[nn.Module] = [model] if model is not None else []
        self._optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
        self._mode: AllocationTracker | None = None
        self.oom_count = 0

    # context
    def __enter__(self) -> "SimulatedGPU":
        if self._mode is not None:
            raise RuntimeError(_("this SimulatedGPU is already active; nest a new SimulatedGPU instead"))
        self._track_objects(self._modules + self._optimizers, remember=False)
        self._mode = AllocationTracker(self._ledger, check=self._check, precheck_resize=self._check)
        self._mode.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if mode is not None:
            mode.__exit__(*exc)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Allocations inside are not counted (e.g. backups that would live in host memory on a real
        GPU). Frees of counted storages still are."""
        mode = self._mode
        if mode is None:
            yield
            return
        old, mode.paused = mode.paused, True
        try:
            yield
        finally:
            mode.paused = old

    # statistics, named like torch.cuda's
    def memory_allocated(self) -> int:
        """Bytes of live counted storages now."""
        return self._ledger.allocated

    def max_memory_allocated(self) -> int:
        """Highest `memory_allocated()` since the start or the last `reset_peak_memory_stats()`."""
        return max(self._ledger.peak, self._ledger.allocated)

    def reset_peak_memory_stats(self) -> None:
        """Start `max_memory_allocated()` again from `memory_allocated()`."""
        self._ledger.reset_peak()

    @contextmanager
    def measure_peak(self) -> Iterator[PeakReading]:
        """Peak allocated bytes inside the block (reading.bytes, set when the block exits, also on error);
        afterwards the GPU's own max_memory_allocated() is max(its peak before the block, the block's peak).

            with gpu.measure_peak() as reading:
                train_step()
            print(format_bytes(reading.bytes))

        Unlike `reset_peak_memory_stats()`, it leaves the GPU's peak as if nothing had been reset, so
        blocks can be measured (and nested) without losing the overall peak.
        """
        ledger = self._ledger
        before = self.max_memory_allocated()
        ledger.reset_peak()
        reading = PeakReading()
        try:
            yield reading
        finally:
            reading.bytes = max(ledger.peak, ledger.allocated)
            ledger.peak = max(before, reading.bytes)

    def breakdown(self) -> MemoryBreakdown:
        """Live bytes by role, classified now: parameters and buffers of the known models and
        optimizers, `.grad` of those parameters, tensors in `optimizer.state`, everything else."""
        params, grads, state = _role_tensors(self._modules, self._optimizers)
        roles: dict[int, int] = {}
        for role, tensors in ((2, state), (1, grads), (0, params)):  # later roles win: params first
            for t in tensors:
                st = _storage(t)
                if st is not None:
                    roles[st._cdata] = role
        sums = [0, 0, 0, 0]
        for key, entry in list(self._ledger.live.items()):
            sums[roles.get(key, 3)] += entry[0]
        return MemoryBreakdown(*sums)

    def track(self, *objs: Any) -> Any:
        """Count tensors, modules (parameters and buffers) or optimizers (parameters, gradients,
        state) that were created outside, as if moved onto this GPU. Modules and optimizers are
        also used to classify `breakdown()`. Returns its argument(s). Raises the simulated OOM if
        they do not fit."""
        self._track_objects(objs, remember=True)
        return objs[0] if len(objs) == 1 else objs

    def _track_objects(self, objs: Iterable[Any], remember: bool) -> None:
        tensors: list[torch.Tensor] = []
        for obj in objs:
            if isinstance(obj, nn.Module):
                tensors.extend(obj.parameters())
                tensors.extend(obj.buffers())
                tensors.extend(p.grad for p in obj.parameters() if p.grad is not None)
                if remember and obj not in self._modules:
                    self._modules.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                params, grads, state = _role_tensors((), (obj,))
                tensors.extend(params + grads + state)
                if remember and obj not in self._optimizers:
                    self._optimizers.append(obj)
            elif isinstance(obj, torch.Tensor):
                tensors.append(obj)
            else:
                raise TypeError(_("track() takes tensors, modules and optimizers, got {kind}").format(
                    kind=type(obj).__name__))
        ledger = self._ledger
        new: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for t in tensors:
            st = _storage(t)
            if st is None or st._cdata in ledger.live or st.device.type == "meta" or st.nbytes() == 0:
                continue
            new[st._cdata] = (st, ledger.count(st.nbytes()))
        grown = sum(n for _st, n in new.values())
        if ledger.allocated + grown > self.budget:
            self._check(grown, ledger.allocated)
        for key, (st, n) in new.items():
            ledger.add(st, key, n)
        ledger.note_peak()

    def _check(self, grown: int, before: int) -> None:
        if before + grown <= self.budget:
            return
        self.oom_count += 1
        raise SimulatedOutOfMemoryError(_cuda_oom_message(grown, before, self.budget), requested=grown,
                                        allocated=before, budget=self.budget)

    def __repr__(self) -> str:
        template = (_("SimulatedGPU({budget}, active: {allocated} allocated, peak {peak})") if self._mode is not None
                    else _("SimulatedGPU({budget}, inactive: {allocated} allocated, peak {peak})"))
        return template.format(budget=format_bytes(self.budget), allocated=format_bytes(self.memory_allocated()),
                               peak=format_bytes(self.max_memory_allocated()))
