"""How fast does training run, and what makes it faster? Measurements shared by notebook 04,
`benchmarks/bench_speed.py` and the GPU check (`benchmarks/gpu_check.sh`), in four topics:

- `speed.matmul`: throughput of an n x n matrix product, with or without the copies a CPU-side caller pays, and
  `crossover`, the size from which the GPU wins.
- `speed.ladder`: one training loop (`CifarCNN` on CIFAR-shaped images) made faster one change at a time. Each
  rung is a `Rung`: `speed.naive(device, data, images=..., repeats=..., warmup_steps=...)` returns images per
  second; `run_ladder` measures them all in one run and gives ratios to the first; `time_to_accuracy` counts the
  seconds to a held-out accuracy, beside images per second.
- `speed.limit`: profiling and the machine's limit: `gpu_busy_fraction` (from a profiler trace),
  `cuda_event_seconds`, `train_step_flops` (FlopCounterMode), `matmul_peak_sweep`, `conv_sweep`, `rung_precision`
  and `ladder_mfu`.
- `speed.loaders`: `loader_epochs` times epochs of an input pipeline, for DataLoader worker processes with
  `course_utils.data.AugmentedImages` (re-exported here; notebook 03).

Everything is importable from `course_utils.speed` itself. Importing it touches no device.
"""
from ..data import AugmentedImages as AugmentedImages  # re-exported: notebook 03 imports it from here
from .ladder import (
    BIG_BATCH,
    CHANNELS_LAST,
    COMPILED,
    CUDNN_BENCHMARK,
    MIXED,
    NAIVE,
    NO_ITEM,
    PINNED,
    RESIDENT,
    RUNGS,
    TF32,
    LadderResult,
    LoopConfig,
    Rung,
    TimeToAccuracy,
    backend_flags,
    batch_size_sweep,
    big_batch,
    channels_last,
    compiled,
    cudnn_benchmark,
    ladder_step,
    mixed_precision,
    naive,
    no_item_sync,
    pinned_memory,
    resident_data,
    run_ladder,
    tf32,
    time_to_accuracy,
    train_throughput,
)
from .limit import (
    GPU_TRACE_CATEGORIES,
    PRECISIONS,
    conv_sweep,
    cuda_event_seconds,
    gpu_busy_fraction,
    ladder_mfu,
    matmul_peak_sweep,
    rung_precision,
    trace_events,
    train_step_flops,
)
from .loaders import EpochTiming, loader_epochs
from .matmul import crossover, launch_and_total_seconds, matmul_gflops, matmul_sweep

__all__ = [
    "AugmentedImages", "backend_flags", "batch_size_sweep", "BIG_BATCH", "big_batch", "CHANNELS_LAST",
    "channels_last", "COMPILED", "compiled", "conv_sweep", "crossover", "cuda_event_seconds", "CUDNN_BENCHMARK",
    "cudnn_benchmark", "EpochTiming", "gpu_busy_fraction", "GPU_TRACE_CATEGORIES", "ladder_mfu", "ladder_step",
    "LadderResult", "launch_and_total_seconds", "loader_epochs", "LoopConfig", "matmul_gflops", "matmul_peak_sweep",
    "matmul_sweep", "MIXED", "mixed_precision", "NAIVE", "naive", "NO_ITEM", "no_item_sync", "PINNED",
    "pinned_memory", "PRECISIONS", "RESIDENT", "resident_data", "run_ladder", "Rung", "rung_precision", "RUNGS",
    "TF32", "tf32", "time_to_accuracy", "TimeToAccuracy", "trace_events", "train_step_flops", "train_throughput",
]
