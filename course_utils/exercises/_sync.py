"""Counting host reads: every operation that brings a device tensor's value to the CPU.

On a GPU each of them makes the CPU wait until the GPU has finished everything queued so far (a CPU-GPU sync).
Checkers hand the learner's code `DeviceTensor`s, tensors that stand for values on the device, and count:

    with HostReads() as reads:
        answer(...)
    reads.total, reads.counts   # e.g. 5, Counter({"float()": 4, ".item()": 1})

Counted: `.item()`, `float()`, `int()`, `bool()` (an `if` on a tensor), `.tolist()`, `.numpy()` and NumPy
conversion, `.cpu()`, `.to("cpu")` (a `torch.device` or tensor target is taken for the model's device, where the
data already is), `copy_` into a CPU tensor, `in`, printing
and formatting (`print`, `str`, f-strings), and `torch.tensor([...])` of device values (a `float()` each). What
a read returns is an ordinary tensor or number: reading it again costs nothing, as on a real GPU.
"""
from __future__ import annotations

from collections import Counter

import torch

from ..i18n import N_, _

# The labels are the keys of HostReads.counts (English); describe() shows them translated.
_LABELS = {
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()",
    torch.Tensor.__array__: N_("a NumPy conversion"), torch.Tensor.__float__: "float()",
    torch.Tensor.__int__: "int()", torch.Tensor.__index__: "int()", torch.Tensor.__complex__: "complex()",
    torch.Tensor.__bool__: N_("bool() (an if)"), torch.Tensor.__contains__: "`in`",
    torch.Tensor.__repr__: N_("print() or str()"), torch.Tensor.__format__: N_("formatting (an f-string)"),
    torch.Tensor.cpu: ".cpu()",
}

_active: list["HostReads"] = []


def _is_host(device) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (TypeError, RuntimeError):
        return False


def _label(func, args, kwargs) -> str | None:
    label = _LABELS.get(func)
    if label is not None:
        return label
    if func is torch.Tensor.to:
        targets = list(args[1:]) + [kwargs.get("device")]
        for target in targets:
            # A torch.device is what device-agnostic code gets from the model (next(model.parameters()).device):
            # in these checks that is where the data already is. A device named in a string is an explicit move.
            if isinstance(target, str) and _is_host(target):
                return ".to('cpu')"
        return None
    if func is torch.Tensor.copy_ and len(args) > 1:
        if not isinstance(args[0], DeviceTensor) and isinstance(args[1], DeviceTensor):
            return N_("copy_ into a CPU tensor")
    return None


class DeviceTensor(torch.Tensor):
    """A tensor that stands for one on the GPU: operations on it stay "on the device" (their results are
    DeviceTensors too); each operation that brings its value to the host is counted by the active HostReads."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        label = _label(func, args, kwargs)
        if label is None:
            return super().__torch_function__(func, types, args, kwargs)
        for reads in _active:
            reads.counts[label] += 1
        # The read itself runs on ordinary tensors, so that what it returns is ordinary too.
        args = tuple(a.as_subclass(torch.Tensor) if isinstance(a, DeviceTensor) else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def on_device(t: torch.Tensor) -> DeviceTensor:
    """`t` as a DeviceTensor (the same data, still attached to autograd)."""
    return t.as_subclass(DeviceTensor)


class HostReads:
    """Counts host reads of DeviceTensors while active."""

    def __init__(self):
        self.counts: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        return ", ".join(f"{_(label)} x{n}" for label, n in self.counts.most_common())

    def __enter__(self) -> "HostReads":
        _active.append(self)
        return self

    def __exit__(self, *exc) -> bool:
        _active.remove(self)
        return False
