"""GPU memory: see it, predict it, survive running out of it.

- `SimulatedGPU(budget)`: a context manager that gives the CPU a GPU-sized memory budget. It counts
  the bytes of live tensor storages created inside it (plus a model and optimizer it is told about)
  and raises a `torch.OutOfMemoryError` shaped like CUDA's when an allocation would not fit, so
  out-of-memory handling written for real GPUs can be run and tested on a laptop.
- `limit_gpu_memory(budget)`: the same demonstration on a real (big) CUDA GPU.
- `is_oom_error(exc)`, `free_memory()`: recognise out-of-memory errors from every backend; release
  cached memory afterwards.
- `estimate_training_memory(...)`: parameters, gradients, optimizer state and activations of one
  training step, computed on fake tensors (no real activation memory is allocated).
- `find_max_batch_size(...)`: doubling then binary search with real training steps.
- `ResilientStep`: a training step that, on OOM, splits the batch into micro-batches with gradient
  accumulation and retries the same step (same update, no data skipped).
- `checkpointed(module)`, `checkpoint_sequential_blocks(...)`: activation checkpointing, always with
  `use_reentrant=False`.

Importing this module touches no device and starts nothing.
"""
from __future__ import annotations

import gc
import math
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

BytesLike = Union[int, float, str]

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every allocation up to a multiple of this


# --- sizes ---------------------------------------------------------------------------------

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: BytesLike) -> int:
    """Bytes from an int (or integral float) or a string such as "64MiB", "1.5 GiB", "500MB".

    Binary units (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; decimal units
    (KB, MB, GB, TB) are powers of 1000. Raises ValueError for anything that is not a positive size.
    """
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be a number of bytes or a string like '64MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"a memory size in bytes must be a whole number, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size; write e.g. 512, '64MiB', '1.5GiB' or '500MB'")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"a memory size must be a number of bytes or a string like '64MiB', "
                         f"got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    """CUDA's style: '512 bytes', '1.50 KiB', '20.00 MiB', '2.00 GiB'."""
    if abs(n) < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.2f} {unit}"
    return f"{n / 1024:.2f} TiB"


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block if block > 1 else n


# --- recognising and recovering from OOM -------------------------------------------------

# Substrings of the messages PyTorch and the vendor libraries use when an allocation fails.
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",                        # CUDA caching allocator (torch.OutOfMemoryError)
    "HIP out of memory",                         # the same allocator on ROCm
    "XPU out of memory",                         # Intel GPUs
    "MPS backend out of memory",                 # Apple GPUs
    "DefaultCPUAllocator: can't allocate memory",  # host RAM (a plain RuntimeError)
    "CUDA error: out of memory",                 # cudaErrorMemoryAllocation outside the allocator
    "HIP error: out of memory",
    "hipErrorOutOfMemory",
    "CUBLAS_STATUS_ALLOC_FAILED",                # cuBLAS could not get its workspace
    "CUDNN_STATUS_ALLOC_FAILED",                 # cuDNN 8
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",  # cuDNN 9
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",    # cuDNN 9
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
)


def is_oom_error(exc: BaseException | None) -> bool:
    """True when `exc`, or any exception it was raised from or during, is an out-of-memory error.

    By type first (`torch.OutOfMemoryError`, which CUDA/HIP/XPU/MPS allocators raise, and Python's
    `MemoryError`), then by the messages in `OOM_MESSAGES` (host RAM, cuBLAS and cuDNN report
    allocation failures as plain RuntimeErrors). Follows `__cause__`, `__context__` and exception
    groups, guarding against cycles.
    """
    if exc is None:
        return False
    if not isinstance(exc, BaseException):
        raise TypeError(f"is_oom_error expects an exception, got {type(exc).__name__}")
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
            return True
        try:
            text = str(e)
        except Exception:  # a broken __str__ must not hide the chain
            text = ""
        if any(m in text for m in OOM_MESSAGES):
            return True
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        todo.extend(getattr(e, "exceptions", ()) or ())  # ExceptionGroup members
    return False


@dataclass
class FreeMemoryReport:
    """What `free_memory()` did: objects the garbage collector found, caches emptied."""
    collected: int
    emptied: tuple[str, ...]


