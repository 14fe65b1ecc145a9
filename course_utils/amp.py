"""Automatic mixed precision (AMP) with `torch.amp`, chosen per device.

- `choose_dtype(device)`: bfloat16 on CPUs and on CUDA GPUs with native bf16 (Ampere and newer),
  float16 on older CUDA GPUs and on Apple MPS.
- `autocast(device, dtype="auto")`: the matching `torch.amp.autocast` context.
- `MixedPrecision(device, dtype)`: one of three classes with the same calls, chosen once (`Float32`, `Autocast`
  for bf16, `ScaledFloat16` with a `GradScaler`): `autocast()`, `backward(loss)`, `unscale_(optimizer)`,
  `step(optimizer)`. `precision_for(option, device)` turns the Trainer's `mixed_precision=` into one.
  `train_step` runs one `course_utils.step.TrainStep` with it (clipping lives there).
- `autocast_dtype_table(device)` and `underflow_fraction(grads)`: measurements for the notebook.

Only the device-generic `torch.amp` API is used; the old `torch.cuda.amp` names are deprecated.
Importing this module touches no device.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, ContextManager, NamedTuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from .device import as_device
from .i18n import _
from .step import TrainStep

DeviceLike = Union[str, torch.device]
DtypeLike = Union[str, torch.dtype]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
_LOW = (torch.bfloat16, torch.float16)


# --- choosing the dtype ------------------------------------------------------------------

def choose_dtype(device: DeviceLike) -> torch.dtype:
    """The autocast dtype the course uses on `device`.

    CPU: bfloat16 (same exponent range as float32, so no loss scaling is needed).
    CUDA: bfloat16 when the GPU does bf16 natively (compute capability 8.0+, or ROCm), else float16;
    emulated bf16 on older GPUs is slower than fp16, so it does not count. The question is asked of
    `device`'s index when it has one, else of the current CUDA device.
    MPS: float16. MPS autocast gained bf16 later and only on macOS 14+; fp16 works everywhere.
    """
    dev = as_device(device)
    if dev.type == "cpu":
        return torch.bfloat16
    if dev.type == "cuda":
        if dev.index is not None:
            with torch.cuda.device(dev.index):
                native = torch.cuda.is_bf16_supported(including_emulation=False)
        else:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    if dev.type == "mps":
        return torch.float16
    raise ValueError(_("no automatic mixed-precision dtype for device type {type!r}; "
                       "pass dtype=torch.bfloat16 or torch.float16 explicitly").format(type=dev.type))


def resolve_dtype(device: DeviceLike, dtype: DtypeLike = "auto") -> torch.dtype:
    """`dtype` as a torch.dtype: "auto" asks `choose_dtype`; names like "bf16"/"fp16"/"fp32" are accepted."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key == "auto":
            return choose_dtype(device)
        if key not in _DTYPE_NAMES:
            raise ValueError(_("unknown dtype {dtype!r}; use 'auto', one of {names}, or a torch.dtype").format(
                dtype=dtype, names=sorted(_DTYPE_NAMES)))
        return _DTYPE_NAMES[key]
    if isinstance(dtype, torch.dtype):
        if dtype not in (*_LOW, torch.float32):
            raise ValueError(_("mixed precision runs in torch.bfloat16 or torch.float16 (or torch.float32 for "
                               "none), not {dtype}").format(dtype=dtype))
        return dtype
    raise TypeError(_("dtype must be 'auto', a name or a torch.dtype, got {type}").format(type=type(dtype).__name__))


def _check_usable(dev: torch.device) -> None:
    """Fail early with a clear message instead of torch's 'Disabling autocast' warning later."""
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(_("device {device} asked for, but CUDA is not available here; "
                           "use course_utils.device.get_device() to pick an available device").format(device=dev))
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(_("device {device} asked for, but Apple MPS is not available on this machine").format(device=dev))
    if not torch.amp.is_autocast_available(dev.type):
        raise ValueError(_("torch has no autocast for device type {type!r}").format(type=dev.type))


def autocast(device: DeviceLike, dtype: DtypeLike = "auto") -> ContextManager:
    """`torch.amp.autocast` for `device` in `dtype` ("auto": `choose_dtype`); float32 gives a no-op context."""
    dev = as_device(device)
    _check_usable(dev)
    low = resolve_dtype(dev, dtype)
    if low == torch.float32:
        return contextlib.nullcontext()
    return torch.amp.autocast(dev.type, dtype=low)


