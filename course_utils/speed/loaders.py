"""Input pipelines (notebook 03): `loader_epochs` times epochs of a loader, for DataLoader worker processes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


from ..i18n import _
from ..timing import synchronize


@dataclass
class EpochTiming:
    first_batch_s: float  # from asking for the iterator to holding the first batch (includes worker start-up)
    seconds: float        # the whole epoch
    images: int

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds


def loader_epochs(loader, epochs: int = 2, device=None) -> list[EpochTiming]:
    """Iterate `loader` for `epochs` epochs and time each: time to the first batch, and images/s.

    Pass the `device` a loader's batches live on (a TensorLoader on a GPU) so that each epoch's time
    includes the work queued there, not just its launch.
    """
    out = []
    for _i in range(epochs):
        t0 = time.perf_counter()
        first, images = None, 0
        for _x, y in loader:
            if first is None:
                first = time.perf_counter() - t0
            images += len(y)
        synchronize(device)  # CPU-GPU sync point (a no-op for CPU batches)
        seconds = time.perf_counter() - t0
        if first is None:
            raise ValueError(_("the loader produced no batches"))
        out.append(EpochTiming(first, seconds, images))
    return out
