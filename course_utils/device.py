"""Device selection: `get_device()` picks the best available accelerator (or the one asked for); `as_device`
reads a device argument.

The environment diagnosis (`describe_environment`, `diagnose`, `query_nvml`, `query_torch`, ...) lives
in `course_utils.environment`.
"""
from __future__ import annotations

import os

import torch

from .i18n import _

ENV_VAR = "COURSE_DEVICE"


def as_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device ('cpu', 'cuda:1', a torch.device); a clear ValueError or TypeError otherwise."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ValueError(_("{device!r} is not a device name (try 'cpu', 'cuda' or 'mps')").format(
                device=device)) from exc
    raise TypeError(_("device must be a str or torch.device, got {type}").format(type=type(device).__name__))


def mps_available() -> bool:
    """Whether Apple's MPS (Metal) backend is usable here."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """Return the device the course should use.

    Order: an explicit `prefer`, else the COURSE_DEVICE environment variable, else CUDA,
    else Apple MPS, else CPU. A preference for a device that is not available raises
    a ValueError that says what is available instead of failing later inside a kernel.
    """
    choice = prefer if prefer is not None else os.environ.get(ENV_VAR) or None
    if choice is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(choice)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            _("asked for {device} but CUDA is not available here; "
              "run describe_environment() to see why, or use get_device() to pick automatically").format(device=device)
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(_("asked for {device} but only {count} CUDA device(s) are visible").format(
            device=device, count=torch.cuda.device_count()))
    if device.type == "mps" and not mps_available():
        raise ValueError(_("asked for {device} but Apple MPS is not available on this machine").format(device=device))
    return device