# --- the training-step protocol ----------------------------------------------------------

def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """The inf/nan flag `scaler.unscale_(optimizer)` just computed, as a device tensor (no sync).

    Reads GradScaler's per-optimizer record (a private attribute, stable since torch 1.6). Returns
    None if that record cannot be found, so the caller can fall back to the public (slower) way.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict) or id(optimizer) not in states:
        return None
    flags = states[id(optimizer)].get("found_inf_per_device")
    if not isinstance(flags, dict):
        return None
    if not flags:
        raise RuntimeError(_("no gradients found for this optimizer: call backward(loss) before step()"))
    total = None
    for flag in flags.values():
        flag = flag.to(scaler._scale.device, non_blocking=True) if scaler._scale is not None else flag
        total = flag if total is None else total + flag
    return total


_NO_AUTOCAST = contextlib.nullcontext()  # float32's context: one reusable object, nothing built per step


class MixedPrecision:
    """Autocast, loss scaling and the optimizer step for one device, behind four calls.

        precision = MixedPrecision(device)            # bf16 on CPU / Ampere+, fp16 (+ GradScaler) otherwise
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)
        precision.unscale_(optimizer)                 # gradients in true units (clip or inspect them here)
        applied = precision.step(optimizer)           # False if a float16 step was skipped

    `MixedPrecision(device, dtype, enabled)` builds the class that fits, once: `Float32` (enabled=False or dtype
    float32: no autocast, no scaling; every call does the plain thing), `Autocast` (bfloat16: autocast only, no scaling
    needed) or `ScaledFloat16` (float16 with a `GradScaler`, built with the device type
    named: a bare `GradScaler()` means CUDA and silently disables itself on machines without it). The three have
    the same methods, so a loop calls them without asking which one it has. Clipping and the gradient norm belong
    to the step that calls them (`course_utils.step.TrainStep`), after `unscale_`.
    """

    scaler: torch.amp.GradScaler | None = None  # only ScaledFloat16 has one
    enabled = False  # whether autocast is on

    def __new__(cls, device: DeviceLike | None = None, dtype: DtypeLike = "auto", enabled: bool = True, **kwargs):
        if cls is MixedPrecision:  # choose the class once, from the device and dtype
            cls = {torch.float32: Float32, torch.float16: ScaledFloat16}.get(_dtype_for(device, dtype, enabled),
                                                                            Autocast)
        return super().__new__(cls)

    def __init__(self, device: DeviceLike, dtype: DtypeLike = "auto", enabled: bool = True, *,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.device = as_device(device)
        self.dtype = _dtype_for(self.device, dtype, enabled)
        self.skipped_steps = 0  # optimizer steps a GradScaler skipped because of inf/nan gradients

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, dtype={self.dtype})"

    def autocast(self) -> ContextManager:
        """The context for the forward pass and loss: a fresh autocast context, or nothing in float32."""
        return _NO_AUTOCAST

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` (the loss multiplied by the scale first, under ScaledFloat16)."""
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Put `optimizer`'s gradients in true units, in place, before clipping or inspecting them. Only
        ScaledFloat16 has anything to do; twice before a step does nothing the second time."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`optimizer.step()`; returns False if the step was skipped (only a GradScaler skips), with no sync."""
        optimizer.step()
        return True

    def reset(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget a half-done step (after an error between backward and step, e.g. out of memory)."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the dtype and the scaler's scale/growth tracker (reading them syncs once)."""
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler state saved by `state_dict()`.
        A checkpoint without scaler state (a bf16 or fp32 run) leaves a fresh scaler; scaler state
        loaded into a run without a scaler (an fp16 checkpoint resumed in bf16) is not needed and dropped.
        """
        if not isinstance(state, dict) or "scaler" not in state or not isinstance(state["scaler"], dict):
            raise ValueError(_("not a MixedPrecision state: expected a dict from MixedPrecision.state_dict() "
                               "with a 'scaler' entry"))
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])


def _dtype_for(device: DeviceLike, dtype: DtypeLike, enabled: bool) -> torch.dtype:
    """The dtype a MixedPrecision runs in; checks the device can run it."""
    dev = as_device(device)
    _check_usable(dev)
    if enabled:
        return resolve_dtype(dev, dtype)
    resolve_dtype(dev, "fp32" if dtype == "auto" else dtype)  # still reject bad names
    return torch.float32


class Float32(MixedPrecision):
    """No mixed precision: float32 behind the same calls, each doing the plain thing."""


class Autocast(MixedPrecision):
    """Autocast to bfloat16 (same exponent range as float32: no loss scaling needed)."""

    enabled = True

    def autocast(self) -> ContextManager:
        return torch.amp.autocast(self.device.type, dtype=self.dtype)


class ScaledFloat16(Autocast):
    """Autocast to float16 with a `GradScaler`: the loss is scaled up before backward so that small gradients
    do not underflow, the gradients are scaled back down before the step, and steps with inf/nan gradients are
    skipped (the scale then backs off)."""

    def __init__(self, device: DeviceLike, dtype: DtypeLike = "auto", enabled: bool = True, *,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        super().__init__(device, dtype, enabled)
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale, growth_interval=growth_interval)
        self._unscaled: set[int] = set()  # ids of optimizers whose gradients unscale_ divided already

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            return
        if self.scaler._scale is None:  # scale() was never called: no scaled backward happened
            raise RuntimeError(_("step() before any backward(loss): call precision.backward(loss) first"))
        self.scaler.unscale_(optimizer)  # grads /= scale in place and inf/nan flag on the device; no sync
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if `unscale_` was not called already), step and update the scale; False if the step was
        skipped. The answer costs one CPU-GPU sync, the same one `GradScaler.step` makes for ordinary
        optimizers: it must know on the CPU whether to call `optimizer.step()`. We read the inf/nan flag
        computed by `unscale_` first (sync), then `scaler.step` reads the same flag again with nothing new
        queued, so it waits for nothing. (Comparing `get_scale()` before and after would cost two syncs, the
        second one after the optimizer step.) Fused optimizers (`Adam(fused=True)`) normally skip on the GPU
        with no sync; asking for this bool adds one."""
        self.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        scaler = self.scaler
        found = _found_inf(scaler, optimizer)
        if found is not None:
            skipped = bool(found.item())  # CPU-GPU sync point here (GradScaler.step makes it anyway)
            scaler.step(optimizer)  # skips optimizer.step() on inf/nan; its own .item() now waits for nothing
            scaler.update()  # backs the scale off after a skip, grows it after growth_interval good steps
        else:  # GradScaler internals changed: public fallback, two syncs
            before = scaler.get_scale()  # CPU-GPU sync point here
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < before  # sync again; the scale only shrinks after a skip
        self.skipped_steps += skipped
        return not skipped

    def reset(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget a half-done step: the next backward starts a new step. The scale itself is kept."""
        self._unscaled.discard(id(optimizer))
        self.scaler._per_optimizer_states.pop(id(optimizer), None)


def precision_for(mixed_precision: Union[bool, str, torch.dtype, MixedPrecision, None],
                  device: DeviceLike) -> MixedPrecision:
    """The Trainer's `mixed_precision=` option as a MixedPrecision: False or None float32 (the same calls, doing
    nothing extra), True "auto", a dtype or its name, or a MixedPrecision as it is."""
    if isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if mixed_precision is False or mixed_precision is None:
        return MixedPrecision(device, enabled=False)
    return MixedPrecision(device, "auto" if mixed_precision is True else mixed_precision)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               inputs: torch.Tensor, targets: torch.Tensor, precision: MixedPrecision,
               clip_grad_norm: float | None = None) -> torch.Tensor:
    """One optimizer step under `precision` (a `course_utils.step.TrainStep`); returns the loss, detached and
    still on the device. In a loop, build the `TrainStep` once and call it instead."""
    return TrainStep(model, optimizer, loss_fn, precision, grad_clip=clip_grad_norm)(inputs, targets)


# --- measurements for the notebook -------------------------------------------------------

class OpDtypes(NamedTuple):
    """Output dtype of one op under autocast, for float32 inputs and for low-precision inputs.

    None means the op refused that input on this device.
    """
    from_fp32: torch.dtype | None
    from_low: torch.dtype | None


def _op_table(x: torch.Tensor, img: torch.Tensor, p: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Ops fed activations `x` (N, 16) / `img` (N, 3, 8, 8) and float32 parameters `p`, as in a model."""
    targets = p["targets"]
    return {
        "matmul": lambda: x @ x.T,
        "linear": lambda: F.linear(x, p["w"], p["b"]),
        "conv2d": lambda: F.conv2d(img, p["k"]),
        "relu": lambda: F.relu(x),
        "gelu": lambda: F.gelu(x),
        "max_pool2d": lambda: F.max_pool2d(img, 2),
        "add": lambda: x + x,
        "exp": lambda: torch.exp(x),
        "sum": lambda: x.sum(),
        "mean": lambda: x.mean(),
        "softmax": lambda: F.softmax(x, dim=1),
        "log_softmax": lambda: F.log_softmax(x, dim=1),
        "layer_norm": lambda: F.layer_norm(x, (16,), p["ln_w"], p["ln_b"]),
        "batch_norm": lambda: F.batch_norm(img, p["bn_mean"], p["bn_var"], p["bn_w"], p["bn_b"], training=True),
        "cross_entropy": lambda: F.cross_entropy(x, targets),
        "mse_loss": lambda: F.mse_loss(x, x.flip(0)),
    }


def autocast_dtype_table(device: DeviceLike, dtype: DtypeLike = "auto") -> dict[str, OpDtypes]:
    """Run common ops under autocast on `device` and report the dtype each one actually produced.

    Measured, not looked up: autocast's op lists differ between CPU, CUDA and MPS and across torch
    versions. Each op runs twice: on float32 activations (the model's input) and on activations
    already in the low dtype (what follows a matmul). Parameters stay float32, as in a module.
    """
    dev = as_device(device)
    _check_usable(dev)
    low = resolve_dtype(dev, dtype)
    if low == torch.float32:
        raise ValueError(_("autocast_dtype_table needs a low-precision dtype (bf16 or fp16), not float32"))
    gen = torch.Generator().manual_seed(0)  # CPU generator, then moved: same numbers on every device

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev)

    x, img = rand(8, 16), rand(4, 3, 8, 8)
    params = {"w": rand(4, 16), "b": rand(4), "k": rand(5, 3, 3, 3), "ln_w": rand(16), "ln_b": rand(16),
              "bn_mean": torch.zeros(3, device=dev), "bn_var": torch.ones(3, device=dev),
              "bn_w": rand(3), "bn_b": rand(3), "targets": torch.arange(8, device=dev) % 16}
    results: dict[str, list[torch.dtype | None]] = {}
    for inputs_dtype in (torch.float32, low):
        ops = _op_table(x.to(inputs_dtype), img.to(inputs_dtype), params)
        with torch.amp.autocast(dev.type, dtype=low):
            for name, op in ops.items():
                try:
                    out_dtype = op().dtype
                except (RuntimeError, NotImplementedError):
                    out_dtype = None
                results.setdefault(name, []).append(out_dtype)
    return {name: OpDtypes(*pair) for name, pair in results.items()}


