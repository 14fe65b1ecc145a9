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
- `profiled_peak(fn, *resident)`: the CPU memory `fn()` really uses at its peak, counted by torch.profiler's
  allocator events (what the estimator is checked against without a GPU; it shares no code with it).
- `find_max_batch_size(...)`: doubling then binary search with real training steps.
- `check_fits(...)`: whether a step will fit in the memory free for it; `MemoryCheck`, the Trainer's callback
  that runs it before the first step and warns with a `MemoryWarning`.
- `ResilientStep`: a training step that, on OOM, splits the batch into micro-batches with gradient
  accumulation and retries the same step (same update, no data skipped).
- `checkpointed(module)`, `checkpoint_sequential_blocks(...)`: activation checkpointing, always with
  `use_reentrant=False`.

Importing this module touches no device and starts nothing.
"""
from .batch_size import BatchSizeSearch, Trial, find_max_batch_size
from .recompute import Checkpointed, checkpoint_sequential_blocks, checkpointed
from .estimate import MemoryEstimate, estimate_training_memory
from .limit import limit_gpu_memory
from .oom import OOM_MESSAGES, FreeMemoryReport, free_memory, is_oom_error
from .profiled import profiled_peak, resident_bytes
from .precheck import FitCheck, MemoryCheck, MemoryWarning, check_fits, free_for_training, warn_if_too_big
from .resilient import ResilientStep, ResilientStepOutOfMemoryError
from .simulated import MemoryBreakdown, PeakReading, SimulatedGPU, SimulatedOutOfMemoryError, active_simulated_gpu
from .sizes import CUDA_BLOCK_BYTES, BytesLike, format_bytes, parse_bytes

__all__ = [
    "CUDA_BLOCK_BYTES", "OOM_MESSAGES", "BatchSizeSearch", "FitCheck", "MemoryCheck", "MemoryWarning", "check_fits",
    "free_for_training", "warn_if_too_big", "BytesLike", "Checkpointed", "FreeMemoryReport",
    "MemoryBreakdown", "MemoryEstimate", "PeakReading", "ResilientStep", "ResilientStepOutOfMemoryError", "SimulatedGPU",
    "SimulatedOutOfMemoryError", "Trial", "active_simulated_gpu", "checkpoint_sequential_blocks", "checkpointed",
    "estimate_training_memory", "find_max_batch_size", "format_bytes", "free_memory", "is_oom_error",
    "limit_gpu_memory", "parse_bytes", "profiled_peak", "resident_bytes",
]
