"""Recognising out-of-memory errors from every backend, and releasing cached memory afterwards."""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ..i18n import _


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
        raise TypeError(_("is_oom_error expects an exception, got {kind}").format(kind=type(exc).__name__))
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
