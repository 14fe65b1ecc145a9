"""The speed ladder (notebook 04, sections 3-4 and 7): one training loop (`CifarCNN` on CIFAR-shaped images) made
faster one change at a time. Each rung is a `Rung`, called as `rung(device, data, images=..., repeats=...,
warmup_steps=...)` for images per second; `run_ladder` measures them all in one run, `batch_size_sweep` the
resident loop at several batch sizes, `ladder_step` one step of a rung's loop (to profile), and
`time_to_accuracy` the seconds a loop needs to reach a held-out accuracy.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..amp import MixedPrecision
from ..data import TensorLoader
from ..device import as_device
from ..i18n import N_, _
from ..models import CifarCNN
from ..step import TrainStep
from ..timing import measure, synchronize


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
    if as_device(device).type != "cuda" or not (config.cudnn_benchmark or config.tf32):
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
    device = as_device(device)
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
    device = as_device(device)
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


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder: `rung(device, data, **kwargs)` trains its loop (`config`) and returns images per
    second (`train_throughput`; kwargs: images, repeats, warmup_steps, seed, batch_size)."""
    name: str                     # its key, the same in every language (results, reference figures)
    english_label: str            # short, for tables and charts: shown as `label`, in the current language
    config: LoopConfig            # the loop it runs (its batch size and precision: `train_step_flops`, MFU)
    english_doc: str              # what it changes from the rung before: shown as `doc`, in the current language
    cuda_only: bool = False
    compiles: bool = False

    @property
    def label(self) -> str:
        """The short label, for tables and charts, in the current language."""
        return _(self.english_label)

    @property
    def doc(self) -> str:
        """What this rung changes from the one before, in the current language."""
        return _(self.english_doc)

    def __call__(self, device, data, **kwargs) -> float:
        return train_throughput(device, data, self.config, **kwargs)


naive = Rung("naive", N_("DataLoader, batch 64,\n.item() every step"), NAIVE,
             N_("the usual first loop: DataLoader (batch 64, no workers), `.to(device)` per batch, `loss.item()` "
             "every step"))
no_item_sync = Rung("no_item_sync", N_("no .item() per step"), NO_ITEM,
                    N_("the loss summed on the device and read once per chunk instead of every step"))
pinned_memory = Rung("pinned_memory", N_("pinned memory +\nnon_blocking"), PINNED,
                     N_("`pin_memory=True` and `non_blocking=True` copies (CUDA only)"), cuda_only=True)
resident_data = Rung("resident_data", N_("data on the device\n(TensorLoader)"), RESIDENT,
                     N_("the whole dataset copied to the device once; batches come from `TensorLoader` "
                        "(no DataLoader)"))
big_batch = Rung("big_batch", N_("batch 256"), BIG_BATCH, N_("batch 256: fewer, larger steps"))
channels_last = Rung("channels_last", "channels_last", CHANNELS_LAST,
                     N_("model and inputs in channels_last (NHWC) memory format"))
cudnn_benchmark = Rung("cudnn_benchmark", "cudnn.benchmark", CUDNN_BENCHMARK,
                       N_("`torch.backends.cudnn.benchmark = True` (CUDA only): cuDNN times its convolution algorithms "
                       "for each new input shape (during the warm-up steps) and keeps the fastest"), cuda_only=True)
tf32 = Rung("tf32", N_("TF32 matmuls"), TF32,
            N_("`torch.set_float32_matmul_precision('high')` (CUDA only): float32 matmuls run on TF32 tensor cores "
            "(Ampere and newer); cuDNN convolutions may use TF32 already (`torch.backends.cudnn.allow_tf32`)"),
            cuda_only=True)
mixed_precision = Rung("mixed_precision", N_("mixed precision"), MIXED,
                       N_("`torch.amp` autocast (bf16 on CPUs and recent GPUs, fp16 + GradScaler otherwise)"))
compiled = Rung("compiled", "torch.compile", COMPILED,
                N_("`torch.compile(model)`; the warm-up steps pay for the compilation"), compiles=True)

# in ladder order: each rung adds its one change to the one before (pinned_memory is a side step from no_item_sync)
RUNGS: tuple[Rung, ...] = (naive, no_item_sync, pinned_memory, resident_data, big_batch, channels_last,
                           cudnn_benchmark, tf32, mixed_precision, compiled)


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
                "labels": {r.name: r.english_label.replace("\n", " ") for r in RUNGS},  # data: English
                "skipped": dict(self.skipped), "errors": dict(self.errors)}


def run_ladder(device, data, *, include_compile: bool = True, rounds: int = 1, **kwargs) -> LadderResult:
    """Measure every rung that applies to `device`, in ladder order, in this one run.

    CUDA-only rungs are skipped elsewhere; `include_compile=False` leaves out `torch.compile` (whose
    compilation takes about a minute on a small CPU). With `rounds` > 1 the rungs are measured in
    alternation that many times and each keeps its median, so drift in load affects all alike.
    A rung that compiles and fails is reported in `errors` (torch.compile does not work everywhere);
    other failures are bugs and propagate. `kwargs` go to `train_throughput` (images, repeats, ...).
    """
    device = as_device(device)
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
                samples[rung.name].append(rung(device, data, **kwargs))
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
    device = as_device(device)
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
