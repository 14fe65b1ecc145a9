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

Importing this module touches no device.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .amp import MixedPrecision
from .data import AugmentedImages as AugmentedImages  # re-exported: notebook 03 imports it from here
from .data import TensorLoader
from .models import CifarCNN
from .step import TrainStep
from .timing import measure, synchronize


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a device (try 'cpu', 'cuda' or 'mps')") from exc


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
        raise ValueError(f"n must be a positive int, got {n!r}")
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
    for _ in range(repeats):
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
    mixed_precision: bool = False  # torch.amp autocast in the course's dtype for the device (bf16 / fp16)
    compile: bool = False          # torch.compile(model)


NAIVE = LoopConfig()
NO_ITEM = replace(NAIVE, item_every_step=False)
PINNED = replace(NO_ITEM, pin_memory=True)
RESIDENT = replace(NO_ITEM, resident=True)
BIG_BATCH = replace(RESIDENT, batch_size=256)
CHANNELS_LAST = replace(BIG_BATCH, channels_last=True)
MIXED = replace(CHANNELS_LAST, mixed_precision=True)
COMPILED = replace(MIXED, compile=True)


def _check_data(data, batch_size: int) -> None:
    images, labels = getattr(data, "images", None), getattr(data, "labels", None)
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("data must be a dataset with .images and .labels tensors, e.g. "
                        f"course_utils.data.synthetic_cifar(n); got {type(data).__name__}")
    if tuple(images.shape[1:]) != (3, 32, 32):
        raise ValueError(f"the ladder trains CifarCNN, which needs 3x32x32 images; got {tuple(images.shape[1:])}")
    if len(labels) < batch_size:
        raise ValueError(f"data has {len(labels)} images, fewer than one batch of {batch_size}")


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


def train_throughput(device, data, config: LoopConfig = NAIVE, *, images: int = 512, repeats: int = 3,
                     warmup_steps: int = 2, seed: int = 0, compile_backend: str = "inductor",
                     batch_size: int | None = None) -> float:
    """Images per second of `CifarCNN` training (SGD with momentum) on `data` under `config`.

    `warmup_steps` untimed steps first (they pay for allocation, cuDNN autotuning and compilation),
    then `repeats` timed chunks of about `images` images each, every chunk ending with a synchronize;
    the figure is from the median chunk. Each call builds a fresh model, seeded with `seed`.
    `batch_size`, if given, replaces the config's (tiny test runs use it to keep every step cheap).
    """
    device = _device(device)
    if not isinstance(config, LoopConfig):
        raise TypeError(f"config must be a LoopConfig, got {type(config).__name__}")
    if batch_size is not None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        config = replace(config, batch_size=batch_size)
    if config.pin_memory and device.type != "cuda":
        raise ValueError("pin_memory speeds up copies from the CPU to a CUDA GPU; it does nothing for "
                         f"device {device} (and needs CUDA to allocate pinned memory)")
    for name, value in (("images", images), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
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

    steps = max(1, math.ceil(images / config.batch_size))

    def chunk() -> float:
        if config.item_every_step:
            running = 0.0
            for _ in range(steps):
                running += step().item()  # CPU-GPU sync point here, every step: the naive loop's cost
            return running / steps
        total = torch.zeros((), device=device)
        for _ in range(steps):
            total += step()  # stays on the device: no sync
        return float(total) / steps  # one CPU-GPU sync point per chunk, like reading an epoch's mean loss

    for _ in range(warmup_steps):
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


def mixed_precision(device, data, **kwargs) -> float:
    """As `channels_last` under `torch.amp` autocast (bf16 on CPUs and recent GPUs, fp16 + GradScaler otherwise)."""
    return train_throughput(device, data, MIXED, **kwargs)


def compiled(device, data, **kwargs) -> float:
    """As `mixed_precision` with `torch.compile(model)`; the warm-up steps pay for the compilation."""
    return train_throughput(device, data, COMPILED, **kwargs)


@dataclass(frozen=True)
class Rung:
    name: str
    label: str                    # short, for tables and charts
    measure: Callable[..., float]
    cuda_only: bool = False
    compiles: bool = False


RUNGS: tuple[Rung, ...] = (
    Rung("naive", "DataLoader, batch 64,\n.item() every step", naive),
    Rung("no_item_sync", "no .item() per step", no_item_sync),
    Rung("pinned_memory", "pinned memory +\nnon_blocking", pinned_memory, cuda_only=True),
    Rung("resident_data", "data on the device\n(TensorLoader)", resident_data),
    Rung("big_batch", "batch 256", big_batch),
    Rung("channels_last", "channels_last", channels_last),
    Rung("mixed_precision", "mixed precision", mixed_precision),
    Rung("compiled", "torch.compile", compiled, compiles=True),
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
            result.skipped[rung.name] = "needs a CUDA GPU"
        elif rung.compiles and not include_compile:
            result.skipped[rung.name] = "left out of this run (compiling takes long on a CPU)"
        else:
            todo.append(rung)
    samples: dict[str, list[float]] = {r.name: [] for r in todo}
    for _ in range(rounds):
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
    for _ in range(rounds):
        for bs in samples:
            samples[bs].append(train_throughput(device, data, RESIDENT, batch_size=bs, **kwargs))
    return {bs: statistics.median(values) for bs, values in samples.items()}


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
    for _ in range(epochs):
        t0 = time.perf_counter()
        first, images = None, 0
        for _x, y in loader:
            if first is None:
                first = time.perf_counter() - t0
            images += len(y)
        synchronize(device)  # CPU-GPU sync point (a no-op for CPU batches)
        seconds = time.perf_counter() - t0
        if first is None:
            raise ValueError("the loader produced no batches")
        out.append(EpochTiming(first, seconds, images))
    return out
