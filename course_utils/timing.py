"""Timing done right, shared by notebooks and benchmarks.

GPU kernels run asynchronously: the Python call returns as soon as the kernel is queued. So every
measurement here synchronizes the device before reading the clock, runs warm-up calls first (the first
calls pay for cuDNN autotuning, lazy initialisation, caches) and reports the median of several runs.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

import torch

from .i18n import _


def synchronize(device=None) -> None:
    """Wait for queued work on `device` (a no-op on CPU). CPU-GPU sync point."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class Measurement:
    """Seconds per call: `median`, plus every run's time in `times`."""
    times: list[float] = field(default_factory=list)
    label: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> float:
        if len(self.times) < 4:
            return 0.0
        q = statistics.quantiles(self.times, n=4)
        return q[2] - q[0]

    def __repr__(self) -> str:
        summary = _("median {median}, IQR {iqr}, {runs} runs").format(
            median=format_seconds(self.median), iqr=format_seconds(self.iqr), runs=len(self.times))
        return f"Measurement({self.label + ': ' if self.label else ''}{summary})"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def measure(fn, *, device=None, warmup: int = 2, repeats: int = 7, min_run_time: float = 0.0,
            label: str = "") -> Measurement:
    """Time `fn()` properly: `warmup` untimed calls, then `repeats` timed calls (more if needed to fill
    `min_run_time` seconds), each bracketed by a device synchronize. Returns a Measurement."""
    for _i in range(warmup):
        fn()
    synchronize(device)
    times = []
    start_all = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start_all) < min_run_time:
        t0 = time.perf_counter()
        fn()
        synchronize(device)  # without this we would time the kernel *launch*, not the work
        times.append(time.perf_counter() - t0)
        if len(times) >= 10_000:
            break
    return Measurement(times, label)


def measure_interleaved(fns: dict, *, device=None, warmup: int = 2, repeats: int = 7) -> dict:
    """Time several callables in alternation (A B C A B C ...), so drift in clock speed or load
    affects them alike; returns {name: Measurement}. Use this for ratios."""
    for fn in fns.values():
        for _i in range(warmup):
            fn()
    synchronize(device)
    results = {name: Measurement([], name) for name in fns}
    for _i in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            results[name].times.append(time.perf_counter() - t0)
    return results


def hardware_name(device=None) -> str:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({os.cpu_count()} logical CPUs, torch uses {torch.get_num_threads()} threads)"


def stamp(device=None) -> dict:
    """Who/what/when for a results file: hardware, torch version, UTC date, git commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "hardware": hardware_name(device),
        "device": str(device or "cpu"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "commit": commit,
    }
