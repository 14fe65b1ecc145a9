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
time). A persistent DataLoader draws its workers' base seed only when it starts them, not at every epoch; a resume
starts (or restarts) them so that the epoch's order is drawn from the same generator state as in the original run.
A sampler of your own is exact if it draws from torch's global generator or from a `generator` attribute; any
other randomness in it (numpy, a generator stored under another name) is not saved (warned at save time). torchdata's `StatefulDataLoader` re-seeds its workers as they were and saves the state of a dataset that has
`state_dict()`; random draws of a dataset without it start again from the seeds (warned at save time too).
"""
from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, SubsetRandomSampler, WeightedRandomSampler)

from .errors import learner_stacklevel
from .i18n import _
from .rng import generator_state, rng_state, set_generator_state, set_rng_state

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
        state.check(saved)                 # ValueError if it cannot be restored into this loader
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
        self._next_fresh: bool | None = None  # whether the next epoch's iterator should start new workers
        self._warned = False

    def epoch(self, number: int = 0) -> Iterator:
        """The batches of epoch `number` (counted from 0): a fresh pass, or, after `load_state_dict`, the rest
        of an interrupted one. A sampler with `set_epoch` (DistributedSampler) is told the number first, so it
        shuffles differently every epoch."""
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(number)
        pending = self._pending
        if self.kind == "stateful" and pending is not None:
            self._pending = None
            if "batches_done" in pending:  # inside an epoch: the loader's own state continues it
                self.loader.load_state_dict(pending["state"])
                return self._then_set_generators(iter(self.loader), pending["generators"])
            self._load_pass_over(pending)  # saved between epochs, or after an epoch's last batch
            return iter(()) if pending.get("finished") else iter(self.loader)
        if pending is not None and pending.get("finished"):  # stopped after its last batch: nothing left
            self._pending = None
            return iter(())
        if self.kind == "stateful":
            return iter(self.loader)
        if pending is None:
            self._match_workers(self._next_fresh)
            self._next_fresh = None
            self._epoch_start = self._record_start()
            return iter(self.loader)
        self._epoch_start = pending["epoch_start"]
        self._restore_start(self._epoch_start)
        it = iter(self.loader)
        # The batches trained on before the interruption: drawn again (same generators, same order), not trained.
        skipped = sum(1 for _ in itertools.islice(it, pending["batches_done"]))
        if skipped < pending["batches_done"]:
            raise ValueError(_("cannot resume: the checkpoint is {done} batches into an epoch, but this loader has "
                               "only {skipped} batches an epoch").format(done=pending["batches_done"],
                                                                         skipped=skipped))
        self._pending = None
        return it

    def _load_pass_over(self, pending: dict[str, Any]) -> None:
        """Put a stateful loader where the original run was when its pass was over (between epochs, or after an
        epoch's last batch), leaving no trace in the random generators. torchdata's StatefulDataLoader builds
        the iterator of a loaded state at its next iter() and, finding that pass over, a fresh one; each draws a
        seed (from the loader's generator, or torch's global one) that the original run did not draw, so the
        next epoch would shuffle or drop out differently. Both are built here, then the generators are put back
        as they were when the state was saved, and the global one as it is now."""
        rng = rng_state()
        self.loader.load_state_dict(pending["state"])
        if _builds_iterator_on_iter(self.loader):
            iter(self.loader)
        self._set_generators(pending["generators"])
        set_rng_state(rng)

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

    # --- persistent workers: start them where the original run did --------------------------------

    def _persistent(self) -> bool:
        return self.kind == "dataloader" and self.loader.persistent_workers and self.loader.num_workers > 0

    def _fresh(self) -> bool:
        """Whether the next iter(loader) starts new workers (drawing their base seed from the generators)."""
        return not self._persistent() or getattr(self.loader, "_iterator", None) is None  # DataLoader's own

    def _match_workers(self, fresh: bool | None) -> None:
        """Make the next iter(loader) start workers (and draw their seed) exactly when the original run did: a
        persistent DataLoader draws it only when it starts its workers, so the epoch's order is drawn from the
        same generator state only if a resumed run starts (or reuses) workers at the same epoch."""
        if fresh is None or not self._persistent() or fresh == self._fresh():
            return
        if fresh:  # the original run started its workers here: drop this run's, so they start again
            self.loader._iterator = None
            return
        rng, gens = rng_state(), self._generator_states()  # the original reused its workers: start ours now,
        iter(self.loader)                                  # then put back what starting them drew from
        self._set_generators(gens)
        set_rng_state(rng)

    def _record_start(self) -> dict[str, Any] | None:
        if self.kind != "dataloader":
            return None
        return {"rng": rng_state(), "generators": self._generator_states(), "fresh": self._fresh()}

    def _restore_start(self, start: dict[str, Any] | None) -> None:
        if start is None:
            return
        self._match_workers(start.get("fresh"))
        self._set_generators(start["generators"])
        set_rng_state(start["rng"])

    def _generator_states(self) -> list[bytes]:
        return [generator_state(g) for g in _generators(self.loader)]

    def _set_generators(self, states: list) -> None:
        gens = _generators(self.loader)
        if len(gens) != len(states):
            raise ValueError(_("cannot resume: the checkpoint's loader had {saved} generator(s) (loader or sampler), "
                               "this one has {here}: build it the same way").format(saved=len(states),
                                                                                     here=len(gens)))
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
        sampler = _own_sampler(self.loader) if self.kind == "dataloader" else None
        if sampler is not None:
            return _("the DataLoader's sampler is a {sampler} of your own: its order is restored only if it draws "
                     "from torch's global generator or from a torch.Generator in its `generator` attribute; other "
                     "randomness in it (numpy, a generator under another name) is not saved.").format(
                sampler=type(sampler).__name__)
        return None

    def state_dict(self, batches_done: int | None = None, finished: bool = False) -> dict[str, Any]:
        """Where the loader is: `batches_done` batches into the current epoch, or (None) between epochs.
        `finished`: the epoch's pass is over (its last batch drawn) but the epoch is not closed yet; the next
        `epoch()` after loading this state yields nothing, and the one after it starts the next epoch."""
        shape = {"kind": self.kind, "batches": _length(self.loader), "generator_count": len(_generators(self.loader)),
                 "class": type(self.loader).__name__}
        if finished:
            return {**self.state_dict(), "finished": True, "generators": self._generator_states()}
        if self.kind == "stateful":  # the loader's own state knows whether it is inside an epoch
            state = {**shape, "state": self.loader.state_dict(), "generators": self._generator_states()}
            if batches_done is not None:
                state["batches_done"] = batches_done
            return state
        if batches_done is None:  # between epochs: the next epoch's order depends on the generators' state now
            return {**shape, "generators": self._generator_states() if self.kind == "dataloader" else [],
                    "fresh": self._fresh()}
        return {**shape, "batches_done": batches_done, "epoch_start": self._epoch_start}

    def check(self, state: Any) -> None:
        """Raise ValueError if `state` cannot be restored into this loader: another kind, another class of a loader
        with a state of its own, another number of generators, or (inside an epoch) another number of batches an
        epoch. Changes nothing."""
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            found = state.get("kind") if isinstance(state, dict) else None
            raise ValueError(_("the checkpoint was saved with a loader of kind {saved!r}; this trainer's loader "
                               "({name}) is of kind {kind!r}: build the same kind of loader").format(
                saved=found, name=type(self.loader).__name__, kind=self.kind))
        if self.kind == "stateful" and state.get("class", type(self.loader).__name__) != type(self.loader).__name__:
            raise ValueError(_("the checkpoint was saved with a {saved}, whose state this trainer's {name} cannot "
                               "read: build the same loader").format(saved=state["class"],
                                                                     name=type(self.loader).__name__))
        gens = len(_generators(self.loader))
        if self.kind == "dataloader" and state.get("generator_count", gens) != gens:
            raise ValueError(_("the checkpoint's DataLoader had {saved} generator(s) (its own or its sampler's), this "
                               "one has {mine}: build it the same way").format(saved=state["generator_count"],
                                                                              mine=gens))
        inside = "batches_done" in state or state.get("finished")
        saved, mine = state.get("batches"), _length(self.loader)
        if inside and saved is not None and mine is not None and saved != mine:
            raise ValueError(_("the checkpoint stopped inside an epoch of {saved} batches; this loader has {mine} "
                               "batches an epoch (another batch_size, drop_last or dataset?): build it the same way, "
                               "or resume from a checkpoint written at the end of an epoch").format(
                saved=saved, mine=mine))

    def warn_if_inexact(self) -> None:
        """Say once (a UserWarning) why a mid-epoch position of this loader cannot be restored exactly."""
        caveat = self.caveat()
        if caveat is not None and not self._warned:
            self._warned = True
            warnings.warn(_("Checkpoint: {caveat}").format(caveat=caveat), stacklevel=learner_stacklevel())

    def snapshot(self) -> dict[str, Any]:
        """What `load_state_dict` may change (this object's fields, the loader's generators), to `restore`."""
        return {"fields": dict(self.__dict__), "generators": self._generator_states()}

    def restore(self, snap: dict[str, Any]) -> None:
        self.__dict__.update(snap["fields"])
        self._set_generators(snap["generators"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state`: between epochs at once; inside an epoch, the next `epoch()` continues it."""
        self.check(state)
        if "batches_done" in state or self.kind == "stateful":  # the next epoch() continues (or loads) it
            self._pending = state
            return
        if self.kind == "dataloader":  # between epochs: the next order hangs on the loader's own generators
            self._set_generators(state["generators"])
            self._next_fresh = state.get("fresh")
        self._pending = state if state.get("finished") else None


_KNOWN_SAMPLERS = (RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler, DistributedSampler)


def _builds_iterator_on_iter(loader) -> bool:
    """Whether `loader` is torchdata's StatefulDataLoader, which turns a loaded state into an iterator (drawing
    seeds) at its next iter(). Other stateful loaders, the course's TensorLoader among them, draw nothing then."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


def _own_sampler(loader: DataLoader):
    """The loader's sampler if it is neither one of torch's nor a BatchSampler over one of torch's."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(batch_sampler, "sampler", None), getattr(loader, "sampler", None)):
        if sampler is not None and not isinstance(sampler, _KNOWN_SAMPLERS):
            return sampler
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler):
        return batch_sampler
    return None


def _length(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