def free_memory() -> FreeMemoryReport:
    """Collect garbage, then return cached accelerator memory to the driver.

    Call it after leaving the `except` block: while the exception is alive its traceback keeps the
    failed step's frames, and so its tensors, alive. CUDA's cache is emptied only if CUDA is already
    initialised in this process (a CPU run never starts it); MPS and XPU likewise.
    """
    collected = gc.collect()
    emptied = []
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # cudaFree inside: waits for the GPU (a sync point; fine after an OOM)
        emptied.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        torch.mps.empty_cache()
        emptied.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and hasattr(xpu, "is_initialized") and xpu.is_initialized():
        xpu.empty_cache()
        emptied.append("xpu")
    return FreeMemoryReport(collected, tuple(emptied))


# --- the storage ledger: live storages and their bytes -------------------------------------

class _Ledger:
    """Live storages (by StorageImpl address) -> counted bytes, with current and peak totals.

    A weak reference per storage, with a callback, removes it when the storage dies: PyTorch keeps
    a storage's Python object alive exactly as long as the C++ storage, so this sees every free.
    """

    def __init__(self, block: int):
        self.block = block
        self.live: dict[int, list] = {}  # key -> [counted bytes, weakref to the storage]
        self.allocated = 0
        self.peak = 0

    def count(self, nbytes: int) -> int:
        return _round_up(nbytes, self.block)

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


class _TrackingMode(TorchDispatchMode):
    """Counts storages that operators create or grow; asks `check(grown, before)` after each op.

    - a new output storage is counted once; views share their base's storage and add nothing;
    - in-place and `out=` ops (schema arguments marked as written) are checked for growth, which
      covers `resize_` and `out=` tensors that had to be enlarged;
    - an output that shares an input's storage without saying so (e.g. `_unsafe_view`) is not new.
    """

    def __init__(self, ledger: _Ledger, check: Callable[[int, int], None] | None = None,
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
        rows = [("parameters (and buffers)", self.parameters), ("gradients", self.gradients),
                ("optimizer state", self.optimizer_state),
                ("activations and temporaries", self.activations), ("total", self.total)]
        return "\n".join(f"{name:<28}{format_bytes(n):>12}" for name, n in rows)


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


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _role_tensors(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]):
    """(parameters and buffers, gradients, optimizer state) of the given modules and optimizers."""
    params: list[torch.Tensor] = []
    for m in modules:
        params.extend(m.parameters())
        params.extend(m.buffers())
    optimizers = list(optimizers)
    for opt in optimizers:
        params.extend(_optimizer_params(opt))
    grads = [p.grad for p in params if isinstance(p, torch.Tensor) and p.grad is not None]
    state = [t for opt in optimizers for t in _state_tensors(opt)]
    return params, grads, state


# --- the simulated GPU -------------------------------------------------------------------

