"""`limit_gpu_memory`: the same demonstration on a real (big) CUDA GPU."""
from __future__ import annotations

import torch

from ..i18n import _
from .oom import free_memory
from .sizes import BytesLike, format_bytes, parse_bytes


# --- a real GPU with less memory ------------------------------------------------------------

class limit_gpu_memory:  # noqa: N801 - used like a function: `with limit_gpu_memory("4GiB"):`
    """Cap this process's CUDA caching allocator at `budget` bytes, restored on exit.

        with limit_gpu_memory("2GiB"):
            ...   # torch.OutOfMemoryError once the process's reserved memory would pass 2 GiB

    Uses `torch.cuda.set_per_process_memory_fraction(budget / total_memory)`. The cap applies to
    memory *reserved* by PyTorch on that device, including what was reserved before entering, so the
    cache is emptied on entry. On a machine without CUDA it raises a RuntimeError that points to
    `SimulatedGPU`.
    """

    def __init__(self, budget: BytesLike, device: int | str | torch.device | None = None):
        self.budget = parse_bytes(budget)
        self.device = device
        self._index: int | None = None
        self._previous: float | None = None

    def __enter__(self) -> int:
        if not torch.cuda.is_available():  # asks the driver; does not initialise CUDA
            raise RuntimeError(_(
                "limit_gpu_memory({budget}) needs a CUDA GPU, and torch.cuda.is_available() is False in this "
                "process. On a CPU, use SimulatedGPU(budget, model=..., optimizer=...) to run the same "
                "demonstration.").format(budget=format_bytes(self.budget)))
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device is None else torch.device(self.device)
        if dev.type != "cuda":
            raise ValueError(_("limit_gpu_memory limits a CUDA device, got {device}").format(device=dev))
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        if self.budget > total:
            raise ValueError(_("budget {budget} is more than cuda:{index} has ({total})").format(
                budget=format_bytes(self.budget), index=index, total=format_bytes(total)))
        self._index = index
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer than torch 2.6
        self._previous = float(get_fraction(index)) if get_fraction is not None else 1.0
        free_memory()  # cached blocks count against the cap: release them first
        torch.cuda.set_per_process_memory_fraction(self.budget / total, index)
        return self.budget

    def __exit__(self, *exc) -> None:
        if self._index is not None and self._previous is not None:
            torch.cuda.set_per_process_memory_fraction(float(self._previous), self._index)
        self._index = self._previous = None
