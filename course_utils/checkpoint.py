"""Trainer checkpoints: the saved state of a Trainer's named parts, written atomically, read safely, every
failure named with its file.

- `PARTS`, `COUNTERS`: what a Trainer checkpoint holds besides its callbacks' states and every rank's random and
  loader state: the state of each named part (`state_dict()` / `load_state_dict()`) and the plain counters.
- `trainer_state(trainer)` / `load_trainer_state(trainer, state)`: that state gathered by name, and put back all of
  it or (when anything does not fit: `check_trainer_state`, a ValueError naming why) none of it.
- `save_trainer(trainer, path)` / `load_trainer(trainer, path)` / `resume(trainer, path)`: the same through a file;
  non-finite weights are never written (`NonFiniteLossError`).
- `save(state, path)`: a temporary file in the same folder, flushed to disk (fsync), then renamed over the
  target, so a crash or a Ctrl-C mid-write never leaves a half-written checkpoint.
- `load(path, map_location)`: `torch.load(weights_only=True)` (no code in the file runs) with a
  `CheckpointError` that names the file for a missing, truncated, corrupt or foreign file, and for tensors
  that cannot be mapped to this machine's device.

The trainer is used through its public names only (`course_utils.trainer` imports this module, not the other way).
Importing this module touches no device.
"""
from __future__ import annotations

import copy
import glob
import math
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from .epoch import EpochPosition, NonFiniteLossError, first_bad_over_ranks, non_finite_error, where_in
from .errors import first_line
from .i18n import _
from .rng import rng_state, set_rng_state

FORMAT = "course_utils.Trainer/4"  # /3: every rank's random and loader state; /4: an epoch position keeps its batch losses


class CheckpointError(RuntimeError):
    """A checkpoint file could not be used (missing, truncated, corrupt, foreign, or not for this device)."""


# --- what a checkpoint must match -------------------------------------------------------------