class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """A `torch.OutOfMemoryError` raised by `SimulatedGPU`: caught by `except torch.OutOfMemoryError`
    (and `torch.cuda.OutOfMemoryError`, the same class), and its message starts like CUDA's."""

    def __init__(self, message: str, requested: int = 0, allocated: int = 0, budget: int = 0):
        super().__init__(message)
        self.requested = requested
        self.allocated = allocated
        self.budget = budget


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
    `SimulatedOutOfMemoryError` (a `torch.OutOfMemoryError`) is raised whose message starts with
    "CUDA out of memory. Tried to allocate" and says it was simulated. (The check runs right after the
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
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._ledger = _Ledger(block_bytes)
        self._modules: list[nn.Module] = [model] if model is not None else []
        self._optimizers: list[torch.optim.Optimizer] = [optimizer] if optimizer is not None else []
        self._mode: _TrackingMode | None = None
        self.oom_count = 0

    # context
    def __enter__(self) -> "SimulatedGPU":
        if self._mode is not None:
            raise RuntimeError("this SimulatedGPU is already active; nest a new SimulatedGPU instead")
        self._track_objects(self._modules + self._optimizers, remember=False)
        self._mode = _TrackingMode(self._ledger, check=self._check,
                                   precheck_resize=self._check)
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
        self._ledger.peak = self._ledger.allocated

    def memory_free(self) -> int:
        return self.budget - self._ledger.allocated

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
                raise TypeError(f"track() takes tensors, modules and optimizers, got {type(obj).__name__}")
        ledger = self._ledger
        new: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for t in tensors:
            st = _storage(t)
            if st is None or st._cdata in ledger.live or st.device.type == "meta" or st.nbytes() == 0:
                continue
            new[st._cdata] = (st, ledger.count(st.nbytes()))
        grown = sum(n for _, n in new.values())
        if ledger.allocated + grown > self.budget:
            self._check(grown, ledger.allocated)
        for key, (st, n) in new.items():
            ledger.add(st, key, n)
        ledger.note_peak()

    def _check(self, grown: int, before: int) -> None:
        if before + grown <= self.budget:
            return
        self.oom_count += 1
        # Starts exactly like CUDA's message, so code that matches "CUDA out of memory." still does.
        raise SimulatedOutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_bytes(grown)} (simulated GPU; "
            f"{format_bytes(self.budget)} total capacity; {format_bytes(before)} already allocated; "
            f"{format_bytes(max(self.budget - before, 0))} free). Simulated by course_utils.memory.SimulatedGPU "
            "on the CPU: no real GPU was involved.",
            requested=grown, allocated=before, budget=self.budget)

    def __repr__(self) -> str:
        state = "active" if self._mode is not None else "inactive"
        return (f"SimulatedGPU({format_bytes(self.budget)}, {state}: {format_bytes(self.memory_allocated())} "
                f"allocated, peak {format_bytes(self.max_memory_allocated())})")


# --- a real GPU with less memory ------------------------------------------------------------

class limit_gpu_memory:  # noqa: N801 - used like a function: `with limit_gpu_memory("4GiB"):`
    """Cap this process's CUDA caching allocator at `budget` bytes, restored on exit.

        with limit_gpu_memory("2GiB"):
            ...   # torch.OutOfMemoryError once the process's reserved memory would pass 2 GiB

    Uses `torch.cuda.set_per_process_memory_fraction(budget / total_memory)`. The cap applies to
    memory *reserved* by PyTorch on that device, including what was reserved before entering, so the
    cache is emptied on entry. On a machine without CUDA it raises a RuntimeError that points to
    `SimulatedGPU`.
    """

    def __init__(self, budget: BytesLike, device: int | str | torch.device | None = None):
        self.budget = parse_bytes(budget)
        self.device = device
        self._index: int | None = None
        self._previous: float | None = None

    def __enter__(self) -> int:
        if not torch.cuda.is_available():  # asks the driver; does not initialise CUDA
            raise RuntimeError(
                f"limit_gpu_memory({format_bytes(self.budget)}) needs a CUDA GPU, and "
                "torch.cuda.is_available() is False in this process. On a CPU, use "
                "SimulatedGPU(budget, model=..., optimizer=...) to run the same demonstration.")
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device is None else torch.device(self.device)
        if dev.type != "cuda":
            raise ValueError(f"limit_gpu_memory limits a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        if self.budget > total:
            raise ValueError(f"budget {format_bytes(self.budget)} is more than cuda:{index} has "
                             f"({format_bytes(total)})")
        self._index = index
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer than torch 2.6
        self._previous = float(get_fraction(index)) if get_fraction is not None else 1.0
        free_memory()  # cached blocks count against the cap: release them first
        torch.cuda.set_per_process_memory_fraction(self.budget / total, index)
        return self.budget

    def __exit__(self, *exc) -> None:
        if self._index is not None and self._previous is not None:
            torch.cuda.set_per_process_memory_fraction(float(self._previous), self._index)
        self._index = self._previous = None


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# --- finding the largest batch that fits -------------------------------------------------------

class Trial(NamedTuple):
    """One trial of `find_max_batch_size`: batch size, whether it fit, peak bytes (None if unknown)."""
    size: int
    ok: bool
    peak_bytes: int | None


@dataclass
class BatchSizeSearch:
    """Result of `find_max_batch_size`."""
    batch_size: int              # the recommendation: largest_ok reduced by the safety margin
    largest_ok: int
    smallest_failed: int | None  # None when max_size itself fit
    safety_margin: float
    trials: list[Trial] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"batch size {self.batch_size} (largest that fit: {self.largest_ok}"
                 + (f", smallest that failed: {self.smallest_failed}" if self.smallest_failed else "")
                 + (f", safety margin {self.safety_margin:.0%}" if self.safety_margin else "") + ")"]
        for t in self.trials:
            peak = format_bytes(t.peak_bytes) if t.peak_bytes is not None else "?"
            lines.append(f"  {t.size:>7}  {'fits' if t.ok else 'OOM ':<5} peak {peak}")
        return "\n".join(lines)


