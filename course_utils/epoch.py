"""Where training stands inside an epoch, and what its losses say.

- `EpochTally(position, weighted)`: this rank's record of the current epoch, one entry per trained batch: its
  loss (a device tensor, never read per step: no CPU-GPU sync, and no device work either) and its samples.
  At the epoch's end the losses are read once (`values()`) and added up exactly (`total`): the mean does not
  depend on the order, the thread count or where the epoch was interrupted.
- `EpochPosition`: where an interrupted epoch stopped, as a small dataclass (stored as a dict of plain values).
- `NonFiniteLossError` and `non_finite_error(...)`: an inf or nan loss, named by its epoch, batch and rank.

Importing this module touches no device.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .i18n import _
from .rng import rng_state


class NonFiniteLossError(FloatingPointError):
    """Training produced an inf or nan loss, or a checkpoint would have held non-finite weights."""


@dataclasses.dataclass
class EpochPosition:
    """Where an interrupted epoch stopped: enough to finish it exactly as the uninterrupted run would."""
    losses: list[float]      # the loss of each batch of this epoch trained on so far, in order
    sizes: list[int]         # their samples
    rng: dict[str, Any]      # the generators when it stopped (`rng_state()`)
    loader: dict[str, Any]   # how to put the loader back there (`course_utils.loader_state.LoaderState`)

    @property
    def batches_done(self) -> int:
        """Batches of this epoch already trained on."""
        return len(self.losses)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpochPosition":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != names:
            raise ValueError(_("an epoch position has the entries {names}").format(names=sorted(names)))
        losses, sizes = d["losses"], d["sizes"]
        if not (isinstance(losses, list) and isinstance(sizes, list) and len(losses) == len(sizes)
                and all(type(x) is float for x in losses) and all(type(n) is int and n >= 0 for n in sizes)):
            raise ValueError(_("an epoch position's losses and sizes are two lists of the same length, of floats "
                               "and of sample counts"))
        return cls(**d)


class EpochTally:
    """One entry per batch of the current epoch trained on this rank, from its start or from where `position`
    stopped: `losses` (device tensors, kept as they are) and `sizes` (samples). The Trainer appends to both
    after every step. `weighted`: the losses are batch means (each counts by its samples); False: sums."""

    def __init__(self, position: EpochPosition | None = None, weighted: bool = True):
        self.done: list[float] = list(position.losses) if position is not None else []  # read before a stop
        self.losses: list[torch.Tensor] = []  # this pass's batch losses: device tensors, read at the end
        self.sizes: list[int] = list(position.sizes) if position is not None else []  # every batch's samples
        self.weighted = weighted
        self.pass_over = False  # the loader's pass is over (a save now must say so)

    @property
    def batches(self) -> int:
        """Batches of the epoch trained on (before a stop, and since)."""
        return len(self.done) + len(self.losses)

    @property
    def samples(self) -> int:
        return sum(self.sizes)

    def values(self) -> list[float]:
        """Every batch's loss as a float, in order (reads the device tensors: a CPU-GPU sync point)."""
        if not self.losses:
            return list(self.done)
        return self.done + torch.stack(self.losses).reshape(-1).float().tolist()

    def total(self, values: list[float]) -> float:
        """The sum over the epoch's samples of their loss, from `values()`: correctly rounded (`math.fsum`), so
        the same for any order or split of the batches; inf or nan if a loss is."""
        terms = [v * n for v, n in zip(values, self.sizes)] if self.weighted else values
        if not all(map(math.isfinite, terms)):
            return sum(terms)
        return math.fsum(terms)

    def position(self, loader: dict[str, Any]) -> EpochPosition:
        """Where the epoch stands now, to continue it exactly (reads the losses: a CPU-GPU sync point)."""
        values = self.values()
        n = min(len(values), len(self.sizes))  # equal, unless a second Ctrl-C landed between the two appends
        return EpochPosition(values[:n], self.sizes[:n], rng_state(), loader)

    def first_bad(self) -> tuple[int, float] | None:
        """(batch number in the epoch, counted from 1, and its loss) of the first non-finite loss, or None."""
        for i, value in enumerate(self.values()):
            if not math.isfinite(value):
                return i + 1, value
        return None


def first_bad_over_ranks(tally: EpochTally, process) -> tuple[int, float, int] | None:
    """(batch, loss, rank) of the first non-finite batch loss of the epoch over all ranks (the lowest batch number,
    then the lowest rank), or None if every loss is finite. A collective (`process.gather`): every rank calls it."""
    found = [(bad, rank) for rank, bad in enumerate(process.gather(tally.first_bad())) if bad is not None]
    if not found:
        return None
    (batch, value), rank = min(found)
    return batch, value, rank


def where_in(process, epoch: int, batch: int, rank: int = 0) -> str:
    """'epoch 2, batch 3' (and ' on rank 1' in a distributed run)."""
    where = _("epoch {epoch}, batch {batch}").format(epoch=epoch, batch=batch)
    if process.world_size > 1:
        where += _(" on rank {rank}").format(rank=rank)
    return where


def non_finite_error(tally: EpochTally, process, epoch: int, batch: int, value: float) -> NonFiniteLossError:
    """The error for an epoch whose loss is `value` (inf or nan), naming its first bad batch over all ranks
    (`first_bad_over_ranks`: a collective, every rank calls it); `batch` is where the epoch stands, if none is
    found."""
    bad = first_bad_over_ranks(tally, process)
    batch, value, rank = bad if bad is not None else (batch, value, 0)
    return NonFiniteLossError(_(
        "the loss became {value} at {where}: training stopped (the Trainer reads the loss at an epoch's end, "
        "when it stops and when it saves). The weights are probably not finite any more; no checkpoint was "
        "written (the last good one is kept). Usual causes: a learning rate too high, log or division by zero in "
        "the loss, float16 overflow (mixed_precision='fp16' scales the loss). callbacks=[CheckFinite()] stops at "
        "the bad step itself (one sync a step).").format(
        value=value, where=where_in(process, epoch, batch, rank)))
