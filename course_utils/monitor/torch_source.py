"""This kernel's PyTorch CUDA allocator: allocated, reserved and peak bytes.

Read without ever initialising CUDA: until this process has used CUDA (`torch.cuda.is_initialized()`),
the source reports nothing. Initialising CUDA from a monitor would grab GPU memory for a context and
could pick the wrong device before the notebook has chosen one.
"""
from __future__ import annotations

import torch

from ..i18n import _
from .stats import TorchStats


def cuda_index(device) -> int | None:
    """The CUDA device index named by `device` (int, "cuda", "cuda:1", torch.device), None for "the default".

    Raises ValueError for a non-CUDA device or a negative index. Touches no CUDA state.
    """
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError(_("device must be a CUDA device index, 'cuda:N' or a torch.device, got {device!r}").format(
            device=device))
    if isinstance(device, int):
        index = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(_("device must be a CUDA device index, 'cuda:N' or a torch.device, got {device!r}").format(
            device=device)) from exc
        if dev.type != "cuda":
            raise ValueError(_("the GPU monitor watches a CUDA device, got {device}; CPU and RAM are shown anyway, "
                               "so leave device=None on a machine without an NVIDIA GPU").format(device=dev))
        index = dev.index
    if index is not None and index < 0:
        raise ValueError(_("CUDA device index must be >= 0, got {index}").format(index=index))
    return index


def torch_device_uuid(index: int) -> str | None:
    """PyTorch's UUID for cuda:`index` (lower case, no prefix), or None before CUDA is initialised here."""
    if not torch.cuda.is_initialized():
        return None
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid).lower() if uuid is not None else None


class TorchSource:
    """Samples `torch.cuda.memory_stats` for one device, only once CUDA is initialised in this process.

    `index` is the CUDA device (as PyTorch numbers them, i.e. after CUDA_VISIBLE_DEVICES); None means
    cuda:0. Note that "current device" is per thread in CUDA, so a monitor thread cannot ask for it: the
    monitor fixes the index when it starts.
    """

    def __init__(self, device=None):
        self.index = cuda_index(device)
        self.reason: str | None = None
        self._totals: dict[int, int] = {}
        # Asked once, here (the caller's thread): a broken driver can make this warn, and a warning
        # printed from the monitor thread would land in whatever cell is running.
        self._cuda_present = torch.cuda.device_count() > 0

    def sample(self):

        if not torch.cuda.is_initialized():  # never initialise CUDA ourselves
            self.reason = _("this kernel has not used CUDA yet") if self._cuda_present else None
            return None
        index = self.index or 0
        stats = torch.cuda.memory_stats(index)  # one call for all three numbers (it builds a dict of ~100)
        if index not in self._totals:
            self._totals[index] = torch.cuda.get_device_properties(index).total_memory
        self.reason = None
        return TorchStats(
            device=f"cuda:{index}",
            allocated=int(stats.get("allocated_bytes.all.current", 0)),
            reserved=int(stats.get("reserved_bytes.all.current", 0)),
            peak=int(stats.get("allocated_bytes.all.peak", 0)),
            total=self._totals[index],
        )