def _batch_maker(source, device: torch.device) -> Callable[[int], tuple]:
    """size -> (inputs, targets) on `device`, from a callable or a dataset (samples reused cyclically
    when size exceeds the dataset)."""
    if callable(source) and not hasattr(source, "__getitem__"):
        def make(n: int):
            batch = source(n)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError("make_batch(n) must return (inputs, targets)")
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
            raise ValueError("the dataset is empty")
        def make(n: int):
            items = [source[i % len(source)] for i in range(n)]
            xs, ys = zip(*items)
            y = torch.stack(ys) if isinstance(ys[0], torch.Tensor) else torch.tensor(ys)
            return torch.stack(xs).to(device), y.to(device)
        return make
    raise TypeError("make_batch_or_dataset must be a callable size -> (inputs, targets), or a dataset "
                    f"(with .images/.labels, or indexable with len()); got {type(source).__name__}")


class _Snapshot:
    """Host copies of a model's parameters and buffers, their gradients, and an optimizer's state
    and hyperparameters. `restore()` writes them back in place where the tensor still exists (same
    objects, same storages) and re-creates the rest on their original devices."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors = [(t, _host_copy(t)) for t in list(model.parameters()) + list(model.buffers())]
        params = list(dict.fromkeys(list(model.parameters()) + list(_optimizer_params(optimizer))))
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
        raise ValueError(f"start must be a positive int, got {start!r}")
    if not isinstance(max_size, int) or max_size < start:
        raise ValueError(f"max_size must be an int >= start ({start}), got {max_size!r}")
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
    if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
        raise ValueError(f"steps_per_trial must be a positive int, got {steps_per_trial!r}")
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
                trials = _search(make, model, optimizer, loss_fn, precision, start, max_size,
                                 steps_per_trial, sim, dev)
        finally:
            optimizer.zero_grad(set_to_none=True)
            snapshot.restore()
    ok = [t.size for t in trials if t.ok]
    failed = [t.size for t in trials if not t.ok]
    if not ok:
        raise RuntimeError("even a batch of 1 sample does not fit in memory: the model, its gradients and "
                           "optimizer state plus one sample's activations are too big for this budget")
    largest = max(ok)
    bigger_failed = [s for s in failed if s > largest]
    chosen = max(1, int(largest * (1.0 - safety_margin)))
    return BatchSizeSearch(chosen, largest, min(bigger_failed) if bigger_failed else None, safety_margin, trials)


def _search(make, model, optimizer, loss_fn, precision, start, max_size, steps, sim, dev) -> list[Trial]:
    trials: list[Trial] = []

    def attempt(n: int) -> bool:
        ok, peak = _trial(make, n, model, optimizer, loss_fn, precision, steps, sim, dev)
        trials.append(Trial(n, ok, peak))
        return ok

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


def _trial(make, n, model, optimizer, loss_fn, precision, steps, sim, dev) -> tuple[bool, int | None]:
    saved_peak = None
    if sim is not None:
        saved_peak = sim.max_memory_allocated()
        sim.reset_peak_memory_stats()
    elif dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    failed = False
    try:
        inputs, targets = make(n)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            if precision is None:
                loss = _loss_of(model, loss_fn, inputs, targets)
            else:
                with precision.autocast():
                    loss = _loss_of(model, loss_fn, inputs, targets)
            _backward_and_step(loss, optimizer, None, precision, None)
            del loss
        del inputs, targets
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        failed = True
    # outside the except block: the failed trial's tensors are unreachable now
    optimizer.zero_grad(set_to_none=True)
    if failed:
        free_memory()
    peak = None
    if sim is not None:
        peak = sim.max_memory_allocated()
        sim._ledger.peak = max(saved_peak, peak)
    elif dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
    return not failed, peak


# --- predicting memory ---------------------------------------------------------------------

@dataclass
class MemoryEstimate:
    """Predicted memory of one training step (steady state: optimizer state already created).

    `total` (the predicted peak) = parameters + batch + optimizer_state + library_workspace
    + max(forward/backward peak, gradients + step_temporaries), where the forward/backward peak is
    `activations` plus the gradients already accumulated at that moment.
    """
    parameters: int          # parameters and buffers
    gradients: int           # one per trainable parameter
    optimizer_state: int
    activations: int         # saved for backward + temporaries, at the forward/backward peak
    step_temporaries: int    # extra memory inside optimizer.step()
    batch: int               # inputs and targets on the device
    forward_backward_peak: int
    library_workspace: int   # cuBLAS workspace on CUDA (allocated once per stream), else 0
    total: int
    optimizer_kind: str
    state_source: str        # how optimizer_state was obtained
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [("parameters (and buffers)", self.parameters, ""),
                ("gradients", self.gradients, ""),
                ("optimizer state", self.optimizer_state, self.state_source),
                ("activations", self.activations, "at the forward/backward peak (fake tensors)"),
                ("optimizer step temporaries", self.step_temporaries, ""),
                ("batch (inputs + targets)", self.batch, ""),
                ("cuBLAS workspace", self.library_workspace, ""),
                ("predicted peak", self.total, "= parameters + batch + state + workspace"
                 " + max(fwd/bwd peak, gradients + step temporaries)")]
        lines = [f"Training memory estimate ({self.optimizer_kind}):"]
        lines += [f"  {name:<28}{format_bytes(n):>12}  {note}".rstrip() for name, n, note in rows]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    __repr__ = __str__


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        moms = {g.get("momentum", 0) for g in optimizer.param_groups}
        return "SGD with momentum" if any(m for m in moms) else "SGD"
    return name


def _analytic_state(optimizer: torch.optim.Optimizer, count: Callable[[int], int]) -> tuple[int, str] | None:
    """Optimizer state bytes for the optimizers the course uses; None for others."""
    def nbytes(p):
        return count(p.numel() * p.element_size())

    total = 0
    if type(optimizer) is torch.optim.SGD:
        for g in optimizer.param_groups:
            if g.get("momentum", 0):
                total += sum(nbytes(p) for p in g["params"] if p.requires_grad)
        return total, ("SGD with momentum: 1 buffer per parameter" if total else "SGD: no state")
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for g in optimizer.param_groups:
            per = 3 if g.get("amsgrad") else 2
            on_device = bool(g.get("capturable") or g.get("fused"))
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                total += per * nbytes(p)
                if on_device or p.device.type == "cpu":  # `step` is a scalar tensor, on the CPU unless
                    total += count(4)                    # capturable/fused
        return total, f"{type(optimizer).__name__}: 2 buffers per parameter (3 with amsgrad)"
    return None


def _example_parts(example_batch):
    if isinstance(example_batch, torch.Tensor):
        return example_batch, None
    if isinstance(example_batch, (tuple, list)) and len(example_batch) == 2:
        return example_batch[0], example_batch[1]
    raise TypeError("example_batch must be the inputs tensor or a pair (inputs, targets)")


def estimate_training_memory(model: nn.Module, optimizer: torch.optim.Optimizer, example_batch,
                             loss_fn: Callable | None = None, *, autocast_dtype: torch.dtype | None = None,
                             block_bytes: int = CUDA_BLOCK_BYTES) -> MemoryEstimate:
    """Predict the peak memory of a training step on `example_batch` without running it for real.

    Parameters, gradients and optimizer state come from the parameters' sizes (state by optimizer
    kind: SGD none, momentum 1x, Adam/AdamW 2x; other optimizers: measured by running their step on
    fake tensors). Activations and temporaries come from running two training steps (forward, loss,
    backward, optimizer step) of a fake copy of the model under `FakeTensorMode`: shapes and dtypes
    are real, no data memory is allocated, the real model and optimizer are not touched.

    `example_batch` is the inputs tensor or (inputs, targets); `loss_fn(outputs, targets)` defaults
    to `outputs.sum()`. `autocast_dtype` (e.g. torch.bfloat16) runs the forward pass under autocast.
    Each tensor is rounded up to `block_bytes`, as CUDA's allocator does. Not included: the CUDA
    context, cuBLAS/cuDNN workspaces and kernels' scratch buffers, allocator fragmentation.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    inputs, targets = _example_parts(example_batch)
    if not isinstance(inputs, torch.Tensor) or (targets is not None and not isinstance(targets, torch.Tensor)):
        raise TypeError("example_batch must hold tensors: inputs, or (inputs, targets)")
    ledger = _Ledger(block_bytes)
    count = ledger.count
    notes: list[str] = []
    try:
        fake = _fake_training_run(model, optimizer, inputs, targets, loss_fn or _sum_loss, autocast_dtype, ledger)
    except Exception as exc:
        raise RuntimeError(f"could not run a training step of {type(model).__name__} on fake tensors "
                           f"with this example batch: {_first_line(exc)}") from exc
    kind = _optimizer_kind(optimizer)
    analytic = _analytic_state(optimizer, count)
    if analytic is not None:
        state, source = analytic
    elif "step_error" not in fake:
        state, source = fake["state"], f"{kind}: measured by a step on fake tensors"
    else:
        state, source = 0, f"{kind}: unknown"
        notes.append(f"{kind}'s step could not run on fake tensors ({fake['step_error']}): its state and "
                     "temporaries are not included")
    grads = sum(count(p.numel() * p.element_size()) for p in model.parameters() if p.requires_grad)
    workspace = 0
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda":
        get_size = getattr(torch._C, "_cuda_getCublasWorkspaceSize", None)  # private; may move
        workspace = int(get_size()) if callable(get_size) else 0
        notes.append("on CUDA also: cuDNN convolution workspaces (chosen per algorithm) and allocator "
                     "fragmentation, not included")
    fb_peak, step_tmp = fake["fb_peak"], fake["step_tmp"]
    total = fake["params"] + fake["batch"] + state + workspace + max(fb_peak, grads + step_tmp)
    return MemoryEstimate(parameters=fake["params"], gradients=grads, optimizer_state=state,
                          activations=max(fb_peak - fake["grads_at_peak"], 0), step_temporaries=step_tmp,
                          batch=fake["batch"], forward_backward_peak=fb_peak, library_workspace=workspace,
                          total=total, optimizer_kind=kind, state_source=source, notes=notes)


