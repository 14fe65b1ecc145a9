"""Checkpoint files: written atomically, read safely, every failure named with its file.

- `save(state, path)`: a temporary file in the same folder, flushed to disk (fsync), then renamed over the
  target, so a crash or a Ctrl-C mid-write never leaves a half-written checkpoint.
- `load(path, map_location)`: `torch.load(weights_only=True)` (no code in the file runs) with a
  `CheckpointError` that names the file for a missing, truncated, corrupt or foreign file, and for tensors
  that cannot be mapped to this machine's device.
- `rng_state()` / `set_rng_state(state)`: Python's, torch's CPU, CUDA and MPS generators, stored as plain
  bytes, so no `map_location` can move them to a GPU (where `torch.set_rng_state` would refuse them).
- `generator_state(g)` / `set_generator_state(g, state)`: the same for one `torch.Generator`.
- `EpochPosition`: where an interrupted epoch stopped, as a small dataclass (stored as a dict of plain values).
- `PARTS`, `COUNTERS`, `check_trainer_state(...)`, `match_callbacks(...)`: what a Trainer checkpoint holds (the
  state of its named parts, its counters, its callbacks' states, every rank's random and loader state), and the
  check of all of it before a load changes anything.

Importing this module touches no device.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import random
import secrets
from pathlib import Path
from typing import Any

import torch

from .errors import first_line
from .i18n import _

FORMAT = "course_utils.Trainer/3"  # /3: every rank's random and loader state


class CheckpointError(RuntimeError):
    """A checkpoint file could not be used (missing, truncated, corrupt, foreign, or not for this device)."""


class NonFiniteLossError(FloatingPointError):
    """Training produced an inf or nan loss, or a checkpoint would have held non-finite weights."""


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


# --- random number generators ------------------------------------------------------------------

PARTS = ("model", "optimizer", "precision", "step")  # a Trainer's parts: each has state_dict() / load_state_dict()
COUNTERS = ("epoch", "batches_trained", "optimizer_steps", "history", "logs")  # a Trainer's plain values


def match_callbacks(callbacks, saved: list[dict]) -> list[tuple[Any, Any]]:
    """(callback, its saved state) for each saved callback state, given to the callback of the same class in
    `callbacks` (in order). A saved state that no callback takes raises ValueError, unless it is empty."""
    waiting: dict[str, list] = {}
    for cb in callbacks:
        waiting.setdefault(type(cb).__name__, []).append(cb)
    pairs = []
    for entry in saved:
        mine = waiting.get(entry["class"])
        if mine:
            pairs.append((mine.pop(0), entry["state"]))
        elif entry["state"]:
            raise ValueError(_("the checkpoint holds the state of a {name} callback, which this trainer does not "
                               "have; pass one (e.g. the same scheduler) to resume exactly").format(name=entry["class"]))
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


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy())


def _tensor(b) -> torch.Tensor:
    if isinstance(b, torch.Tensor):  # a state saved as a tensor, wherever map_location put it
        return b.detach().to("cpu", torch.uint8)
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def _numpy_random():
    try:
        import numpy
    except ImportError:  # numpy is optional for torch
        return None
    return numpy.random


def rng_state() -> dict[str, Any]:
    """The state of every random number generator a training step may draw from, as plain values: Python's,
    numpy's global one (augmentations often use it), torch's CPU, CUDA and MPS generators."""
    state: dict[str, Any] = {"python": _to_lists(random.getstate()), "torch": _bytes(torch.get_rng_state())}
    np_random = _numpy_random()
    if np_random is not None:
        name, keys, pos, has_gauss, gauss = np_random.get_state()
        state["numpy"] = [name, bytes(keys.astype("<u4").tobytes()), int(pos), int(has_gauss), float(gauss)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        state["mps"] = _bytes(mps.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned. The generators get CPU byte tensors, whatever device a loaded
    checkpoint was mapped to; a CUDA or MPS state is skipped on a machine without that device."""
    random.setstate(_to_tuples(state["python"]))
    torch.set_rng_state(_tensor(state["torch"]))
    np_random = _numpy_random()
    if state.get("numpy") is not None and np_random is not None:
        import numpy
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np_random.set_state((name, numpy.frombuffer(bytes(keys), dtype="<u4").astype(numpy.uint32), pos, has_gauss,
                             gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])
    if state.get("mps") is not None and torch.backends.mps.is_available():
        torch.mps.set_rng_state(_tensor(state["mps"]))


def generator_state(generator: torch.Generator) -> bytes:
    return _bytes(generator.get_state())


def set_generator_state(generator: torch.Generator, state) -> None:
    generator.set_state(_tensor(state))


# --- where an interrupted epoch stopped -----------------------------------------------------------

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
            raise ValueError(f"an epoch position has the entries {sorted(names)}")
        return cls(**d)


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