def check_model_state(model: torch.nn.Module, saved: dict) -> None:
    """Raise ValueError naming what differs between `saved` (a state_dict) and `model`: keys and shapes."""
    own = model.state_dict()
    if not isinstance(saved, dict):
        raise ValueError(_("the checkpoint's model state is not a state_dict"))
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k}: {tuple(saved[k].shape)} / {tuple(v.shape)}" for k, v in own.items()
              if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if not (missing or unexpected or shapes):
        return
    parts = []
    if missing:
        parts.append(_("this model has {n} entries the checkpoint lacks ({keys})").format(
            n=len(missing), keys=", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")))
    if unexpected:
        parts.append(_("the checkpoint has {n} entries this model lacks ({keys})").format(
            n=len(unexpected), keys=", ".join(unexpected[:4]) + (", ..." if len(unexpected) > 4 else "")))
    if shapes:
        parts.append(_("shapes differ (checkpoint / this model): {shapes}").format(shapes="; ".join(shapes[:4])))
    hint = ""
    if any(k.startswith(("module.", "_orig_mod.")) for k in unexpected):
        hint = _(" (keys starting with 'module.' or '_orig_mod.' come from a DistributedDataParallel or "
                 "torch.compile wrapper: save the module itself)")
    raise ValueError(_("the checkpoint's model is not this model: {parts}{hint}").format(
        parts="; ".join(parts), hint=hint))


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, saved_class: str) -> None:
    """Raise ValueError naming what differs between `saved` (an optimizer state_dict) and `optimizer`: its class
    and its parameter groups' sizes (torch's own load checks little and fails half-way, with only a KeyError)."""
    mine = type(optimizer).__name__
    if saved_class != mine:
        raise ValueError(_("this checkpoint's optimizer is {saved}; this trainer's is {mine}: build the same "
                           "optimizer to resume").format(saved=saved_class, mine=mine))
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise ValueError(_("the checkpoint's optimizer state is not an optimizer state_dict"))
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    my_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != my_sizes:
        raise ValueError(_("the checkpoint's optimizer has parameter groups of {saved} tensors; this trainer's has "
                           "{mine}: build the optimizer over the same parameters, grouped the same way").format(
            saved=saved_sizes, mine=my_sizes))
    # the state of every parameter (momentum, Adam's moments) must have that parameter's shape: a model whose
    # parameters are listed in another order fails here, not at the next step
    for n, (saved_id, param) in enumerate(zip((i for g in saved["param_groups"] for i in g["params"]),
                                              (p for g in optimizer.param_groups for p in g["params"]))):
        for key, value in saved["state"].get(saved_id, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(_("the checkpoint's optimizer state {key!r} of parameter {n} has shape {saved}; "
                                   "this trainer's parameter {n} has shape {mine} (the parameters in another order, "
                                   "or another model?)").format(key=key, n=n, saved=tuple(value.shape),
                                                                mine=tuple(param.shape)))


# --- what a Trainer checkpoint holds --------------------------------------------------------------

PARTS = ("model", "optimizer", "precision", "step")  # a Trainer's parts: each has state_dict() / load_state_dict()
COUNTERS = ("epoch", "batches_trained", "optimizer_steps", "history", "logs")  # a Trainer's plain values


def _state_name(callback) -> str:
    return getattr(callback, "state_name", type(callback).__name__)


def match_callbacks(callbacks, saved: list[dict]) -> list[tuple[Any, Any]]:
    """(callback, its saved state) for each saved callback state, given to the callback of the same name in
    `callbacks` (in order: `Callback.state_name`, its class, and a scheduler's class). Raises ValueError if a
    saved state has no callback to take it, or a callback with a state has none in the checkpoint (a scheduler
    would start its schedule again): empty states are left out of both."""
    waiting: dict[str, list] = {}
    for cb in callbacks:
        waiting.setdefault(_state_name(cb), []).append(cb)
    pairs = []
    for entry in saved:
        mine = waiting.get(entry["class"])
        if mine:
            pairs.append((mine.pop(0), entry["state"]))
        elif entry["state"]:
            raise ValueError(_("the checkpoint holds the state of a {name} callback, which this trainer does not "
                               "have; pass one (e.g. the same scheduler) to resume exactly").format(name=entry["class"]))
    for name, left in waiting.items():
        if any(cb.state_dict() for cb in left):
            raise ValueError(_("this trainer has a {name} callback, whose state the checkpoint lacks (the run that "
                               "wrote it had none): it would start again from its beginning. Build the trainer "
                               "with the callbacks and scheduler of that run to resume exactly").format(name=name))
    return pairs


def check_trainer_state(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, callbacks,
                        world_size: int, rank: int) -> dict:
    """Everything a Trainer's `load_state_dict` will touch, checked before anything changes: the model's keys and
    shapes, the optimizer's class and groups, the precision, the callbacks, the counters, the world size.
    Returns the part of `rank` (its random generators, loader state and epoch position); raises ValueError
    naming the first mismatch."""
    missing = [k for k in (*PARTS, *COUNTERS, "callbacks", "ranks", "optimizer_class") if k not in state]
    if missing:
        raise ValueError(_("the checkpoint lacks {keys}").format(keys=", ".join(missing)))
    check_model_state(model, state["model"])
    check_optimizer_state(optimizer, state["optimizer"], state.get("optimizer_class"))
    if not isinstance(state["precision"], dict) or "scaler" not in state["precision"]:
        raise ValueError(_("the checkpoint's precision state is not a MixedPrecision state"))
    match_callbacks(callbacks, state["callbacks"])
    ranks = state["ranks"]
    mine = ranks[rank if rank < len(ranks) else 0]
    if mine["position"] is not None and state.get("world_size", 1) != world_size:
        raise ValueError(_("the checkpoint stopped inside an epoch of a run with {saved} process(es); resume it "
                           "with the same number (this run has {world}), or from a checkpoint written at the end "
                           "of an epoch").format(saved=state.get("world_size", 1), world=world_size))
    counters = [state[k] for k in ("epoch", "batches_trained", "optimizer_steps")]
    if not all(type(c) is int and c >= 0 for c in counters) or not isinstance(state["history"], list) \
            or not all(isinstance(x, float) for x in state["history"]) or len(state["history"]) != state["epoch"]:
        raise ValueError(_("the checkpoint's counters or loss history are not those of a run (epoch "
                           "{epoch!r}, batches {batches!r}, {n} losses)").format(
            epoch=state["epoch"], batches=state["batches_trained"],
            n=len(state["history"]) if isinstance(state["history"], list) else "?"))
    return mine


# --- a Trainer's state, gathered by name ------------------------------------------------------------

def _rank_state(trainer) -> dict:
    """What differs between ranks: the random generators, the loader's position, where the epoch stopped."""
    position, loader = trainer.position, trainer.loader_state
    if position is None and trainer.at_step_boundary:  # saving while training: here, inside the epoch
        position = trainer.tally.position(loader.state_dict(trainer.batch_in_epoch, trainer.tally.pass_over))
    return {"rng": rng_state(), "loader": position.loader if position is not None else loader.state_dict(),
            "position": position.to_dict() if position is not None else None}


def _saved_parts(trainer) -> dict:
    """The state of the trainer's parts, callbacks and counters (the rank-independent part of a checkpoint)."""
    return {**{name: getattr(trainer, name).state_dict() for name in PARTS},
            "callbacks": [{"class": _state_name(cb), "state": cb.state_dict()} for cb in trainer.callbacks],
            **{name: copy.deepcopy(getattr(trainer, name)) for name in COUNTERS}}


def _put_parts(trainer, state: dict) -> None:
    """Load the parts, callbacks and counters of `state` (already checked)."""
    for name in PARTS:
        getattr(trainer, name).load_state_dict(state[name])
    for cb, saved in match_callbacks(trainer.callbacks, state["callbacks"]):
        cb.load_state_dict(saved)
    for name in COUNTERS:
        setattr(trainer, name, copy.deepcopy(state[name]))


def trainer_state(trainer) -> dict:
    """Everything needed to continue the run exactly: the state of each part in `PARTS`, the callbacks' states,
    the `COUNTERS`, and for every rank its random generators and loader position (a collective in a distributed
    run: every rank calls it)."""
    if trainer.position is not None or trainer.at_step_boundary:
        trainer.loader_state.warn_if_inexact()
    return {"format": FORMAT, "optimizer_class": type(trainer.optimizer).__name__, **_saved_parts(trainer),
            "world_size": trainer.process.world_size,
            "ranks": trainer.process.gather(_rank_state(trainer))}  # rank 0's first


def load_trainer_state(trainer, state: dict) -> None:
    """Restore `trainer_state(...)`: all of it or, if anything does not fit, none of it (ValueError naming why)."""
    process, loader = trainer.process, trainer.loader_state
    mine = check_trainer_state(state, trainer.model, trainer.optimizer, trainer.callbacks, process.world_size,
                               process.rank)
    loader.check(mine["loader"])
    before = copy.deepcopy(_saved_parts(trainer))  # to put back if anything fails half-way
    where = (rng_state(), loader.snapshot(), trainer.position, trainer.batch_in_epoch)
    try:
        _put_parts(trainer, state)
        set_rng_state(mine["rng"])
        loader.load_state_dict(mine["loader"])
        trainer.position = EpochPosition.from_dict(mine["position"]) if mine["position"] is not None else None
        trainer.batch_in_epoch = trainer.position.batches_done if trainer.position is not None else 0
    except BaseException:  # half-way: put everything back as it was
        _put_parts(trainer, before)
        set_rng_state(where[0])
        loader.restore(where[1])
        trainer.position, trainer.batch_in_epoch = where[2:]
        raise


def _refuse_non_finite(trainer, path: Path) -> None:
    """Refuse to save non-finite weights or a non-finite running loss (a sync: once per save), naming the first
    bad batch (a periodic save mid-epoch is often the first to see it)."""
    tensors = [t for t in trainer.model.state_dict().values() if t.is_floating_point()]
    weights_ok = bool(torch.stack([t.isfinite().all() for t in tensors]).all()) if tensors else True
    if trainer.position is not None:
        loss_ok = all(map(math.isfinite, trainer.position.losses))
    else:  # between epochs, or a periodic save while training (the epoch's losses: read once per save)
        loss_ok = not trainer.at_step_boundary or trainer.precision.scaler is not None \
            or all(map(math.isfinite, trainer.tally.values()))
    process = trainer.process
    if not process.agree(not (weights_ok and loss_ok)):  # every rank saves, or none (a round trip)
        return
    bad = first_bad_over_ranks(trainer.tally, process)  # every rank is here (a collective)
    if bad is not None:  # the message names the first bad batch (non_finite_error finds it again)
        error = non_finite_error(trainer.tally, process, trainer.epoch + 1, bad[0], bad[1])
        raise NonFiniteLossError(_("not saving '{name}': {error}").format(name=path.name, error=error))
    where = where_in(process, trainer.epoch + 1, trainer.batch_in_epoch) if trainer.batch_in_epoch \
        else _("the end of epoch {epoch}").format(epoch=trainer.epoch)
    raise NonFiniteLossError(_("not saving '{name}': the weights are not finite (inf or nan) at {where}, though "
                               "every loss before was: the update itself overflowed (a learning rate too high, "
                               "or gradients beyond float range), or something changed them. A checkpoint must "
                               "never hold them; the file keeps the last good state.").format(
        name=path.name, where=where))


def save_trainer(trainer, path) -> Path:
    """Write `trainer.state_dict()` to `path` with `save` (atomically), unless its weights are not finite. In a
    distributed run every rank calls it, rank 0 writes the file, and all ranks wait for it (a barrier)."""
    path = Path(path)
    _refuse_non_finite(trainer, path)
    state = trainer.state_dict()
    if trainer.is_main:
        save(state, path)
    trainer.process.barrier()
    return path


def load_trainer(trainer, path, map_location=None) -> None:
    """`trainer.load_state_dict` from the file at `path` (tensors mapped to `map_location`, by default the
    trainer's device); a state that does not fit raises CheckpointError naming the file, and changes nothing."""
    state = load(path, map_location=map_location if map_location is not None else trainer.device)
    try:
        trainer.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError, TypeError) as exc:
        raise CheckpointError(_("checkpoint '{path}' does not fit this trainer: {message}").format(
            path=path, message=exc)) from None


