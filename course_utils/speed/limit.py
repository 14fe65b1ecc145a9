"""How close a loop gets to the machine's limit (notebook 04, sections 5-6): `trace_events` and
`gpu_busy_fraction` (from a profiler trace), `cuda_event_seconds` (timing with CUDA events), `train_step_flops`
(FlopCounterMode), `matmul_peak_sweep`, `conv_sweep` and `rung_precision` (the peak a rung is held against), and
`ladder_mfu`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..amp import MixedPrecision
from ..device import as_device
from ..i18n import _
from ..models import CifarCNN
from ..timing import measure
from .ladder import NAIVE, RUNGS, LoopConfig, backend_flags
from .matmul import matmul_sweep


GPU_TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # what a trace's GPU rows hold


def trace_events(trace) -> list[dict]:
    """The events of a profiler trace: `trace` is the path `prof.export_chrome_trace(path)` wrote, or the
    loaded JSON. Each is a dict with "name", "cat" (category), "ts" and "dur" (microseconds), ..."""
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(_("expected a Chrome trace: a JSON object with a 'traceEvents' list, as written by "
                           "prof.export_chrome_trace(path)"))
    return trace["traceEvents"]


def gpu_busy_fraction(trace) -> float | None:
    """The share of the time from the first to the last GPU activity of a trace (see `trace_events`) during
    which the GPU ran something: the union of its kernel, memcpy and memset intervals over that span. None when
    the trace has no GPU activity (a CPU-only profile)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace_events(trace)
                   if e.get("ph") == "X" and e.get("cat") in GPU_TRACE_CATEGORIES)
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    first = start
    for s, e in spans[1:]:
        if s > end:  # a gap: the GPU idled from `end` to `s`
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    total = end - first
    return busy / total if total > 0 else 1.0


