"""Where training stands inside an epoch, and what its losses say.

- `EpochTally(device, position)`: this rank's running figures of the current epoch. The loss sum stays on the
  device (no CPU-GPU sync per step); each batch's loss is kept as a device tensor, read only when something must
  be named (the first non-finite one).
- `EpochPosition`: where an interrupted epoch stopped, as a small dataclass (stored as a dict of plain values).
- `NonFiniteLossError` and `non_finite_error(...)`: an inf or nan loss, named by its epoch, batch and rank.

Importing this module touches no device.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .i18n import _
from .rng import rng_state


class NonFiniteLossError(FloatingPointError):
    """Training produced an inf or nan loss, or a checkpoint would have held non-finite weights."""


@dataclasses.dataclass
class EpochPosition:
    """Where an interrupted epoch stopped: enough to finish it exactly as the uninterrupted run would."""
    batches_done: int        # batches of this epoch already trained on
    samples_done: int        # their samples
    loss_sum: float          # sum over those samples of their loss (for the epoch's mean)
    rng: dict[str, Any]      # the generators when it stopped (`rng_state()`)
    loader: dict[str, Any]   # how to put the loader back there (`course_utils.loader_state.LoaderState`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpochPosition":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(_("an epoch position has the entries {names}").format(names=sorted(names)))
        return cls(**d)


class EpochTally:
    """The running figures of one epoch on this rank, from its start or from where `position` stopped."""

    def __init__(self, device: torch.device, position: EpochPosition | None = None):
        # the sum over samples of their loss: on the device, added to without a sync (float32, as the loss)
        self.loss_sum = torch.tensor(position.loss_sum if position is not None else 0.0, device=device)
        self.samples = position.samples_done if position is not None else 0
        self.first_batch = position.batches_done if position is not None else 0  # the batch losses[0] belongs to
        self.losses: list[torch.Tensor] = []  # each batch's loss (device tensors: kept, never read per step)
        self.pass_over = False  # the loader's pass is over (a save now must say so)

    def position(self, batches_done: int, loader: dict[str, Any]) -> EpochPosition:
        """Where the epoch stands now, to continue it exactly (reads the loss sum: a CPU-GPU sync point)."""
        return EpochPosition(batches_done, self.samples, self.loss_sum.item(), rng_state(), loader)

    def first_bad(self) -> tuple[int, float] | None:
        """(batch number in the epoch, counted from 1, and its loss) of the first non-finite loss, or None."""
        if not self.losses:
            return None
        finite = torch.stack([x.float() for x in self.losses]).isfinite()
        if finite.all():
            return None
        index = int((~finite).nonzero()[0])
        return self.first_batch + index + 1, float(self.losses[index])


def non_finite_error(tally: EpochTally, process, epoch: int, batch: int, value: float) -> NonFiniteLossError:
    """The error for an epoch whose loss is `value` (inf or nan), naming its first bad batch over all ranks
    (`process.gather`: a collective, every rank calls it); `batch` is where the epoch stands, if none is found."""
    found = [(bad, rank) for rank, bad in enumerate(process.gather(tally.first_bad())) if bad is not None]
    (batch, value), rank = min(found) if found else ((batch, value), 0)
    where = _("epoch {epoch}, batch {batch}").format(epoch=epoch, batch=batch)
    if process.world_size > 1:
        where += _(" on rank {rank}").format(rank=rank)
    return NonFiniteLossError(_(
        "the loss became {value} at {where}: training stopped (the Trainer reads the loss at an epoch's end "
        "and when it stops). The weights are probably not finite any more; no checkpoint was written (the last "
        "good one is kept). Usual causes: a "
        "learning rate too high, log or division by zero in the loss, float16 overflow (mixed_precision='fp16' "
        "scales the loss). callbacks=[CheckFinite()] stops at the bad step itself (one sync a step).").format(
        value=value, where=where))
