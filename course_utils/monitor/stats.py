"""What one sample of the machine looks like: the data the sources produce and the panel shows.

A `Snapshot` has three parts, each `None` when its source is unavailable, and each field inside
`None` when that one reading is unsupported (e.g. GPU utilization on a MIG slice):

- `gpu`:   the whole GPU as the NVIDIA driver (NVML) sees it, i.e. every process on it;
- `torch`: this kernel's PyTorch CUDA caching allocator (what *this* notebook holds);
- `host`:  CPU and RAM, measured against the container's limits when there are any.

A leaf module: the sources (`host`, `nvml`, `torch_source`), the `sampler` and the panel import it, and it
imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    kernel_cpu_percent: float | None = None  # of cpu_percent, the share used by this process and its children


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