def _sum_loss(outputs: torch.Tensor, _targets) -> torch.Tensor:
    return outputs.sum()


def _fake_optimizer(optimizer: torch.optim.Optimizer, fake_of: dict[int, torch.Tensor]):
    """A new optimizer of the same class and hyperparameters over the fake parameters. The
    foreach/fused choice is made for the real parameters (it would default differently for fakes)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    groups = []
    for g in optimizer.param_groups:
        fg = {k: v for k, v in g.items() if k != "params"}
        fg["params"] = [fake_of[id(p)] for p in g["params"]]
        if "foreach" in g and g.get("foreach") is None and not g.get("fused"):
            _, foreach = _default_to_fused_or_foreach([p for p in g["params"]], bool(g.get("differentiable")))
            fg["foreach"] = foreach
        groups.append(fg)
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:
        return type(optimizer)(groups)


def _fake_training_run(model, optimizer, inputs, targets, loss_fn, autocast_dtype, ledger) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    fm = FakeTensorMode(allow_non_fake_inputs=True)
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    fake_of: dict[int, torch.Tensor] = {}
    fake_state: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if id(t) not in fake_of:
            fake_of[id(t)] = fm.from_tensor(t)
        fake_state[name] = fake_of[id(t)]
    fake_inputs = fm.from_tensor(inputs)
    fake_targets = fm.from_tensor(targets) if targets is not None else None
    fake_params = [fake_of[id(p)] for p in model.parameters()]
    result: dict[str, Any] = {}
    grads_at_peak = [0]

    def on_peak():
        grads_at_peak[0] = sum(ledger.count(p.grad.untyped_storage().nbytes())
                               for p in fake_params if p.grad is not None)

    mode = _TrackingMode(ledger, count_meta=True, on_peak=on_peak)
    device_type = inputs.device.type

    with fm, mode:
        def register(ts):
            before = ledger.allocated
            for t in ts:
                st = t.untyped_storage()
                if st._cdata not in ledger.live and st.nbytes():
                    ledger.add(st, st._cdata, ledger.count(st.nbytes()))
            return ledger.allocated - before

        result["params"] = register(fake_of.values())
        result["batch"] = register([t for t in (fake_inputs, fake_targets) if t is not None])
        missing = [id(p) for p in _optimizer_params(optimizer) if id(p) not in fake_of]
        for pid in missing:  # optimizer parameters that are not the model's
            p = next(q for q in _optimizer_params(optimizer) if id(q) == pid)
            fake_of[pid] = fm.from_tensor(p)
        try:
            fake_opt = _fake_optimizer(optimizer, fake_of)
        except Exception as exc:  # an optimizer that cannot be rebuilt this way
            fake_opt, result["step_error"] = None, _first_line(exc)

        def forward_backward():
            if autocast_dtype is not None:
                with torch.autocast(device_type, dtype=autocast_dtype):
                    out = functional_call(model, fake_state, (fake_inputs,))
                    loss = loss_fn(out, fake_targets)
            else:
                out = functional_call(model, fake_state, (fake_inputs,))
                loss = loss_fn(out, fake_targets)
            del out
            loss.backward()
            return loss

        def zero_grad():
            for p in fake_of.values():
                p.grad = None

        # step 1 creates the optimizer state; step 2 is the steady state we predict
        loss = forward_backward()
        if fake_opt is not None:
            try:
                fake_opt.step()
            except Exception as exc:
                fake_opt, result["step_error"] = None, _first_line(exc)
        del loss
        zero_grad()
        base = ledger.allocated
        result["state"] = base - result["params"] - result["batch"]
        ledger.peak = base
        grads_at_peak[0] = 0
        loss = forward_backward()
        result["fb_peak"] = ledger.peak - base
        result["grads_at_peak"] = grads_at_peak[0]
        before_step = ledger.allocated
        ledger.peak = before_step
        if fake_opt is not None:
            fake_opt.step()
        result["step_tmp"] = ledger.peak - before_step
        del loss
        zero_grad()
    return result


# --- activation checkpointing ----------------------------------------------------------------

class Checkpointed(nn.Module):
    """Runs `module` under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` when
    gradients are being recorded: its inner activations are recomputed in backward instead of kept.
    The state_dict keys gain a "module." prefix."""

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"checkpointed() wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)  # nothing would be saved anyway
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.module, *args, use_reentrant=False,
                          preserve_rng_state=self.preserve_rng_state, **kwargs)


def checkpointed(module: nn.Module, preserve_rng_state: bool = True) -> Checkpointed:
    """Wrap `module` so that its activations are recomputed in backward (non-reentrant checkpoint)."""
    return Checkpointed(module, preserve_rng_state)


def checkpoint_sequential_blocks(blocks: nn.Sequential | Sequence[nn.Module], segments: int,
                                 input: torch.Tensor, preserve_rng_state: bool = True) -> torch.Tensor:
    """Run `blocks` in `segments` checkpointed segments (`torch.utils.checkpoint.checkpoint_sequential`
    with use_reentrant=False): only segment boundaries are kept for backward."""
    from torch.utils.checkpoint import checkpoint_sequential
    n = len(blocks)
    if not isinstance(segments, int) or not 1 <= segments <= max(n, 1):
        raise ValueError(f"segments must be an int between 1 and the number of blocks ({n}), got {segments!r}")
    if not torch.is_grad_enabled():
        for b in blocks:
            input = b(input)
        return input
    return checkpoint_sequential(blocks if isinstance(blocks, nn.Sequential) else list(blocks), segments,
                                 input, use_reentrant=False, preserve_rng_state=preserve_rng_state)
