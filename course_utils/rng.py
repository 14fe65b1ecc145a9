"""Random state as plain values, for checkpoints that any machine can read.

- `rng_state()` / `set_rng_state(state)`: Python's, numpy's global, torch's CPU, CUDA and MPS generators, stored as
  plain bytes, so no `map_location` can move them to a GPU (where `torch.set_rng_state` would refuse them).
- `generator_state(g)` / `set_generator_state(g, state)`: the same for one `torch.Generator`.

A leaf module: it imports nothing of the package. Importing it touches no device.
"""
from __future__ import annotations

import random
from typing import Any

import torch


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
