"""What one sample of the machine looks like, and the `Sampler` that takes it.

A `Snapshot` has three parts, each `None` when its source is unavailable, and each field inside
`None` when that one reading is unsupported (e.g. GPU utilization on a MIG slice):

- `gpu`:   the whole GPU as the NVIDIA driver (NVML) sees it, i.e. every process on it;
- `torch`: this kernel's PyTorch CUDA caching allocator (what *this* notebook holds);
- `host`:  CPU and RAM, measured against the container's limits when there are any.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from ..i18n import N_, _


@dataclass(frozen=True)
class GpuStats:
    """One GPU (or MIG slice) as NVML reports it: all processes, not only this kernel."""
    name: str | None
    uuid: str | None
    mig: bool                    # a MIG slice: utilization is unsupported, temperature/power are the chip's
    match: str                   # how it was identified: "uuid", "only-gpu", "cuda-visible-devices", "pci-order"
    utilization: float | None    # percent of the last sample period in which a kernel ran
    memory_used: int | None      # bytes
    memory_total: int | None     # bytes
    temperature: float | None    # degrees Celsius
    power: float | None          # watts
    power_limit: float | None    # watts (enforced limit)


@dataclass(frozen=True)
class TorchStats:
    """This kernel's PyTorch caching allocator on one CUDA device."""
    device: str          # e.g. "cuda:0"
    allocated: int       # bytes in live tensors
    reserved: int        # bytes the caching allocator holds (allocated + cached free blocks)
    peak: int            # highest `allocated` since start or the last reset_peak_memory_stats()
    total: int | None    # the device's memory size in bytes


@dataclass(frozen=True)
class HostStats:
    """CPU and RAM of the machine, or of the container when it has limits."""
    cpu_percent: float | None  # busy share of the CPUs this process may use, 0-100
    cpu_count: float           # CPUs this process may use (container quota / affinity)
    cpu_limited: bool          # cpu_count comes from a container quota
    ram_used: int              # bytes
    ram_total: int             # bytes
    ram_limited: bool          # ram_total is a container limit, not the machine's RAM
    process_rss: int | None    # bytes resident in this process (the kernel itself)


@dataclass(frozen=True)
class Snapshot:
    """One sample. `notes` says, in words, why a part is missing."""
    time: float                # time.time() when taken
    gpu: GpuStats | None
    torch: TorchStats | None
    host: HostStats | None
    notes: tuple[str, ...] = ()


class Source(Protocol):
    """A sampler source: `sample()` returns its stats or None; `reason` says why it returned None."""
    reason: str | None

    def sample(self): ...


class Sampler:
    """Takes `Snapshot`s from up to three sources.

    Each argument is True (use the default source), False/None (leave it out) or a source object.
    `sample()` never initialises CUDA; unexpected errors inside a source propagate (the monitor's
    thread then stops and shows the error) while expected unavailability gives `None` plus a note.
    """

    def __init__(self, nvml: bool | Source | None = True, torch: bool | Source | None = True,
                 host: bool | Source | None = True, device=None):
        from .host import HostSource
        from .nvml import NvmlSource
        from .torch_source import TorchSource

        self.nvml = _pick(nvml, lambda: NvmlSource(device=device))
        self.torch = _pick(torch, lambda: TorchSource(device=device))
        self.host = _pick(host, HostSource)

    def sample(self) -> Snapshot:
        notes = []
        parts = []
        for label, source in ((N_("GPU (NVML)"), self.nvml), (N_("PyTorch"), self.torch), (N_("host"), self.host)):
            stats = source.sample() if source is not None else None
            if stats is None and source is not None and source.reason:
                notes.append(_("{label}: {reason}").format(label=_(label), reason=source.reason))
            parts.append(stats)
        return Snapshot(time.time(), parts[0], parts[1], parts[2], tuple(notes))


def _pick(arg, default):
    if arg is True:
        return default()
    if arg is False or arg is None:
        return None
    if not callable(getattr(arg, "sample", None)):
        raise TypeError(_("a sampler source must be True, False or an object with a sample() method, got {arg!r}"
                          ).format(arg=arg))
    return arg
