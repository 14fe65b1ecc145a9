"""How fast does training run, and what makes it faster? Measurements shared by notebook 04,
`benchmarks/bench_speed.py` and the GPU check (`benchmarks/gpu_check.sh`).

- `matmul_gflops(n, device)`: throughput of an n x n matrix product. With `include_transfer=True` the
  operands start on the CPU and the result comes back, which is what decides when a GPU pays off;
  `crossover` finds the size from which the GPU wins.
- The speed ladder: one training loop (`CifarCNN` on CIFAR-shaped images) made faster one change at a
  time. Each rung is a function `rung(device, data, images=..., repeats=..., warmup_steps=...)` that
  returns images per second; `run_ladder` measures them all in one run and gives ratios to the first.
- `loader_epochs`: times epochs of an input pipeline, for measuring DataLoader worker processes with
  `course_utils.data.AugmentedImages` (re-exported here; notebook 03).
- Profiling and the limit (notebook 04): `ladder_step` (one step of a rung's loop, to profile),
  `gpu_busy_fraction` (from a profiler trace), `cuda_event_seconds` (timing with CUDA events),
  `train_step_flops` (FlopCounterMode), `matmul_peak_sweep`, `conv_sweep` and `rung_precision` (the peak a
  rung is held against), `ladder_mfu`, and `time_to_accuracy` (seconds to a held-out accuracy, beside images
  per second).

Importing this module touches no device.
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .amp import MixedPrecision
from .data import AugmentedImages as AugmentedImages  # re-exported: notebook 03 imports it from here
from .data import TensorLoader
from .i18n import _
from .models import CifarCNN
from .step import TrainStep
from .timing import measure, synchronize


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(_("{device!r} is not a device (try 'cpu', 'cuda' or 'mps')").format(device=device)) from exc


# --- matrix products ------------------------------------------------------------------------

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
    device = _device(device)
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
    device = _device(device)
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


# --- the speed ladder -----------------------------------------------------------------------

@dataclass(frozen=True)
class LoopConfig:
    """The knobs of the training loop the ladder turns, one per rung."""
    resident: bool = False         # False: DataLoader over the in-memory dataset; True: TensorLoader on the device
    batch_size: int = 64
    item_every_step: bool = True   # the usual `running_loss += loss.item()`: a CPU-GPU sync every step
    pin_memory: bool = False       # DataLoader(pin_memory=True) + non_blocking copies (CUDA only)
    channels_last: bool = False    # NHWC layout for model and inputs
    # Two global CUDA settings, set for the measurement and restored after it (`backend_flags`); on other devices
    # they are left alone, so the rungs after them keep them everywhere and change nothing there.
    cudnn_benchmark: bool = False  # torch.backends.cudnn.benchmark: time cuDNN's algorithms per shape, keep the fastest
    tf32: bool = False             # torch.set_float32_matmul_precision("high"): float32 matmuls on TF32 tensor cores
    mixed_precision: bool = False  # torch.amp autocast in the course's dtype for the device (bf16 / fp16)
    compile: bool = False          # torch.compile(model)


NAIVE = LoopConfig()
NO_ITEM = replace(NAIVE, item_every_step=False)
PINNED = replace(NO_ITEM, pin_memory=True)
RESIDENT = replace(NO_ITEM, resident=True)
BIG_BATCH = replace(RESIDENT, batch_size=256)
CHANNELS_LAST = replace(BIG_BATCH, channels_last=True)
CUDNN_BENCHMARK = replace(CHANNELS_LAST, cudnn_benchmark=True)
TF32 = replace(CUDNN_BENCHMARK, tf32=True)
MIXED = replace(TF32, mixed_precision=True)
COMPILED = replace(MIXED, compile=True)


@contextlib.contextmanager
def backend_flags(config: LoopConfig, device):
    """On a CUDA `device`, inside the block: `torch.backends.cudnn.benchmark` and the float32 matmul precision
    as `config` says ("high", TF32, when `config.tf32`); afterwards both are back to what they were. Both are
    process-wide: left set, they would change every later measurement. On other devices nothing is set
    (`set_float32_matmul_precision("high")` also reaches oneDNN's CPU matmuls in recent torch).

    TF32 goes through `torch.set_float32_matmul_precision`, the API notebook 06 uses: recent torch refuses to
    mix it with the newer `torch.backends.cuda.matmul.fp32_precision`.
    """
    if _device(device).type != "cuda" or not (config.cudnn_benchmark or config.tf32):
        yield
        return
    benchmark, precision = torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision()
    try:
        torch.backends.cudnn.benchmark = config.cudnn_benchmark or benchmark
        if config.tf32:
            torch.set_float32_matmul_precision("high")
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        torch.set_float32_matmul_precision(precision)


def _check_data(data, batch_size: int) -> None:
    images, labels = getattr(data, "images", None), getattr(data, "labels", None)
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(_("data must be a dataset with .images and .labels tensors, e.g. "
                          "course_utils.data.synthetic_cifar(n); got {type}").format(type=type(data).__name__))
    if tuple(images.shape[1:]) != (3, 32, 32):
        raise ValueError(_("the ladder trains CifarCNN, which needs 3x32x32 images; got {shape}").format(
            shape=tuple(images.shape[1:])))
    if len(labels) < batch_size:
        raise ValueError(_("data has {images} images, fewer than one batch of {batch_size}").format(
            images=len(labels), batch_size=batch_size))


def _batches(data, config: LoopConfig, device: torch.device, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) on `device`, reshuffled every pass. Resident data is copied to the device
    here, once; DataLoader batches are copied as they are drawn, inside the timed steps."""
    if config.resident:
        loader = TensorLoader(data.images, data.labels, batch_size=config.batch_size, device=device,
                              drop_last=True, seed=seed)
        return _cycle(loader, None, False)
    loader = DataLoader(data, batch_size=config.batch_size, shuffle=True, drop_last=True, num_workers=0,
                        pin_memory=config.pin_memory, generator=torch.Generator().manual_seed(seed))
    return _cycle(loader, device, config.pin_memory)


def _cycle(loader, device: torch.device | None, non_blocking: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        for x, y in loader:
            if device is not None:
                # from pinned memory, non_blocking frees the CPU at once; the copy itself still queues behind the
                # kernels before it on the default stream (overlapping it with compute needs a side stream)
                x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
            yield x, y


def ladder_step(device, data, config: LoopConfig = NAIVE, *, seed: int = 0,
                compile_backend: str = "inductor") -> Callable[[], torch.Tensor]:
    """One training step of the ladder's loop under `config`, as a function: each call draws the next batch as
    the rung does (DataLoader and copy, or TensorLoader), runs one `TrainStep` of a fresh `CifarCNN` (SGD with
    momentum, seeded with `seed`) and returns the batch's loss, detached, on the device (no sync).

    Reading the loss is the caller's business: `train_throughput` reads it every step when
    `config.item_every_step`, as the naive loop does. The global flags of `backend_flags(config)` are not set
    here: run it inside `with backend_flags(config, device):` when they matter.
    """
    device = _device(device)
    if not isinstance(config, LoopConfig):
        raise TypeError(_("config must be a LoopConfig, got {type}").format(type=type(config).__name__))
    if config.pin_memory and device.type != "cuda":
        raise ValueError(_("pin_memory speeds up copies from the CPU to a CUDA GPU; it does nothing for "
                           "device {device} (and needs CUDA to allocate pinned memory)").format(device=device))
    _check_data(data, config.batch_size)
    torch.manual_seed(seed)
    model = CifarCNN().to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precision = MixedPrecision(device, enabled=config.mixed_precision)
    forward = torch.compile(model, backend=compile_backend) if config.compile else model
    batches = _batches(data, config, device, seed)
    train_step = TrainStep(forward, optimizer, F.cross_entropy, precision)

    def step() -> torch.Tensor:
        x, y = next(batches)
        if config.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return train_step(x, y)

    return step


def train_throughput(device, data, config: LoopConfig = NAIVE, *, images: int = 512, repeats: int = 3,
                     warmup_steps: int = 2, seed: int = 0, compile_backend: str = "inductor",
                     batch_size: int | None = None) -> float:
    """Images per second of `CifarCNN` training (SGD with momentum) on `data` under `config`.

    `warmup_steps` untimed steps first (they pay for allocation, cuDNN autotuning and compilation),
    then `repeats` timed chunks of about `images` images each, every chunk ending with a synchronize;
    the figure is from the median chunk. Each call builds a fresh model, seeded with `seed`.
    `batch_size`, if given, replaces the config's (tiny test runs use it to keep every step cheap).
    The config's global flags (cudnn.benchmark, TF32) are set for the measurement only (`backend_flags`).
    """
    device = _device(device)
    if not isinstance(config, LoopConfig):
        raise TypeError(_("config must be a LoopConfig, got {type}").format(type=type(config).__name__))
    if batch_size is not None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(_("batch_size must be a positive int, got {batch_size!r}").format(batch_size=batch_size))
        config = replace(config, batch_size=batch_size)
    for name, value in (("images", images), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(_("{name} must be a positive int, got {value!r}").format(name=name, value=value))

    steps = max(1, math.ceil(images / config.batch_size))
    with backend_flags(config, device):
        step = ladder_step(device, data, config, seed=seed, compile_backend=compile_backend)

        def chunk() -> float:
            if config.item_every_step:
                running = 0.0
                for _i in range(steps):
                    running += step().item()  # CPU-GPU sync point here, every step: the naive loop's cost
                return running / steps
            total = torch.zeros((), device=device)
            for _i in range(steps):
                total += step()  # stays on the device: no sync
            return float(total) / steps  # one CPU-GPU sync point per chunk, like reading an epoch's mean loss

        for _i in range(warmup_steps):
            step()
        m = measure(chunk, device=device, warmup=0, repeats=repeats)
    return steps * config.batch_size / m.median


def naive(device, data, **kwargs) -> float:
    """The usual first loop: DataLoader (batch 64, no workers), `.to(device)` per batch, `loss.item()` every step."""
    return train_throughput(device, data, NAIVE, **kwargs)


def no_item_sync(device, data, **kwargs) -> float:
    """As `naive`, but the loss is summed on the device and read once per chunk instead of every step."""
    return train_throughput(device, data, NO_ITEM, **kwargs)


def pinned_memory(device, data, **kwargs) -> float:
    """As `no_item_sync`, with `pin_memory=True` and `non_blocking=True` copies (CUDA only)."""
    return train_throughput(device, data, PINNED, **kwargs)


def resident_data(device, data, **kwargs) -> float:
    """The whole dataset copied to the device once; batches come from `TensorLoader` (no DataLoader)."""
    return train_throughput(device, data, RESIDENT, **kwargs)


def big_batch(device, data, **kwargs) -> float:
    """As `resident_data` with batch 256: fewer, larger steps."""
    return train_throughput(device, data, BIG_BATCH, **kwargs)


def channels_last(device, data, **kwargs) -> float:
    """As `big_batch` with model and inputs in channels_last (NHWC) memory format."""
    return train_throughput(device, data, CHANNELS_LAST, **kwargs)


def cudnn_benchmark(device, data, **kwargs) -> float:
    """As `channels_last` with `torch.backends.cudnn.benchmark = True` (CUDA only): cuDNN times its convolution
    algorithms for each new input shape (during the warm-up steps) and keeps the fastest."""
    return train_throughput(device, data, CUDNN_BENCHMARK, **kwargs)


def tf32(device, data, **kwargs) -> float:
    """As `cudnn_benchmark` with `torch.set_float32_matmul_precision("high")` (CUDA only): float32 matmuls run on
    TF32 tensor cores (Ampere and newer). cuDNN convolutions may use TF32 already by default
    (`torch.backends.cudnn.allow_tf32` is True)."""
    return train_throughput(device, data, TF32, **kwargs)


def mixed_precision(device, data, **kwargs) -> float:
    """As `tf32` under `torch.amp` autocast (bf16 on CPUs and recent GPUs, fp16 + GradScaler otherwise)."""
    return train_throughput(device, data, MIXED, **kwargs)


def compiled(device, data, **kwargs) -> float:
    """As `mixed_precision` with `torch.compile(model)`; the warm-up steps pay for the compilation."""
    return train_throughput(device, data, COMPILED, **kwargs)


@dataclass(frozen=True)
class Rung:
    name: str
    label: str                    # short, for tables and charts
    measure: Callable[..., float]
    config: LoopConfig            # what `measure` runs (its batch size and precision: `train_step_flops`, MFU)
    cuda_only: bool = False
    compiles: bool = False


RUNGS: tuple[Rung, ...] = (
    Rung("naive", "DataLoader, batch 64,\n.item() every step", naive, NAIVE),
    Rung("no_item_sync", "no .item() per step", no_item_sync, NO_ITEM),
    Rung("pinned_memory", "pinned memory +\nnon_blocking", pinned_memory, PINNED, cuda_only=True),
    Rung("resident_data", "data on the device\n(TensorLoader)", resident_data, RESIDENT),
    Rung("big_batch", "batch 256", big_batch, BIG_BATCH),
    Rung("channels_last", "channels_last", channels_last, CHANNELS_LAST),
    Rung("cudnn_benchmark", "cudnn.benchmark", cudnn_benchmark, CUDNN_BENCHMARK, cuda_only=True),
    Rung("tf32", "TF32 matmuls", tf32, TF32, cuda_only=True),
    Rung("mixed_precision", "mixed precision", mixed_precision, MIXED),
    Rung("compiled", "torch.compile", compiled, COMPILED, compiles=True),
)


@dataclass
class LadderResult:
    """images/s per rung measured in one run, plus the rungs skipped (with why) and any that failed."""
    device: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """Each measured rung's images/s divided by the first measured rung's (the naive loop)."""
        if not self.images_per_s:
            return {}
        base = next(iter(self.images_per_s.values()))
        return {name: value / base for name, value in self.images_per_s.items()}

    def to_dict(self) -> dict:
        return {"device": self.device, "images_per_s": dict(self.images_per_s), "ratios": self.ratios(),
                "labels": {r.name: r.label.replace("\n", " ") for r in RUNGS},
                "skipped": dict(self.skipped), "errors": dict(self.errors)}


def run_ladder(device, data, *, include_compile: bool = True, rounds: int = 1, **kwargs) -> LadderResult:
    """Measure every rung that applies to `device`, in ladder order, in this one run.

    CUDA-only rungs are skipped elsewhere; `include_compile=False` leaves out `torch.compile` (whose
    compilation takes about a minute on a small CPU). With `rounds` > 1 the rungs are measured in
    alternation that many times and each keeps its median, so drift in load affects all alike.
    A rung that compiles and fails is reported in `errors` (torch.compile does not work everywhere);
    other failures are bugs and propagate. `kwargs` go to `train_throughput` (images, repeats, ...).
    """
    device = _device(device)
    result = LadderResult(str(device))
    todo = []
    for rung in RUNGS:
        if rung.cuda_only and device.type != "cuda":
            result.skipped[rung.name] = _("needs a CUDA GPU")
        elif rung.compiles and not include_compile:
            result.skipped[rung.name] = _("left out of this run (compiling takes long on a CPU)")
        else:
            todo.append(rung)
    samples: dict[str, list[float]] = {r.name: [] for r in todo}
    for _i in range(rounds):
        for rung in todo:
            if rung.name in result.errors:
                continue
            try:
                samples[rung.name].append(rung.measure(device, data, **kwargs))
            except Exception as exc:
                if not rung.compiles:
                    raise
                result.errors[rung.name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    for rung in todo:
        if samples[rung.name]:
            result.images_per_s[rung.name] = statistics.median(samples[rung.name])
    return result


def batch_size_sweep(device, data, sizes=(16, 64, 256), *, rounds: int = 1, **kwargs) -> dict[int, float]:
    """{batch size: images/s} of the `resident_data` loop (data on the device, no per-step sync).

    With `rounds` > 1 the sizes are measured in alternation and each keeps its median (see `run_ladder`).
    """
    samples: dict[int, list[float]] = {int(bs): [] for bs in sizes}
    for _i in range(rounds):
        for bs in samples:
            samples[bs].append(train_throughput(device, data, RESIDENT, batch_size=bs, **kwargs))
    return {bs: statistics.median(values) for bs, values in samples.items()}


# --- profiling and the limit -----------------------------------------------------------------

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
    device = _device(device)
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
    """{"conv2, batch 64": GFLOP/s, ...}: the forward pass of each of `CifarCNN`'s convolutions, alone, at each
    batch size, in `precision` (as `matmul_peak_sweep`; under "tf32" cuDNN convolutions follow
    `torch.backends.cudnn.allow_tf32`, True by default). Convolutions and matrix products go through different
    libraries, and one may reach more of the chip than the other: notebook 04 takes the best of both as the peak."""
    if precision not in PRECISIONS:
        raise ValueError(_("precision must be one of {choices}, got {precision!r}").format(choices=PRECISIONS,
                                                                                         precision=precision))
    device = _device(device)
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
                out[f"conv{i}, batch {bs}"] = flops_per_image * bs / m.median / 1e9
    return out


def rung_precision(config: LoopConfig, device) -> str:
    """The precision a config's products and convolutions run in on `device`: "bfloat16" or "float16" under
    mixed precision (the course's choice for the device), "tf32" with `config.tf32` on CUDA, else "float32"."""
    device = _device(device)
    if config.mixed_precision:
        return str(MixedPrecision(device).dtype).removeprefix("torch.")
    if config.tf32 and device.type == "cuda":
        return "tf32"
    return "float32"


def ladder_mfu(images_per_s: dict[str, float], peak_gflops: dict[str, float], device) -> dict[str, dict]:
    """Model FLOPs utilisation of each measured rung: its training FLOP/s (`train_step_flops` at the rung's
    batch size, per image, times images/s) over `peak_gflops[precision]`, the matmul peak measured for the
    precision the rung computes in (`rung_precision`). {rung: {"batch_size", "flops_per_image", "precision",
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


@dataclass
class TimeToAccuracy:
    """One run of `time_to_accuracy`: `history` holds (images trained, training seconds, held-out accuracy) at
    each evaluation; `seconds` and `images` are those of the first evaluation at or above the target."""
    target: float
    batch_size: int
    precision: str
    history: list[tuple[int, float, float]] = field(default_factory=list)
    seconds: float | None = None
    images: int | None = None
    epoch_images: int = 0

    @property
    def reached(self) -> bool:
        return self.seconds is not None

    @property
    def epochs(self) -> float | None:
        return None if self.images is None else self.images / self.epoch_images

    @property
    def images_per_s(self) -> float:
        """Training throughput over the whole run (evaluations not counted)."""
        images, seconds, _accuracy = self.history[-1]
        return images / seconds


def time_to_accuracy(device, train, val, config: LoopConfig = RESIDENT, *, target: float = 0.65,
                     max_epochs: int = 10, eval_every: int = 1024, lr: float = 1e-3, seed: int = 0) -> TimeToAccuracy:
    """Train a fresh `CifarCNN` (Adam, `lr`) on `train` with the data on `device` until its accuracy on `val`
    reaches `target`, or `max_epochs` epochs have passed; return the `TimeToAccuracy`.

    From `config`: the batch size, channels_last and mixed precision (and its CUDA flags). Every `eval_every`
    training images the clock stops (after a synchronize) and the model is evaluated on all of `val`; only
    training time counts.
    """
    device = _device(device)
    if not 0 < target <= 1:
        raise ValueError(_("target must be an accuracy in (0, 1], got {target!r}").format(target=target))
    for name, value in (("max_epochs", max_epochs), ("eval_every", eval_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(_("{name} must be a positive int, got {value!r}").format(name=name, value=value))
    _check_data(train, config.batch_size)
    _check_data(val, 1)
    precision = MixedPrecision(device, enabled=config.mixed_precision)
    result = TimeToAccuracy(target, config.batch_size, str(precision.dtype).removeprefix("torch."))
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    with backend_flags(config, device):
        torch.manual_seed(seed)
        model = CifarCNN().to(device, memory_format=memory_format)
        step = TrainStep(model, torch.optim.Adam(model.parameters(), lr=lr), F.cross_entropy, precision)
        loader = TensorLoader(train.images, train.labels, batch_size=config.batch_size, device=device,
                              drop_last=True, seed=seed)
        val_x = val.images.to(device).contiguous(memory_format=memory_format)
        val_y = val.labels.to(device)
        result.epoch_images = len(loader) * config.batch_size
        images, seconds, next_eval = 0, 0.0, eval_every
        synchronize(device)
        for _i in range(max_epochs):
            t0 = time.perf_counter()
            for x, y in loader:
                step(x.contiguous(memory_format=memory_format), y)
                images += len(y)
                if images < next_eval:
                    continue
                synchronize(device)  # CPU-GPU sync point: the clock stops after the queued steps
                seconds += time.perf_counter() - t0
                next_eval += eval_every
                model.eval()
                with torch.no_grad(), precision.autocast():
                    accuracy = (model(val_x).argmax(1) == val_y).float().mean().item()
                model.train()
                result.history.append((images, seconds, accuracy))
                if accuracy >= target:
                    result.seconds, result.images = seconds, images
                    return result
                t0 = time.perf_counter()
            synchronize(device)
            seconds += time.perf_counter() - t0
    if not result.history or result.history[-1][0] != images:
        result.history.append((images, seconds, float("nan")))
    return result


# --- input pipelines (DataLoader workers) -----------------------------------------------------

@dataclass
class EpochTiming:
    first_batch_s: float  # from asking for the iterator to holding the first batch (includes worker start-up)
    seconds: float        # the whole epoch
    images: int

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def loader_epochs(loader, epochs: int = 2, device=None) -> list[EpochTiming]:
    """Iterate `loader` for `epochs` epochs and time each: time to the first batch, and images/s.

    Pass the `device` a loader's batches live on (a TensorLoader on a GPU) so that each epoch's time
    includes the work queued there, not just its launch.
    """
    out = []
    for _i in range(epochs):
        t0 = time.perf_counter()
        first, images = None, 0
        for _x, y in loader:
            if first is None:
                first = time.perf_counter() - t0
            images += len(y)
        synchronize(device)  # CPU-GPU sync point (a no-op for CPU batches)
        seconds = time.perf_counter() - t0
        if first is None:
            raise ValueError(_("the loader produced no batches"))
        out.append(EpochTiming(first, seconds, images))
    return out
