"""Matrix products on the CPU and the GPU (notebook 04, section 1): `matmul_gflops` and `matmul_sweep` (with or
without the copies to the device and back), `crossover` (the size from which the GPU wins), and
`launch_and_total_seconds` (what an unsynchronized timer measures on a GPU).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..device import as_device
from ..i18n import _
from ..timing import measure, synchronize


def matmul_gflops(n: int, device="cpu", *, include_transfer: bool = False, repeats: int = 5,
                  min_run_time: float = 0.05) -> float:
    """GFLOP/s of an n x n float32 matrix product on `device` (an n x n product costs 2n^3 operations).

    `include_transfer=True`: the operands live on the CPU and every call copies them to `device`,
    multiplies and copies the result back, as code that keeps its data on the CPU would. On the CPU
    itself there is nothing to copy and both figures measure the same thing.
    Timed with `course_utils.timing.measure` (warm-up, a synchronize per call, median).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(_("n must be a positive int, got {n!r}").format(n=n))
    device = as_device(device)
    gen = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    if include_transfer and device.type != "cpu":
        def fn():
            return (a.to(device) @ b.to(device)).cpu()  # .cpu() waits for the product: a sync point
    else:
        a, b = a.to(device), b.to(device)

        def fn():
            return a @ b
    m = measure(fn, device=device, warmup=2, repeats=repeats, min_run_time=min_run_time)
    return 2 * n ** 3 / m.median / 1e9


def matmul_sweep(sizes, device="cpu", *, include_transfer: bool = False, **kwargs) -> dict[int, float]:
    """{n: GFLOP/s} for each size in `sizes` (see `matmul_gflops`)."""
    return {int(n): matmul_gflops(int(n), device, include_transfer=include_transfer, **kwargs) for n in sizes}


def crossover(cpu: dict[int, float], gpu: dict[int, float]) -> int | None:
    """The smallest size from which the GPU is at least as fast as the CPU at that size and every larger
    one measured (`cpu`/`gpu`: {size: throughput}); None if the GPU never wins for good."""
    sizes = sorted(set(cpu) & set(gpu))
    found = None
    for n in reversed(sizes):
        if gpu[n] < cpu[n]:
            break
        found = n
    return found


def launch_and_total_seconds(fn: Callable[[], object], device, repeats: int = 5) -> tuple[float, float]:
    """(time until `fn()` returns, time until its work is done), medians over `repeats` calls.

    On a GPU the first is only the kernel launch: what `time.perf_counter()` around a call measures
    when nobody synchronizes. On the CPU both are the same, since the work is done when `fn` returns.
    """
    device = as_device(device)
    fn()
    synchronize(device)
    launch, total = [], []
    for _i in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        synchronize(device)  # CPU-GPU sync point here: wait for the queued work
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        total.append(t2 - t0)
    return statistics.median(launch), statistics.median(total)