def cuda_event_seconds(fn: Callable[[], object], *, warmup: int = 3, repeats: int = 20) -> list[float]:
    """Seconds of GPU time of each of `repeats` calls of `fn`, from CUDA events (after `warmup` untimed calls).

    A pair of `torch.cuda.Event(enable_timing=True)` is recorded into the stream before and after each call;
    the GPU stamps each when it reaches it, so `start.elapsed_time(end)` (milliseconds) is the GPU's time for
    the work queued between them. The CPU never waits between calls: one synchronize at the end, before the
    stamps are read.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(_("CUDA events need a CUDA GPU; on other devices time with course_utils.timing.measure"))
    for _i in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()  # CPU-GPU sync point: every event has been reached
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def train_step_flops(batch_size: int, *, model_fn: Callable[[], torch.nn.Module] = CifarCNN,
                     input_shape: tuple[int, ...] = (3, 32, 32), device="meta") -> int:
    """Floating-point operations of the forward and backward pass of one training step (cross-entropy loss)
    of `model_fn()` on a batch of `batch_size`, counted by `torch.utils.flop_counter.FlopCounterMode`.

    It counts matrix products and convolutions (2 per multiply-add), not element-wise work or the optimizer.
    The count depends only on shapes, so by default it runs on the "meta" device, which computes nothing.
    """
    from torch.utils.flop_counter import FlopCounterMode

    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(_("batch_size must be a positive int, got {batch_size!r}").format(batch_size=batch_size))
    with torch.device(device):
        model = model_fn()
        x = torch.randn(batch_size, *input_shape)
    with FlopCounterMode(display=False) as counter:
        logits = model(x)
        F.cross_entropy(logits, torch.zeros(batch_size, dtype=torch.long, device=logits.device)).backward()
    return counter.get_total_flops()


PRECISIONS = ("float32", "tf32", "bfloat16", "float16")


def matmul_peak_sweep(sizes, device="cpu", precision: str = "float32", *, repeats: int = 5,
                      min_run_time: float = 0.05) -> dict[int, float]:
    """{n: GFLOP/s} of n x n products in `precision`: "float32" (`matmul_sweep`), "tf32" (float32 operands
    under `set_float32_matmul_precision("high")`, CUDA only, restored after), "bfloat16" or "float16" operands.
    With `conv_sweep`, what notebook 04 takes the peak measured here from."""
    if precision not in PRECISIONS:
        raise ValueError(_("precision must be one of {choices}, got {precision!r}").format(choices=PRECISIONS,
                                                                                         precision=precision))
    device = as_device(device)
    if precision == "float32":
        return matmul_sweep(sizes, device, repeats=repeats, min_run_time=min_run_time)
    if precision == "tf32":
        if device.type != "cuda":
            raise ValueError(_("TF32 is a CUDA tensor-core format; on other devices measure 'float32'"))
        with backend_flags(replace(NAIVE, tf32=True), device):
            return matmul_sweep(sizes, device, repeats=repeats, min_run_time=min_run_time)
    dtype = getattr(torch, precision)
    out = {}
    for n in sizes:
        n = int(n)
        gen = torch.Generator().manual_seed(n)
        a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
        m = measure(lambda: a @ b, device=device, warmup=2, repeats=repeats, min_run_time=min_run_time)
        out[n] = 2 * n ** 3 / m.median / 1e9
    return out


def conv_sweep(device="cpu", precision: str = "float32", batch_sizes=(64, 256), *, repeats: int = 5,
               min_run_time: float = 0.05) -> dict[str, float]:
    """{"conv2, batch=64": GFLOP/s, ...}: the forward pass of each of `CifarCNN`'s convolutions, alone, at each
    batch size, in `precision` (as `matmul_peak_sweep`; under "tf32" cuDNN convolutions follow
    `torch.backends.cudnn.allow_tf32`, True by default). Convolutions and matrix products go through different
    libraries, and one may reach more of the chip than the other: notebook 04 takes the best of both as the peak."""
    if precision not in PRECISIONS:
        raise ValueError(_("precision must be one of {choices}, got {precision!r}").format(choices=PRECISIONS,
                                                                                         precision=precision))
    device = as_device(device)
    if precision == "tf32" and device.type != "cuda":
        raise ValueError(_("TF32 is a CUDA tensor-core format; on other devices measure 'float32'"))
    dtype = torch.float32 if precision in ("float32", "tf32") else getattr(torch, precision)
    convs = [m for m in CifarCNN().features if isinstance(m, torch.nn.Conv2d)]
    sides = (32, 16, 8)  # each convolution's input size (a 2x2 max-pool before the second and the third)
    out = {}
    with backend_flags(replace(NAIVE, tf32=precision == "tf32"), device):
        for i, (conv, side) in enumerate(zip(convs, sides), 1):
            weight, bias = conv.weight.detach().to(device, dtype), conv.bias.detach().to(device, dtype)
            flops_per_image = 2 * conv.out_channels * side * side * conv.in_channels * 9
            for bs in batch_sizes:
                x = torch.randn(bs, conv.in_channels, side, side, generator=torch.Generator().manual_seed(i))
                x = x.to(device, dtype)
                m = measure(lambda: F.conv2d(x, weight, bias, padding=1), device=device, warmup=2, repeats=repeats,
                            min_run_time=min_run_time)
                out[f"conv{i}, batch={bs}"] = flops_per_image * bs / m.median / 1e9
    return out


def rung_precision(config: LoopConfig, device) -> str:
    """The precision a config's products and convolutions run in on `device`: "bfloat16" or "float16" under
    mixed precision (the course's choice for the device), "tf32" with `config.tf32` on CUDA, else "float32"."""
    device = as_device(device)
    if config.mixed_precision:
        return str(MixedPrecision(device).dtype).removeprefix("torch.")
    if config.tf32 and device.type == "cuda":
        return "tf32"
    return "float32"


def ladder_mfu(images_per_s: dict[str, float], peak_gflops: dict[str, float], device) -> dict[str, dict]:
    """Each measured rung's training FLOP/s (`train_step_flops` at the rung's batch size, per image, times images/s)
    over `peak_gflops[precision]`, the peak for the precision the rung computes in (`rung_precision`): model FLOPs
    utilisation when those are the chip's rated (datasheet) peaks; with peaks measured on the machine, as notebook
    04 does, the share of the measured peak. {rung: {"batch_size", "flops_per_image", "precision",
    "achieved_gflops", "peak_gflops", "mfu"}}; rungs whose precision has no peak are left out."""
    rungs = {r.name: r for r in RUNGS}
    flops: dict[int, int] = {}
    out = {}
    for name, ips in images_per_s.items():
        config = rungs[name].config
        precision = rung_precision(config, device)
        if precision not in peak_gflops:
            continue
        bs = config.batch_size
        if bs not in flops:
            flops[bs] = train_step_flops(bs)
        per_image = flops[bs] / bs
        achieved = ips * per_image / 1e9
        out[name] = {"batch_size": bs, "flops_per_image": per_image, "precision": precision,
                     "achieved_gflops": achieved, "peak_gflops": peak_gflops[precision],
                     "mfu": achieved / peak_gflops[precision]}
    return out
