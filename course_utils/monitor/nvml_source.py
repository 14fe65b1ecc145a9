"""The whole GPU as the NVIDIA driver reports it, through NVML (read with `course_utils.nvml`).

NVML sees every process on the GPU, unlike PyTorch's allocator which sees only this kernel. Three
things make it fiddly, and are handled here:

- NVML ignores CUDA_VISIBLE_DEVICES, so NVML's device 0 need not be PyTorch's cuda:0. Once this kernel
  has initialised CUDA the two are matched by UUID; before that we identify the GPU only when it is
  unambiguous (one GPU, a UUID in CUDA_VISIBLE_DEVICES, or CUDA_DEVICE_ORDER=PCI_BUS_ID) and otherwise
  say so instead of guessing.
- Any reading can be unsupported (NVMLError_NotSupported): consumer cards without power readings, MIG
  slices without utilization. Each field is tolerated on its own and not asked again.
- On a MIG slice, memory is the slice's; temperature and power are the physical chip's.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from ..i18n import _
from .stats import GpuStats
from .torch_source import cuda_index, torch_device_uuid
from ..nvml import NvmlDevice, device_name, list_devices, load, normalize_uuid, visible_devices
from ..nvml import init_once as nvml_init

__all__ = ["NvmlSource", "normalize_uuid", "nvml_init"]

# Readings that belong to the physical chip: on a MIG slice they are read from the parent GPU.
_CHIP_FIELDS = frozenset({"temperature", "power", "power_limit"})


class NvmlSource:
    """Samples one GPU through NVML: utilization, memory used/total, temperature, power.

    `device` is the CUDA device as PyTorch numbers it (default cuda:0). `nvml` is the NVML binding
    (default: `import pynvml` from nvidia-ml-py), `torch_uuid` a function giving PyTorch's UUID for
    that device or None before CUDA is initialised, and `environ` the environment to read
    CUDA_VISIBLE_DEVICES from; tests pass stand-ins for what a machine without a GPU cannot show.
    """

    def __init__(self, device=None, nvml=None, torch_uuid: Callable[[], str | None] | None = None,
                 environ: dict | None = None):
        self.nvml = load() if nvml is None else nvml
        self.index = cuda_index(device)
        self.reason: str | None = None
        self._environ = os.environ if environ is None else environ
        self._torch_uuid = torch_uuid or (lambda: torch_device_uuid(self.index or 0))
        self._devices: list[NvmlDevice] | None = None
        self._target: NvmlDevice | None = None
        self._match: str | None = None
        self._names: dict[str, str | None] = {}
        self._unsupported: set[str] = set()
        self._from_parent: set[str] = set()

    # --- which NVML device is ours -------------------------------------------------------
    def _resolve(self) -> tuple[NvmlDevice | None, str | None]:
        """(device, how it was matched) or (None, None) with self.reason set."""
        if self._match == "uuid":
            return self._target, self._match  # fixed for good once matched by UUID
        if self._devices is None:
            self._devices = list_devices(self.nvml)
        devices = self._devices
        physical = [d for d in devices if not d.mig]
        wanted = self.index or 0
        torch_uuid = self._torch_uuid()
        if torch_uuid:
            key = normalize_uuid(torch_uuid)
            for d in devices:
                if normalize_uuid(d.uuid) == key:
                    return d, "uuid"
            self.reason = _("PyTorch's cuda:{index} (UUID {uuid}) is not among the GPUs NVML lists").format(
                index=wanted, uuid=torch_uuid)
            return None, None
        cvd = self._environ.get("CUDA_VISIBLE_DEVICES")
        if cvd is not None:
            entries = visible_devices(cvd)  # as PyTorch reads it: indices, or UUID prefixes
            if wanted >= len(entries):
                self.reason = _("CUDA_VISIBLE_DEVICES={value!r} makes no cuda:{index} visible").format(value=cvd,
                                                                                                      index=wanted)
                return None, None
            entry = entries[wanted]
            if isinstance(entry, str):  # CUDA accepts unique UUID prefixes too
                hits = [d for d in devices if d.uuid.lower().startswith(entry.lower())]
                if len(hits) == 1:
                    return hits[0], "cuda-visible-devices"
            elif self._environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":  # CUDA's numbers are then NVML's
                if entry < len(physical) and len(devices) == len(physical):
                    return physical[entry], "cuda-visible-devices"
            elif entry == 0 and len(devices) == 1:
                return devices[0], "only-gpu"
        elif len(devices) == 1 and wanted == 0:
            return devices[0], "only-gpu"
        elif (self._environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" and len(devices) == len(physical)
              and wanted < len(physical)):
            return physical[wanted], "pci-order"  # NVML enumerates in PCI bus order too
        if not devices:
            self.reason = _("NVML lists no GPUs")
        else:
            self.reason = _("{count} GPUs/MIG slices here; which one this kernel uses is known once "
                            "PyTorch has initialised CUDA").format(count=len(devices))
        return None, None

    # --- readings ------------------------------------------------------------------------
    def _read(self, key: str, fn: Callable[[Any], Any], device: NvmlDevice):
        """One reading; None when unsupported (remembered) or failing right now."""
        nv = self.nvml
        if key in self._unsupported:
            return None
        handle = device.parent if key in self._from_parent else device.handle
        try:
            return fn(handle)
        except nv.NVMLError_NotSupported:
            if device.mig and key in _CHIP_FIELDS and key not in self._from_parent:
                self._from_parent.add(key)
                return self._read(key, fn, device)
            self._unsupported.add(key)
        except nv.NVMLError:  # e.g. GPU_IS_LOST, Unknown: try again next time
            pass
        return None

    def sample(self):

        nv = self.nvml
        error = nvml_init(nv)
        if error is not None:
            self.reason = _("NVML is not available ({error})").format(error=error)
            return None
        device, match = self._resolve()
        if device is None:
            return None
        if (device.uuid, match) != (getattr(self._target, "uuid", None), self._match):
            self._unsupported.clear()
            self._from_parent.clear()
        self._target, self._match, self.reason = device, match, None
        if device.uuid not in self._names:
            try:
                self._names[device.uuid] = device_name(nv, device.handle)
            except nv.NVMLError:
                self._names[device.uuid] = None
        memory = self._read("memory", nv.nvmlDeviceGetMemoryInfo, device)
        return GpuStats(
            name=self._names[device.uuid],
            uuid=device.uuid,
            mig=device.mig,
            match=match,
            utilization=self._read("utilization", lambda h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu), device),
            memory_used=int(memory.used) if memory is not None else None,
            memory_total=int(memory.total) if memory is not None else None,
            temperature=self._read("temperature",
                                   lambda h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)), device),
            power=self._read("power", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, device),  # mW -> W
            power_limit=self._read("power_limit", lambda h: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, device),
        )
