"""Live device monitoring and training progress for notebooks.

- `Sampler` (with `NvmlSource`, `TorchSource`, `HostSource`): one `Snapshot` of the GPU as NVML sees
  it (every process on it), this kernel's PyTorch allocator, and the host's CPU and RAM (container
  limits respected). Each source is optional; whatever is unavailable is `None`.
- `DeviceMonitor`: an ipywidgets panel fed by that sampler from a daemon thread about once a second,
  so it keeps updating while a training cell runs. `with DeviceMonitor(): ...`, or `start()`/`stop()`.
- `TrainingProgress`: a `Trainer` callback (or a standalone object) showing a progress bar with rate
  and time left plus a live loss curve, redrawn from its own thread.

Importing this package starts nothing, initialises neither CUDA nor NVML and imports no widgets;
that happens when a monitor is created or started.
"""
from .host import CgroupLimits, HostSource, read_cgroup_limits
from .nvml_source import NvmlSource
from .panel import DeviceMonitor
from .progress import TrainingProgress
from .sampler import Sampler
from .stats import GpuStats, HostStats, Snapshot, TorchStats
from .torch_source import TorchSource

__all__ = [
    "CgroupLimits", "DeviceMonitor", "GpuStats", "HostSource", "HostStats", "NvmlSource", "Sampler",
    "Snapshot", "TorchSource", "TorchStats", "TrainingProgress", "read_cgroup_limits",
]