def underflow_fraction(grads: torch.Tensor | Iterable[torch.Tensor | None],
                       dtype: DtypeLike = torch.float16, scale: float = 1.0) -> float:
    """Fraction of the nonzero gradient values that become exactly 0 when cast to `dtype`.

    `grads`: a tensor or an iterable of tensors (None entries, e.g. `p.grad` of unused parameters,
    are skipped). `scale` multiplies the values first, as loss scaling would, to show how many it
    rescues. Values are counted in float32. Returns 0.0 when no value is nonzero. One sync at the end.
    """
    target = resolve_dtype("cpu", dtype)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(_("scale must be a positive number, got {scale!r}").format(scale=scale))
    tensors = [grads] if isinstance(grads, torch.Tensor) else [g for g in grads if g is not None]
    if not tensors:
        raise ValueError(_("no gradients given (all None?): run loss.backward() and pass [p.grad for p in "
                           "model.parameters()]"))
    nonzero = lost = None
    for g in tensors:
        if not isinstance(g, torch.Tensor) or not g.is_floating_point():
            raise TypeError(_("gradients must be floating-point tensors, got {type}").format(
                type=getattr(g, "dtype", type(g))))
        values = g.detach().float()
        if scale != 1.0:
            values = values * scale
        nz = values != 0
        gone = nz & (values.to(target) == 0)
        n, k = nz.sum(), gone.sum()
        nonzero = n if nonzero is None else nonzero + n.to(nonzero.device)
        lost = k if lost is None else lost + k.to(lost.device)
    total = int(nonzero)  # CPU-GPU sync point here (once, for all tensors)
    return 0.0 if total == 0 else int(lost) / total
