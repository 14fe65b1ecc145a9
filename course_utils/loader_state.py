"""Saving where a training loader is inside an epoch, so an interrupted run resumes on exactly the same batches.

`LoaderState(loader)` wraps whatever a learner passes as `train_loader`:

- a loader with `state_dict()` / `load_state_dict()` (the torchdata "Stateful" protocol: torchdata's
  `StatefulDataLoader`, the course's `TensorLoader`): its own state, taken mid-epoch, says where it is;
- a torch `DataLoader` over a map-style dataset, however it is configured (shuffle, sampler, generator,
  workers, worker seeds): the order is a function of the random generators when the epoch's iterator was made
  (the global torch generator, the loader's and its sampler's `generator`). Those are recorded at the start of
  every epoch; to resume, they are put back, the epoch is started again and the batches already trained on
  are drawn and dropped (their loading is repeated, their training is not);
- a list or tuple of batches: the same order every epoch, so skipping is exact;
- anything else (an iterable whose order cannot be saved): resumed by skipping too, which is only right if it
  yields the same batches in the same order every pass. `state_dict()` warns once about that, at save time.

Random augmentations done inside *persistent* DataLoader workers draw from the workers' own generators, which
live in other processes and cannot be saved: the batch order is restored, those draws are not (warned at save
time). torchdata's `StatefulDataLoader` re-seeds its workers as they were and saves the state of a dataset that has
`state_dict()`; random draws of a dataset without it start again from the seeds (warned at save time too).
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .checkpoint import generator_state, rng_state, set_generator_state, set_rng_state
from .i18n import _

_END = object()


def _generators(loader: DataLoader) -> list[torch.Generator]:
    """The generators a DataLoader's order depends on besides the global one: its own and its samplers'."""
    found: dict[int, torch.Generator] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for obj in (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def _is_stateful(loader) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class LoaderState:
    """Iterate `loader` epoch by epoch and save or restore the position inside the current epoch.

        state = LoaderState(loader)
        batches = state.epoch()            # an iterator over this epoch's batches (resumed if loaded)
        saved = state.state_dict(done)     # after `done` batches of the epoch
        state.load_state_dict(saved)       # the next epoch() continues from there
    """

    def __init__(self, loader):
        self.loader = loader
        if _is_stateful(loader):
            self.kind = "stateful"
        elif isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset):
            self.kind = "dataloader"
        elif isinstance(loader, (list, tuple)):
            self.kind = "sequence"
        else:
            self.kind = "unknown"
        self._epoch_start: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        self._warned = False

    def epoch(self, number: int = 0) -> Iterator:
        """The batches of epoch `number` (counted from 0): a fresh pass, or, after `load_state_dict`, the rest
        of an interrupted one. A sampler with `set_epoch` (DistributedSampler) is told the number first, so it
        shuffles differently every epoch."""
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(number)
        pending, self._pending = self._pending, None
        if pending is not None and pending.get("finished"):  # stopped after its last batch: nothing left
            if self.kind == "stateful":
                # An exhausted loader's next pass hangs on its generators: put them back as they were. Its own
                # state after the last batch is not reloaded when it has generators: torchdata's
                # StatefulDataLoader without workers would then shuffle the next epoch differently.
                if pending["generators"]:
                    self._set_generators(pending["generators"])
                else:
                    self.loader.load_state_dict(pending["state"])
            return iter(())
        if self.kind == "stateful":
            if pending is None:
                return iter(self.loader)
            self.loader.load_state_dict(pending["state"])
            if "batches_done" not in pending:  # saved between epochs: a fresh pass from the saved order
                return iter(self.loader)
            return self._then_set_generators(iter(self.loader), pending["generators"])
        if pending is None:
            self._epoch_start = self._record_start()
            return iter(self.loader)
        self._epoch_start = pending["epoch_start"]
        self._restore_start(self._epoch_start)
        it = iter(self.loader)
        # The batches trained on before the interruption: drawn again (same generators, same order), not trained.
        skipped = sum(1 for _ in itertools.islice(it, pending["batches_done"]))
        if skipped < pending["batches_done"]:
            raise ValueError(f"cannot resume: the checkpoint is {pending['batches_done']} batches into an epoch, "
                             f"but this loader has only {skipped} batches an epoch")
        return it

    def _then_set_generators(self, it: Iterator, states: list) -> Iterator:
        """`it`, with the loader's generators put back as they were when the position was saved once its first
        batch is drawn (or it turns out empty): a resumed loader may draw from them to rebuild its order
        (torchdata's StatefulDataLoader does without workers), which the uninterrupted run did not do."""
        first = next(it, _END)
        if states:
            self._set_generators(states)
        if first is _END:
            return
        yield first
        yield from it

    def _record_start(self) -> dict[str, Any] | None:
        if self.kind != "dataloader":
            return None
        return {"rng": rng_state(), "generators": self._generator_states()}

    def _restore_start(self, start: dict[str, Any] | None) -> None:
        if start is None:
            return
        self._set_generators(start["generators"])
        set_rng_state(start["rng"])

    def _generator_states(self) -> list[bytes]:
        return [generator_state(g) for g in _generators(self.loader)]

    def _set_generators(self, states: list) -> None:
        gens = _generators(self.loader)
        if len(gens) != len(states):
            raise ValueError(f"cannot resume: the checkpoint's loader had {len(states)} generator(s) (loader or "
                             f"sampler), this one has {len(gens)}: build it the same way")
        for g, state in zip(gens, states):
            set_generator_state(g, state)

    def caveat(self) -> str | None:
        """Why this loader's position cannot be saved exactly, or None when it can."""
        name = type(self.loader).__name__
        if self.kind == "unknown":
            return _("the order of a {name} cannot be saved: a resumed run skips the batches already trained on "
                     "in a fresh pass, which is the same data only if the {name} yields the same batches in the "
                     "same order every pass. For an exact resume use course_utils.data.TensorLoader, a torch "
                     "DataLoader, or torchdata's StatefulDataLoader.").format(name=name)
        dataset = getattr(self.loader, "dataset", None)
        if self.kind == "stateful" and getattr(self.loader, "num_workers", 0) > 0 and dataset is not None \
                and not _is_stateful(dataset):
            return _("the {name} restores its workers' seeds, not their random state: random numbers the dataset "
                     "({dataset}) draws in the workers (random augmentations) start again from the seeds after a "
                     "resume. Give the dataset state_dict()/load_state_dict() (torchdata saves them per worker), or "
                     "draw its randomness from the sample index.").format(name=name, dataset=type(dataset).__name__)
        if self.kind == "dataloader" and self.loader.persistent_workers and self.loader.num_workers > 0:
            return _("the DataLoader has persistent workers: the batch order is restored, but random numbers drawn "
                     "inside the workers (random augmentations) come from the workers' own generators, which "
                     "cannot be saved. Use persistent_workers=False, or torchdata's StatefulDataLoader.")
        return None

    def state_dict(self, batches_done: int | None = None, finished: bool = False) -> dict[str, Any]:
        """Where the loader is: `batches_done` batches into the current epoch, or (None) between epochs.
        `finished`: the epoch's pass is over (its last batch drawn) but the epoch is not closed yet; the next
        `epoch()` after loading this state yields nothing, and the one after it starts the next epoch."""
        if finished:
            return {**self.state_dict(), "finished": True, "generators": self._generator_states()}
        if self.kind == "stateful":  # the loader's own state knows whether it is inside an epoch
            state = {"kind": self.kind, "state": self.loader.state_dict()}
            if batches_done is not None:
                state.update(batches_done=batches_done, generators=self._generator_states())
            return state
        if batches_done is None:  # between epochs: the next epoch's order depends on the generators' state now
            return {"kind": self.kind, "generators": self._generator_states() if self.kind == "dataloader" else []}
        return {"kind": self.kind, "batches_done": batches_done, "epoch_start": self._epoch_start}

    def warn_if_inexact(self) -> None:
        """Say once (a UserWarning) why a mid-epoch position of this loader cannot be restored exactly."""
        caveat = self.caveat()
        if caveat is not None and not self._warned:
            self._warned = True
            warnings.warn(_("Checkpoint: {caveat}").format(caveat=caveat), stacklevel=4)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state`: between epochs at once; inside an epoch, the next `epoch()` continues it."""
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            found = state.get("kind") if isinstance(state, dict) else None
            raise ValueError(f"cannot resume: the checkpoint was saved with a loader of kind {found!r}, "
                             f"this trainer's loader ({type(self.loader).__name__}) is of kind {self.kind!r}")
        if "batches_done" in state or self.kind == "stateful":  # the next epoch() continues (or loads) it
            self._pending = state
            return
        if self.kind == "dataloader":  # between epochs: the next order hangs on the loader's own generators
            self._set_generators(state["generators"])
        self._pending = state if state.get("finished") else None
