"""The `Sampler`: one `Snapshot` (course_utils.monitor.stats) from up to three sources."""
from __future__ import annotations

import time

from ..i18n import N_, _
from .host import HostSource
from .nvml_source import NvmlSource
from .stats import Snapshot, Source
from .torch_source import TorchSource


class Sampler:
    """Takes `Snapshot`s from up to three sources.

    Each argument is True (use the default source), False/None (leave it out) or a source object.
    `sample()` never initialises CUDA; unexpected errors inside a source propagate (the monitor's
    thread then stops and shows the error) while expected unavailability gives `None` plus a note.
    """

    def __init__(self, nvml: bool | Source | None = True, torch: bool | Source | None = True,
                 host: bool | Source | None = True, device=None):
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