def resume(trainer, path: Path) -> None:
    """Continue from the checkpoint at `path` if it exists, else start fresh (say so): the same command then
    serves the first launch and every restart (torchrun --max-restarts, a preempted job)."""
    if not path.exists():
        if trainer.is_main:
            print(_("No checkpoint at '{name}' yet: starting from scratch.").format(name=path.name))
        return
    try:
        trainer.load_checkpoint(path)
    except CheckpointError as exc:  # a restart would fail the same way: say how to get going again
        raise CheckpointError(_("{error}. resume=True starts fresh only when there is no file: move '{name}' "
                                "away to start from scratch, or put back a good copy").format(
            error=str(exc).rstrip("."), name=path.name)) from None
    if trainer.is_main:
        print(_("Resumed from '{name}' at {where}.").format(name=path.name, where=trainer.where()))


# --- files ----------------------------------------------------------------------------------

def save(state: dict[str, Any], path) -> Path:
    """Write `state` to `path` atomically (temporary file in the same folder, fsync, rename).

    One process writes a given path at a time (rank 0 in a distributed run), so temporary files of the same path
    left by an earlier writer are those of a process killed while saving (SIGKILL runs no cleanup): removed. The
    file is created as a plain `open` creates one (0o666 less the umask; mkstemp's would be owner-only, 0o600), so
    other jobs of a shared cluster can read it as they could any other file there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        stale.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)  # less the umask
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX and Windows
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path, map_location=None, expected_format: str = FORMAT) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True`, or raise `CheckpointError` naming the file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(_("checkpoint '{path}' does not exist").format(path=path))
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, wrong file type, disallowed globals, a device...
        text = str(exc)
        if "deserialize object on" in text or "device" in text.lower() and "zip" not in text.lower():
            raise CheckpointError(_("checkpoint '{path}' holds tensors that cannot be mapped to {device} on this "
                                    "machine ({error}); pass map_location='cpu' or the device you train on").format(
                path=path, device=map_location or _("the devices they were saved from"),
                error=first_line(exc)[:200])) from None
        raise CheckpointError(_("checkpoint '{path}' is truncated or corrupt and cannot be loaded ({error})").format(
            path=path, error=first_line(exc)[:200])) from None
    if not isinstance(state, dict) or state.get("format") != expected_format:
        found = state.get("format") if isinstance(state, dict) else None
        extra = _(" (format {found!r}, expected {expected!r})").format(found=found, expected=expected_format) \
            if isinstance(found, str) else ""
        raise CheckpointError(_("'{path}' is a readable file but not a course_utils Trainer checkpoint").format(
            path=path) + extra)
    return state
