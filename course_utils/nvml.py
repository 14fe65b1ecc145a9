"""The one place that talks to NVML, the NVIDIA driver's management library (`nvidia-ml-py`, imported as
`pynvml`). Used by the environment diagnosis (`course_utils.environment`) and by the live monitor
(`course_utils.monitor.nvml_source`).

- `load()`: the binding; raises ImportError when nvidia-ml-py is missing.
- `init_once(nvml)`: initialise NVML for the rest of the process (the monitor samples every second);
  success or the error text is cached, so a missing driver is not asked again every second.
- `session(nvml)`: an init/shutdown pair around a block, for a one-off question.
- `driver_version`, `cuda_driver_version`, `list_devices` (physical GPUs and MIG slices), `device_name`.
- `normalize_uuid`: NVML's and PyTorch's spellings of a GPU's UUID made comparable.
- `visible_devices`: the GPUs a CUDA_VISIBLE_DEVICES value names (indices or UUID prefixes), read as PyTorch does.

NVML reference-counts nvmlInit/nvmlShutdown, so a `session` does not pull the library out from under
`init_once`. Every function takes the binding as `nvml` so that tests can pass a stand-in for what a
machine without an NVIDIA GPU cannot show. Importing this module loads and initialises nothing.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NvmlDevice", "cuda_driver_version", "device_name", "driver_version", "init_once", "list_devices", "load",
    "normalize_uuid", "session", "text", "visible_devices",
]

_INIT_LOCK = threading.Lock()
_INIT_RESULTS: dict[int, tuple[Any, str | None]] = {}  # id(binding) -> (binding, None or error text)


def load():
    """The NVML binding (`import pynvml`, from nvidia-ml-py; importing it only defines ctypes wrappers)."""
    import pynvml

    return pynvml


def _error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def init_once(nvml) -> str | None:
    """Initialise NVML once per process and leave it initialised; None on success, else the error text.

    The outcome is cached per binding: a failure (LibraryNotFound, DriverNotLoaded, NoPermission, ...)
    is not retried. Errors that are not NVML's propagate.
    """
    with _INIT_LOCK:
        key = id(nvml)
        if key not in _INIT_RESULTS:
            try:
                nvml.nvmlInit()
                _INIT_RESULTS[key] = (nvml, None)
            except nvml.NVMLError as exc:
                _INIT_RESULTS[key] = (nvml, _error_text(exc))
        return _INIT_RESULTS[key][1]


@contextmanager
def session(nvml) -> Iterator[str | None]:
    """`with session(nvml) as error:` NVML is initialised inside the block when `error` is None (and shut
    down after it); otherwise `error` says why it could not be. Never raises for NVML's own reasons."""
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, a broken library, ...
        yield _error_text(exc)
        return
    try:
        yield None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def text(value) -> str:
    """NVML strings are bytes in older bindings, str in newer ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_uuid(uuid: str | bytes) -> str:
    """'GPU-8a1f…' / 'MIG-…' (NVML) and '8a1f…' (PyTorch) to one comparable form: lower case, no prefix."""
    value = text(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if value.startswith(prefix):
            return value[len(prefix):]
    return value


def driver_version(nvml) -> str | None:
    """The driver's version, e.g. '550.54.14'; None when the driver does not say."""
    try:
        return text(nvml.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def cuda_driver_version(nvml) -> tuple[int, int] | None:
    """The highest CUDA version the driver supports, as (major, minor); None when it does not say."""
    try:
        v = int(nvml.nvmlSystemGetCudaDriverVersion())
    except Exception:
        return None
    return v // 1000, (v % 1000) // 10


@dataclass
class NvmlDevice:
    """A GPU or MIG slice as NVML lists it."""
    handle: Any
    uuid: str              # as NVML gives it, e.g. "GPU-…" or "MIG-…"
    index: int | None      # NVML index of a physical GPU; None for a MIG slice
    parent: Any = None     # the physical GPU's handle, for a MIG slice

    @property
    def mig(self) -> bool:
        return self.parent is not None


def list_devices(nvml, mig: bool = True) -> list[NvmlDevice]:
    """The physical GPUs in NVML's order (which ignores CUDA_VISIBLE_DEVICES), each followed by its MIG
    slices when MIG is enabled on it (`mig=False`: physical GPUs only). NVML errors propagate, except
    "MIG not supported" and empty MIG slots."""
    devices = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        devices.append(NvmlDevice(handle, text(nvml.nvmlDeviceGetUUID(handle)), i))
        if not mig:
            continue
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:  # NotSupported on GPUs without MIG
            continue
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            continue
        for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                slice_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            except nvml.NVMLError:  # NotFound: an empty slot
                continue
            devices.append(NvmlDevice(slice_handle, text(nvml.nvmlDeviceGetUUID(slice_handle)), None, parent=handle))
    return devices


def device_name(nvml, handle) -> str:
    """The product name of a device handle, e.g. 'NVIDIA GeForce RTX 3060'. NVML errors propagate."""
    return text(nvml.nvmlDeviceGetName(handle))


def compute_capability(nvml, handle) -> tuple[int, int] | None:
    """(major, minor) of a device handle, e.g. (8, 6) for an RTX 3060; None if NVML cannot tell."""
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:
        return None
    return int(major), int(minor)


def visible_devices(value: str) -> list[int] | list[str]:
    """What a CUDA_VISIBLE_DEVICES value names, read as PyTorch reads it (`torch.cuda._parse_visible_devices`, which
    follows CUDA's rules): GPU indices, or UUID prefixes ("GPU-…", "MIG-…"). An entry that is not a number (or a
    negative one) ends the list, as does, for UUIDs, one without the first entry's prefix; a repeated entry hides
    everything. "" and "-1" name nothing. Where torch's own parse raises ValueError (a lone sign such as "+", or a
    character that is a digit to Python but not a decimal one, such as "²"), the entry is read as not a number."""
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            named: list[str] = []
            for entry in value.split(","):
                if entry in named:
                    return []
                if not entry.startswith(prefix):
                    break
                named.append(entry)
            return named
    indices: list[int] = []
    for entry in value.split(","):
        digits = re.match(r"[+-]?\d*", entry.strip()).group()  # like C's strtoul: "1gpu" is 1, "gpu" is nothing
        index = int(digits) if digits.lstrip("+-") else -1
        if index in indices:
            return []
        if index < 0:
            break
        indices.append(index)
    return indices
