"""Exercises of notebook 03, "Moving models and data between devices".

03.1 move an input to the model's device and dtype, 03.2 move a nested batch (namedtuples and OrderedDicts
included) without touching the caller's, 03.3 DataLoader settings that feed a training step of a given time,
03.4 load a checkpoint saved on another device, safely.
The checkers use the `meta` device and checkpoints tagged with a CUDA device this machine lacks, so
every check behaves the same with or without a GPU.
"""
from __future__ import annotations

import contextlib
import io
import re
import warnings
import zipfile
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..i18n import N_, _
from .core import Exercise, Incorrect, Mistake, call, describe, register, short
from .probe import hold, observe


def _first_param(model: nn.Module) -> torch.Tensor:
    return next(model.parameters())


# --- 03.1 follow the model --------------------------------------------------------------------

def _to_model_call(to_model, x, model):
    """to_model(x, model), with feedback for the ways of asking a module for its device that do not work."""
    try:
        return call(to_model, x, model, name="to_model", check_mutation=False)
    except Incorrect as exc:
        if "has no attribute 'device'" in str(exc):
            raise Incorrect(_("model.device raised AttributeError: likely mistake: an nn.Module has no .device "
                              "(its parameters could even live on several devices); ask one of its parameters: "
                              "next(model.parameters()).device")) from None
        if "has no attribute 'weight'" in str(exc):
            raise Incorrect(_("{error}: likely mistake: model.weight exists on a single layer such as nn.Linear, not "
                              "on every module (an nn.Sequential has none of its own); ask one of its parameters: "
                              "next(model.parameters())").format(error=exc)) from None
        if "'generator' object is not subscriptable" in str(exc):
            raise Incorrect(_("{error}: likely mistake: model.parameters() is a generator, which has no [0]; "
                              "next(model.parameters()) gives the first parameter").format(error=exc)) from None
        raise


def _check_to_model(to_model):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    x_before = x.clone()
    model = nn.Linear(4, 3).to("meta", torch.bfloat16)  # a device other than the CPU, on any machine

    def first():
        result = _to_model_call(to_model, x, model)
        return result, result is x

    out, returned_x = observe(first)
    if not observe(lambda: torch.equal(x, x_before) and x.device.type == "cpu"):
        raise Incorrect(_("to_model changed x in place; return a new tensor and leave the caller's x as it was"))
    if returned_x or (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.float32):
        raise Incorrect(_("to_model returned x unchanged (on cpu, float32) although the model is on meta in "
                          "bfloat16: likely mistake: calling x.to(...) without assignment; for a tensor, .to() "
                          "returns a new tensor and leaves x where it was"))
    if not isinstance(out, torch.Tensor):
        raise Incorrect(_("to_model should return a tensor, got {value}").format(value=describe(out)))
    if out.shape != x_before.shape:
        raise Incorrect(_("to_model changed the shape from {before} to {after}").format(
            before=tuple(x_before.shape), after=tuple(out.shape)))
    model_device = observe(lambda: _first_param(model).device)  # where the model is now (the answer may move it)
    if out.device != model_device:
        raise Incorrect(_("the result is on {device}, the model on {model_device}: move x to "
                          "the device of the model's parameters").format(
            device=out.device, model_device=model_device))
    if out.dtype != torch.bfloat16:
        raise Incorrect(_("the result is on the model's device but in {dtype}, the model in torch.bfloat16: "
                          "likely mistake: only the device was converted; ask the parameter for its dtype too"
                          ).format(dtype=out.dtype))
    # A second model (CPU, float64): the answer must follow the model, not hard-code meta or bfloat16.
    model64 = nn.Linear(4, 3).double()
    out64 = observe(lambda: _to_model_call(to_model, x, model64))
    if not isinstance(out64, torch.Tensor) or out64.dtype != torch.float64 or out64.device.type != "cpu":
        raise Incorrect(_("for a float64 model on the CPU, to_model returned {value}: read the device "
                          "and dtype from the model you are given instead of fixing them in the code"
                          ).format(value=describe(out64)))
    if not torch.equal(out64, x_before.double()):
        raise Incorrect(_("the values changed: converting should keep them (up to the new dtype's precision)"))
    # A model that is not one layer: a Sequential has no .weight of its own.
    stack = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).to("meta", torch.float16)
    out16 = observe(lambda: _to_model_call(to_model, x, stack))
    if not isinstance(out16, torch.Tensor) or out16.dtype != torch.float16 or out16.device.type != "meta":
        raise Incorrect(_("for an nn.Sequential on meta in float16, to_model returned {value}: read the device and "
                          "dtype from the model's parameters").format(value=describe(out16)))
    return _("x now follows the model, whichever device and dtype that is")


register(Exercise(
    id="03.1", title=N_("Follow the model"), answer="to_model",
    blank=("def to_model(x, model):\n"
           "    \"\"\"Return x on the same device and in the same dtype as model's parameters.\"\"\"\n"
           "    raise NotImplementedError  # your code here\n"),
    solution=("def to_model(x, model):\n"
              "    \"\"\"Return x on the same device and in the same dtype as model's parameters.\"\"\"\n"
              "    param = next(model.parameters())\n"
              "    return x.to(device=param.device, dtype=param.dtype)\n"),
    setup="import torch\nfrom torch import nn\n",
    checker=_check_to_model,
    hints=[N_("A module has no .device attribute; its parameters do: next(model.parameters())."),
           N_("Tensor.to accepts both at once: x.to(device=..., dtype=...). It returns a new tensor: return it.")],
    mistakes=[
        Mistake("def to_model(x, model):\n    return x.to(model.device)\n", "has no .device"),
        Mistake("def to_model(x, model):\n    x.to(next(model.parameters()).device)\n    return x\n",
                "without assignment"),
        Mistake("def to_model(x, model):\n    return x.to(next(model.parameters()).device)\n", "dtype too"),
        Mistake("def to_model(x, model):\n    return x.to(device=model.weight.device, dtype=model.weight.dtype)\n",
                "model.weight exists on a single layer"),
        Mistake("def to_model(x, model):\n    param = model.parameters()[0]\n"
                "    return x.to(device=param.device, dtype=param.dtype)\n", "is a generator"),
    ],
))


# --- 03.2 move a nested batch -----------------------------------------------------------------

class Boxes(NamedTuple):
    """A namedtuple in a batch, as detection datasets return: its fields are passed by position."""
    xyxy: torch.Tensor
    scores: torch.Tensor


def _sample_batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"image": torch.rand(2, 3, 4, 4, generator=gen), "label": torch.tensor([3, 1]),
            "extra": [torch.ones(2), "id-7", 3], "pair": (torch.zeros(2, 1), torch.arange(2)),
            "boxes": Boxes(torch.rand(2, 4, generator=gen), torch.tensor([0.9, 0.4])),
            "meta": OrderedDict(scale=torch.tensor(0.5), name="batch-0")}


def _deep_batch() -> dict:
    """Containers in containers in containers: a list of dicts, lists of lists of tuples."""
    return {"crops": [{"mask": torch.ones(2, 2), "box": (torch.zeros(4), "crop-0")}],
            "levels": [[(torch.arange(3),)], []]}


def _leaves(batch: dict) -> list:
    return [batch["image"], batch["label"], batch["extra"][0], batch["pair"][0], batch["pair"][1],
            batch["boxes"][0], batch["boxes"][1], batch["meta"]["scale"]]


def _mirror(moved, original):
    """What `_compare` needs to know of `moved` (move_batch's output), as plain data, read along the structure of
    `original` (so a self-containing answer cannot make it recurse without end): a tagged tuple per node."""
    if isinstance(original, torch.Tensor):
        if not isinstance(moved, torch.Tensor):
            return ("not a tensor", describe(moved))
        return ("tensor", moved.device, tuple(moved.shape), moved.dtype)
    if isinstance(original, (list, tuple, dict)):
        if type(moved) is not type(original):
            return ("other type", describe(moved))
        if isinstance(original, dict):
            return ("dict", [(str.__str__(key) if isinstance(key, str) else key,
                              _mirror(value, original[key]) if key in original else None)
                             for key, value in moved.items()])
        return ("sequence", len(moved), [_mirror(m, o) for m, o in zip(moved, original)])
    return ("value", str.__str__(moved) if isinstance(moved, str) else moved)


def _compare(mirror, original, where: str, device: torch.device) -> None:
    """The output `mirror` describes (see `_mirror`) must mirror `original` with every tensor on `device`; raises
    Incorrect otherwise."""
    kind = mirror[0]
    if isinstance(original, torch.Tensor):
        if kind != "tensor":
            raise Incorrect(_("{where} should be a tensor, got {value}").format(where=where, value=mirror[1]))
        moved_device, moved_shape, moved_dtype = mirror[1:]
        if moved_device != device:
            raise Incorrect(_("{where} is on {actual}, not on {device}: every tensor in the batch must be "
                              "moved, however deeply it is nested (recurse into lists, tuples and dicts)").format(
                where=where, actual=moved_device, device=device))
        if moved_shape != tuple(original.shape) or moved_dtype != original.dtype:
            raise Incorrect(_("{where} changed from {shape} {dtype} to {new_shape} {new_dtype}: move it, "
                              "don't convert it").format(where=where, shape=tuple(original.shape),
                                                         dtype=original.dtype, new_shape=moved_shape,
                                                         new_dtype=moved_dtype))
        return
    if isinstance(original, (list, tuple, dict)):
        if kind == "other type":
            if isinstance(original, OrderedDict):
                raise Incorrect(_("{where} was an OrderedDict and came back as {value}: likely mistake: a "
                                  "dict comprehension always builds a plain dict; build the same type, e.g. "
                                  "type(batch)((key, ...) for key, value in batch.items())").format(
                    where=where, value=mirror[1]))
            raise Incorrect(_("{where} was a {type} and came back as {value}: "
                              "keep each container's type (tuple stays tuple, list stays list)").format(
                where=where, type=type(original).__name__, value=mirror[1]))
        if isinstance(original, dict):
            items = mirror[1]
            keys = [key for key, node in items]
            if not all(type(key) is str for key in keys) or set(keys) != set(original):
                shown = sorted(keys) if all(type(key) is str for key in keys) else sorted(keys, key=short)
                raise Incorrect(_("{where} has keys {keys}, expected {expected}").format(
                    where=where, keys=shown, expected=sorted(original)))
            nodes = dict(items)
            for key in original:
                _compare(nodes[key], original[key], f"{where}[{key!r}]", device)
        else:
            count, nodes = mirror[1:]
            if count != len(original):
                raise Incorrect(_("{where} has {count} items, expected {expected}").format(
                    where=where, count=count, expected=len(original)))
            for i, (m, o) in enumerate(zip(nodes, original)):
                _compare(m, o, f"{where}[{i}]", device)
        return
    moved = mirror[1]
    if moved != original:
        raise Incorrect(_("{where} was {original!r} and came back as {value}: values that are not "
                          "tensors should pass through unchanged").format(
            where=where, original=original, value=describe(moved)))


def _raised(message: str) -> str:
    """The "Error: text" part of the feedback `call` gives for an exception (in English or in Chinese)."""
    if " raised " in message:
        return message.split(" raised ", 1)[-1]
    found = re.search(r"\b\w*(?:Error|Exception)\b.*", message, re.S)
    return found.group(0) if found else message


def _check_move_batch(move_batch):
    batch = _sample_batch()
    leaves = _leaves(batch)
    before = leaves + [batch[key] for key in ("extra", "pair", "boxes", "meta")]
    target = torch.device("meta")  # every machine has it: the tensors really change device
    try:
        out = hold(lambda: call(move_batch, batch, target, name="move_batch", check_mutation=False))
    except Incorrect as exc:
        what = _raised(str(exc))
        if "has no attribute 'to'" in str(exc):
            raise Incorrect(_("move_batch raised {error}: likely mistake: .to() was called on something that is "
                              "not a tensor; recurse into lists, tuples and dicts, and return anything else "
                              "unchanged").format(error=what)) from None
        if "RecursionError" in str(exc):
            raise Incorrect(_("move_batch raised {error}: likely mistake: a string is iterable too, and each of its "
                              "characters is a string again, so recursing into every iterable never ends; recurse "
                              "into lists, tuples and dicts only").format(error=what)) from None
        if "missing 1 required positional argument" in str(exc):
            raise Incorrect(_("move_batch raised {error}: likely mistake: batch['boxes'] is a namedtuple, whose "
                              "constructor takes the fields as separate arguments, not one iterable: for a "
                              "namedtuple write type(batch)(*items)").format(error=what)) from None
        raise

    def batch_changed():
        now = _leaves(batch) + [batch[key] for key in ("extra", "pair", "boxes", "meta")]
        return any(a is not b for a, b in zip(before, now))

    if observe(batch_changed):
        raise Incorrect(_("move_batch changed the caller's batch in place (its dict or list now holds the moved "
                          "tensors); build new containers and leave the input as it was"))
    if observe(lambda: out is None):
        raise Incorrect(_("move_batch returned None: did you forget a `return`?"))
    _compare(observe(lambda: _mirror(out, _sample_batch())), _sample_batch(), "batch", target)
    deep = observe(lambda: _mirror(call(move_batch, _deep_batch(), target, name="move_batch", check_mutation=False),
                                   _deep_batch()))
    _compare(deep, _deep_batch(), "deep", target)
    single = observe(lambda: _mirror(call(move_batch, torch.ones(3), target, name="move_batch", check_mutation=False),
                                     torch.ones(3)))
    _compare(single, torch.ones(3), _("a bare tensor"), target)
    text = observe(lambda: _mirror(call(move_batch, "text", target, name="move_batch", check_mutation=False), "text"))
    if text[1] != "text":
        raise Incorrect(_("move_batch('text', device) should return 'text' unchanged"))
    return _("every tensor moved, the structure and the other values kept, the caller's batch untouched")


_MOVE_DOC = ("def move_batch(batch, device):\n"
             "    \"\"\"A copy of batch with every tensor moved to device; batch is a tensor or a list, tuple or\n"
             "    dict of batches (nested); anything else comes back unchanged.\"\"\"\n")

register(Exercise(
    id="03.2", title=N_("Move a nested batch"), answer="move_batch",
    blank=_MOVE_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_MOVE_DOC + (
        "    if isinstance(batch, torch.Tensor):\n"
        "        return batch.to(device)\n"
        "    if isinstance(batch, tuple) and hasattr(batch, \"_fields\"):  # a namedtuple: fields by position\n"
        "        return type(batch)(*(move_batch(item, device) for item in batch))\n"
        "    if isinstance(batch, (list, tuple)):\n"
        "        return type(batch)(move_batch(item, device) for item in batch)\n"
        "    if isinstance(batch, dict):  # dict, OrderedDict, ...: the same type, built from pairs\n"
        "        return type(batch)((key, move_batch(value, device)) for key, value in batch.items())\n"
        "    return batch\n"),
    setup="import torch\n",
    checker=_check_move_batch,
    hints=[N_("Handle four cases: a tensor (move it), a list or tuple, a dict, anything else (return it as is)."),
           N_("For the containers, call move_batch on each item: that handles any depth of nesting."),
           N_("type(batch)(... for item in batch) rebuilds a list as a list and a tuple as a tuple, and "
              "type(batch)((key, value) ...) a dict or an OrderedDict as what it was."),
           N_("A namedtuple is a tuple with `_fields`; its constructor takes one argument per field: "
              "type(batch)(*items).")],
    mistakes=[
        Mistake("def move_batch(batch, device):\n    return {k: v.to(device) for k, v in batch.items()}\n",
                "recurse into lists"),
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, (list, tuple)):\n"
                "        return [move_batch(item, device) for item in batch]\n"
                "    if isinstance(batch, dict):\n"
                "        return {key: move_batch(value, device) for key, value in batch.items()}\n"
                "    return batch\n", "container's type"),
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, dict):\n"
                "        for key in batch:\n"
                "            batch[key] = move_batch(batch[key], device)\n"
                "        return batch\n"
                "    if isinstance(batch, list):\n"
                "        for i in range(len(batch)):\n"
                "            batch[i] = move_batch(batch[i], device)\n"
                "        return batch\n"
                "    if isinstance(batch, tuple):\n"
                "        return tuple(move_batch(item, device) for item in batch)\n"
                "    return batch\n", "in place"),
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, (list, tuple)):\n"
                "        return type(batch)(move_batch(item, device) for item in batch)\n"
                "    if isinstance(batch, dict):\n"
                "        return {key: move_batch(value, device) for key, value in batch.items()}\n"
                "    return batch\n", "namedtuple"),
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, tuple) and hasattr(batch, '_fields'):\n"
                "        return type(batch)(*(move_batch(item, device) for item in batch))\n"
                "    if isinstance(batch, (list, tuple)):\n"
                "        return type(batch)(move_batch(item, device) for item in batch)\n"
                "    if isinstance(batch, dict):\n"
                "        return {key: move_batch(value, device) for key, value in batch.items()}\n"
                "    return batch\n", "dict comprehension always builds a plain dict"),
        # lists and tuples of tensors handled, but not lists of containers
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, tuple) and hasattr(batch, '_fields'):\n"
                "        return type(batch)(*(move_batch(item, device) for item in batch))\n"
                "    if isinstance(batch, (list, tuple)):\n"
                "        return type(batch)(item.to(device) if isinstance(item, torch.Tensor) else item "
                "for item in batch)\n"
                "    if isinstance(batch, dict):\n"
                "        return type(batch)((key, move_batch(value, device)) for key, value in batch.items())\n"
                "    return batch\n", "however deeply it is nested"),
        Mistake("def move_batch(batch, device):\n"
                "    if isinstance(batch, torch.Tensor):\n"
                "        return batch.to(device)\n"
                "    if isinstance(batch, dict):\n"
                "        return type(batch)((key, move_batch(value, device)) for key, value in batch.items())\n"
                "    if hasattr(batch, '__iter__'):\n"
                "        items = [move_batch(item, device) for item in batch]\n"
                "        return type(batch)(*items) if hasattr(batch, '_fields') else type(batch)(items)\n"
                "    return batch\n", "a string is iterable too"),
    ],
))


# --- 03.3 a DataLoader that feeds the step -------------------------------------------------------

class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        return torch.zeros(3), 0


# (per-sample work in ms, training step in ms, batch size, CPU cores, device type)
_FEED_CASES = [
    (0.5, 20.0, 64, 8, "cuda"),   # 32 ms per batch and worker, a 20 ms step: 2 workers
    (2.0, 10.0, 32, 16, "cuda"),  # 64 ms per batch and worker, a 10 ms step: 7 workers (6.4 is not enough)
    (0.0, 5.0, 256, 8, "cuda"),   # data already in memory, nothing per sample: no workers
    (1.0, 4.0, 64, 4, "cuda"),    # 16 workers would be needed; 4 cores leave room for 3 beside the main process
    (0.5, 20.0, 64, 8, "cpu"),    # as the first, without a GPU
    (1.0, 16.0, 32, 8, "cuda"),   # 32 ms per batch and worker, a 16 ms step: exactly 2 workers, not 3
    (2.0, 10.0, 32, 1, "cuda"),   # one core, kept by the main process: no workers, whatever the work
]


def _expected_settings(sample_ms, step_ms, batch_size, cores, device_type) -> dict:
    import math
    needed = math.ceil(batch_size * sample_ms / step_ms) if sample_ms > 0 else 0
    workers = min(needed, cores - 1)
    return {"batch_size": batch_size, "num_workers": workers, "persistent_workers": workers > 0,
            "pin_memory": device_type == "cuda" and workers > 0}


@contextlib.contextmanager
def _cores_seen_as(n: int):
    """For the duration of the block, this machine appears to have `n` cores to the usual ways of asking."""
    import multiprocessing
    import os
    from unittest import mock

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(os, "cpu_count", lambda: n))
        stack.enter_context(mock.patch.object(multiprocessing, "cpu_count", lambda: n))
        for name, fake in (("process_cpu_count", lambda: n), ("sched_getaffinity", lambda pid: set(range(n)))):
            if hasattr(os, name):
                stack.enter_context(mock.patch.object(os, name, fake))
        yield


def _settings_seen(got):
    """loader_settings' answer as plain data: a dict (of any dict type) as a plain dict whose keys are strings
    where they were (anything else as its short repr), so DataLoader(**got) can run in the checker."""
    if not isinstance(got, dict):
        return got
    return {str.__str__(k) if isinstance(k, str) else k if type(k) in (int, float, bool) else short(k): v
            for k, v in got.items()}


def _check_reads_no_machine(loader_settings) -> None:
    """The settings are for the machine the arguments describe: the same arguments on machines with other core
    counts give the same settings."""
    case = (1.0, 4.0, 64, 4, "cuda")

    def on_machine(n: int):
        with _cores_seen_as(n):
            return _settings_seen(call(loader_settings, *case, name="loader_settings"))

    got = [observe(lambda: on_machine(n)) for n in (9, 13)]
    try:
        differ = bool(got[0] != got[1])
    except (RuntimeError, ValueError):  # tensors among the settings: no one truth value
        differ = True
    if differ:
        workers = [g.get("num_workers") if isinstance(g, dict) else g for g in got]
        raise Incorrect(_("loader_settings(sample_ms=1.0, step_ms=4.0, batch_size=64, cores=4, device_type='cuda') "
                          "returned num_workers={a} on a machine with 9 cores and {b} on one with 13: likely "
                          "mistake: the cores of the machine running it (os.cpu_count()) instead of the `cores` "
                          "argument; the settings are for the machine the arguments describe, here at most "
                          "cores - 1 = 3 workers").format(a=workers[0], b=workers[1]))


def _check_loader_settings(loader_settings):
    if observe(lambda: isinstance(loader_settings, type) or not callable(loader_settings)):
        raise Incorrect(_("loader_settings should be a function, got {value}").format(
            value=observe(lambda: describe(loader_settings))))
    import math
    _check_reads_no_machine(loader_settings)
    for case in _FEED_CASES:
        sample_ms, step_ms, batch_size, cores, device_type = case
        label = (f"loader_settings(sample_ms={sample_ms}, step_ms={step_ms}, batch_size={batch_size}, "
                 f"cores={cores}, device_type={device_type!r})")
        got = observe(lambda: _settings_seen(call(loader_settings, *case, name="loader_settings")))
        if not isinstance(got, dict):
            raise Incorrect(_("{label} should return a dict of DataLoader arguments, got {value}").format(
                label=label, value=describe(got)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "this DataLoader will create N worker processes": not on this machine
                DataLoader(_Samples(), **got)
        except (TypeError, ValueError) as exc:
            if "persistent_workers" in str(exc):
                raise Incorrect(_("{label}: DataLoader(**settings) raised {error}: {message}: likely "
                                  "mistake: persistent_workers=True with num_workers=0; there are no workers to "
                                  "keep").format(label=label, error=type(exc).__name__, message=exc)) from None
            raise Incorrect(_("{label}: DataLoader(**settings) raised {error}: {message}").format(
                label=label, error=type(exc).__name__, message=exc)) from None
        expected = _expected_settings(*case)
        workers = got.get("num_workers", 0)
        if got.get("batch_size", 1) != batch_size:
            raise Incorrect(_("{label} returned batch_size={value!r}: the step was timed at "
                              "batch {batch_size}; keep it").format(label=label, value=got.get("batch_size", 1),
                                                                    batch_size=batch_size))
        if workers != expected["num_workers"]:
            per_batch = batch_size * sample_ms
            needed = math.ceil(per_batch / step_ms) if sample_ms > 0 else 0
            if (sample_ms > 0 and per_batch % step_ms == 0 and workers == needed + 1
                    and workers <= cores - 1):
                raise Incorrect(_("{label} returned num_workers={workers}: one worker prepares a batch in "
                                  "{per_batch:g} ms, so exactly {needed} keep up with the {step_ms:g} ms step: likely "
                                  "mistake: int(...) + 1 to round up adds a worker when the division is exact; "
                                  "math.ceil rounds up only a fraction").format(
                    label=label, workers=workers, per_batch=per_batch, needed=needed, step_ms=step_ms))
            if sample_ms == 0:
                raise Incorrect(_("{label} returned num_workers={workers}: with no per-sample work (data already in "
                                  "memory) workers only add start-up and the trip through shared memory; use 0"
                                  ).format(label=label, workers=workers))
            if workers > cores - 1:
                raise Incorrect(_("{label} returned num_workers={workers}, on {cores} cores: likely mistake: more "
                                  "workers than the cores beside the main process; they only compete with each "
                                  "other and with the training loop. Use at most cores - 1 = {most}").format(
                    label=label, workers=workers, cores=cores, most=cores - 1))
            if workers < expected["num_workers"]:
                supply = per_batch / workers if workers else per_batch + step_ms
                raise Incorrect(_("{label} returned num_workers={workers}: one worker prepares a batch in "
                                  "batch_size x sample_ms = {per_batch:g} ms, so {workers} supply one every "
                                  "{supply:g} ms, slower than the {step_ms:g} ms step: likely mistake: rounding down "
                                  "(or forgetting the batch size); {needed} workers are needed").format(
                    label=label, workers=workers, per_batch=per_batch, supply=supply, step_ms=step_ms,
                    needed=needed))
            raise Incorrect(_("{label} returned num_workers={workers}: {expected} keep up with the "
                              "step (each prepares a batch in {per_batch:g} ms); more only cost start-up and memory"
                              ).format(label=label, workers=workers, expected=expected["num_workers"],
                                       per_batch=per_batch))
        if bool(got.get("persistent_workers", False)) != expected["persistent_workers"]:
            raise Incorrect(_("{label} returned persistent_workers={value!r}: likely "
                              "mistake: without it the workers are started again at every epoch (the first batch of "
                              "each epoch waits for them); keep them with persistent_workers=True").format(
                label=label, value=got.get("persistent_workers", False)))
        if bool(got.get("pin_memory", False)) != expected["pin_memory"]:
            if device_type != "cuda":
                raise Incorrect(_("{label} returned pin_memory=True: likely mistake: pinned memory is for copies to "
                                  "a CUDA GPU; without one there is nothing to pin for (DataLoader warns)").format(
                    label=label))
            if workers == 0:
                raise Incorrect(_("{label} returned pin_memory=True with no workers: likely mistake: then the main "
                                  "process pins every batch itself, between steps: that is pinning on the fly, "
                                  "which costs about what the plain copy it replaces costs. Pin when workers (and "
                                  "the loader's pinning thread) do it in the background").format(label=label))
            raise Incorrect(_("{label} returned pin_memory=False: with workers, the loader's pinning thread pins "
                              "each batch in the background, and a pinned batch copies faster (and with "
                              "non_blocking=True without making the CPU wait); use pin_memory=True on CUDA"
                              ).format(label=label))
    return _("each worker prepares a batch in batch_size x sample_ms; ceil(that / step_ms) workers keep up, within "
             "the cores beside the main process, kept alive between epochs, pinning in the background on CUDA")


_FEED_DOC = ("def loader_settings(sample_ms, step_ms, batch_size, cores, device_type):\n"
             "    \"\"\"DataLoader arguments (a dict for DataLoader(dataset, **settings)) that feed a training step of\n"
             "    step_ms milliseconds at batch_size, when each sample needs sample_ms of CPU work.\"\"\"\n")
_FEED_SOLUTION = _FEED_DOC + (
    "    per_batch = batch_size * sample_ms  # ms one worker needs for one batch\n"
    "    workers = math.ceil(per_batch / step_ms) if sample_ms > 0 else 0\n"
    "    workers = min(workers, cores - 1)  # one core stays with the main process\n"
    "    return {\"batch_size\": batch_size, \"num_workers\": workers, \"persistent_workers\": workers > 0,\n"
    "            \"pin_memory\": device_type == \"cuda\" and workers > 0}\n")


def _feed(workers: str, persistent: str = "workers > 0", pin: str = "device_type == \"cuda\" and workers > 0") -> str:
    return _FEED_DOC + (f"    workers = {workers}\n"
                        f"    return {{\"batch_size\": batch_size, \"num_workers\": workers, "
                        f"\"persistent_workers\": {persistent},\n            \"pin_memory\": {pin}}}\n")


register(Exercise(
    id="03.3", title=N_("A DataLoader that feeds the step"), answer="loader_settings",
    blank=_FEED_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_FEED_SOLUTION,
    setup="import math\n",
    checker=_check_loader_settings,
    hints=[N_("One worker prepares a whole batch: batch_size * sample_ms milliseconds. k workers working side by "
              "side deliver k batches in that time; the loop consumes one every step_ms."),
           N_("Round up (math.ceil): 6.4 workers' worth of work needs 7. No per-sample work needs no workers. Leave "
              "one core for the main process."),
           N_("persistent_workers only makes sense with workers; pin_memory only with a CUDA GPU, and pays when "
              "workers run (the loader then pins in a background thread).")],
    mistakes=[
        Mistake(_feed("4"), "more only cost"),
        Mistake(_feed("int(batch_size * sample_ms / step_ms)"), "rounding down"),
        Mistake(_feed("math.ceil(sample_ms / step_ms) if sample_ms > 0 else 0"), "forgetting the batch size"),
        Mistake(_feed("math.ceil(batch_size * sample_ms / step_ms) if sample_ms > 0 else 0"), "cores - 1"),
        Mistake(_feed("min(math.ceil(batch_size * sample_ms / step_ms), cores - 1)", persistent="True"),
                "persistent_workers=True with num_workers=0"),
        Mistake(_feed("min(math.ceil(batch_size * sample_ms / step_ms), cores - 1)", persistent="False"),
                "started again at every epoch"),
        Mistake(_feed("min(math.ceil(batch_size * sample_ms / step_ms), cores - 1)", pin="True"),
                "pinning on the fly"),
        Mistake(_feed("min(math.ceil(batch_size * sample_ms / step_ms), cores - 1)", pin="device_type == \"cuda\""),
                "pinning on the fly"),
        Mistake(_feed("min(int(batch_size * sample_ms / step_ms) + 1, cores - 1) if sample_ms > 0 else 0"),
                "adds a worker when the division is exact"),
        Mistake(_feed("max(1, min(math.ceil(batch_size * sample_ms / step_ms), cores - 1)) if sample_ms > 0 else 0"),
                "Use at most cores - 1 = 0"),
        Mistake("import os\n" + _feed("min(math.ceil(batch_size * sample_ms / step_ms), os.cpu_count() - 1) "
                                      "if sample_ms > 0 else 0"), "os.cpu_count()"),
    ],
))


# --- 03.4 a checkpoint from another device ----------------------------------------------------

def _claim_device(checkpoint: bytes, device: str) -> bytes:
    """Rewrite a CPU checkpoint (bytes written by torch.save) so its tensors say they were saved on `device`.

    torch.save records, for each storage, the device it lived on (the string "cpu" here) in the archive's
    data.pkl; torch.load puts the storage back there unless map_location says otherwise.
    """
    src = zipfile.ZipFile(io.BytesIO(checkpoint))
    out = io.BytesIO()
    old = b"X\x03\x00\x00\x00cpu"  # the pickled string "cpu" (BINUNICODE: 4-byte length, then the text)
    new = b"X" + len(device).to_bytes(4, "little") + device.encode()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("data.pkl"):
                if old not in data:
                    raise ValueError(_("no CPU storage found in this checkpoint"))
                data = data.replace(old, new)
            dst.writestr(name, data)
    return out.getvalue()


def _absent_cuda_device() -> str:
    """A CUDA device this machine does not have (without initialising CUDA when there is none)."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda:0"


_payload_runs: list[int] = []


def _payload() -> None:
    """What the booby-trapped checkpoint calls while being unpickled (it only records that it ran)."""
    _payload_runs.append(1)


class _Trap:
    def __reduce__(self):
        return (_payload, ())


def _check_load_weights(load_weights):
    gen = torch.Generator().manual_seed(3)
    saved = nn.Linear(3, 2)
    with torch.no_grad():
        for p in saved.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    buf = io.BytesIO()
    torch.save(saved.state_dict(), buf)
    elsewhere = _claim_device(buf.getvalue(), _absent_cuda_device())
    model = nn.Linear(3, 2)

    def first():
        result = call(load_weights, io.BytesIO(elsewhere), model, name="load_weights", check_mutation=False)
        return result is model, isinstance(result, tuple) and hasattr(result, "missing_keys"), describe(result)

    try:
        returned_model, returned_keys, out_text = observe(first)
    except Incorrect as exc:
        if "deserialize" in str(exc):
            raise Incorrect(_("torch.load failed on a checkpoint saved on a GPU this machine does not have: likely "
                              "mistake: no map_location; map the tensors to the model's device while loading"
                              )) from None
        if "has no attribute 'device'" in str(exc):
            raise Incorrect(_("model.device raised AttributeError: likely mistake: an nn.Module has no .device "
                              "(its parameters could even live on several devices); ask one of its parameters: "
                              "next(model.parameters()).device")) from None
        raise
    if not returned_model:
        if returned_keys:
            raise Incorrect(_("load_weights returned what load_state_dict returns (missing and unexpected keys): "
                              "return the model itself"))
        raise Incorrect(_("load_weights should return the model it was given, got {value}").format(value=out_text))
    loaded = observe(lambda: [(name, p.detach().cpu()) for name, p in model.named_parameters()])
    for name, p in loaded:
        if not torch.equal(p, saved.state_dict()[name]):
            raise Incorrect(_("after loading, {name} does not hold the saved values: call model.load_state_dict"
                              ).format(name=name))
    # The same checkpoint given as a path, the other kind of source torch.load takes.
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "weights.pt")
        with open(path, "wb") as f:
            f.write(elsewhere)
        from_path = nn.Linear(3, 2)

        def load_from_path():
            try:
                call(load_weights, path, from_path, name="load_weights", check_mutation=False)
            except Incorrect as exc:  # the feedback names the file, not the temporary folder drawn at random
                raise Incorrect(str(exc).replace(folder + os.sep, "")) from None
            return [(n, p.detach().cpu()) for n, p in from_path.named_parameters()]

        try:
            loaded = observe(load_from_path)
        except Incorrect as exc:
            raise Incorrect(_("given a path (a str), {error}: likely mistake: source is used as a file object "
                              "(source.seek, source.read, io.BytesIO(...)); torch.load takes a path or a file object "
                              "as it is: hand it source").format(error=exc)) from None
    if not all(torch.equal(p, saved.state_dict()[n]) for n, p in loaded):
        raise Incorrect(_("given a path (a str), load_weights did not load the saved values into the model"))
    # A booby-trapped file: unpickling it calls a function. Loading it must fail, not run that function.
    trap = io.BytesIO()
    torch.save({"weight": torch.zeros(2, 3), "bias": _Trap()}, trap)

    def load_trap():  # whether load_weights refused the file, and whether the function hidden in it ran
        _payload_runs.clear()
        try:
            call(load_weights, io.BytesIO(trap.getvalue()), nn.Linear(3, 2), name="load_weights",
                 check_mutation=False)
        except Incorrect:
            return True, bool(_payload_runs)  # refusing the file is the right outcome
        return False, bool(_payload_runs)

    refused, payload_ran = observe(load_trap)
    if payload_ran:
        raise Incorrect(_("loading a booby-trapped file ran the function hidden in it: likely mistake: "
                          "weights_only=False; unpickling can run any code, so load with weights_only=True "
                          "(the default since torch 2.6) and only tensors and plain containers come back"))
    if not refused:
        raise Incorrect(_("given a booby-trapped file, load_weights returned normally, with the model's weights not "
                          "loaded: likely mistake: an `except` swallowed torch.load's error; let it reach the caller, "
                          "who would otherwise go on with untrained weights"))
    # Another model's checkpoint: its keys are not this model's, and loading it must fail, not load nothing.
    other = io.BytesIO()
    torch.save({"fc." + k: v for k, v in saved.state_dict().items()}, other)
    target = nn.Linear(3, 2)

    def load_other():
        call(load_weights, io.BytesIO(other.getvalue()), target, name="load_weights", check_mutation=False)

    try:
        observe(load_other)
    except Incorrect:
        pass  # load_state_dict's error about the keys came through
    else:
        raise Incorrect(_("given the checkpoint of another model, whose keys ['fc.bias', 'fc.weight'] are not this "
                          "model's ['bias', 'weight'], load_weights returned normally and the model kept its random "
                          "weights: likely mistake: strict=False (or an except around load_state_dict) hides the "
                          "mismatch; let load_state_dict raise"))
    return _("weights mapped onto the model's device, and code hidden in a file does not run")


_LOAD_DOC = ("def load_weights(source, model):\n"
             "    \"\"\"Load the state dict saved in source (a path or a file object) into model, wherever model\n"
             "    lives, without running code from the file; return model.\"\"\"\n")

register(Exercise(
    id="03.4", title=N_("A checkpoint from another device"), answer="load_weights",
    blank=_LOAD_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_LOAD_DOC + (
        "    device = next(model.parameters()).device\n"
        "    state = torch.load(source, map_location=device, weights_only=True)\n"
        "    model.load_state_dict(state)\n"
        "    return model\n"),
    setup="import torch\n",
    checker=_check_load_weights,
    inside=N_("whether the function hidden in a booby-trapped file ran while the answer loaded it"),
    hints=[N_("torch.load(source, map_location=...) decides where the tensors land, whatever device the file "
              "names."),
           N_("Map them to the device of the model's parameters; weights_only=True refuses anything but tensors "
              "and plain containers."),
           N_("model.load_state_dict(state) copies the values in; it returns the missing/unexpected keys, not the "
              "model.")],
    mistakes=[
        Mistake(_LOAD_DOC + "    model.load_state_dict(torch.load(source, weights_only=True))\n    return model\n",
                "no map_location"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=False)\n    model.load_state_dict(state)\n    return model\n",
                "weights_only=False"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=True)\n    return model.load_state_dict(state)\n",
                "return the model itself"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=True)\n    model.load_state_dict(state, strict=False)\n    return model\n",
                "strict=False"),
        Mistake(_LOAD_DOC + "    source.seek(0)\n    state = torch.load(source, map_location=next(model.parameters())"
                ".device, weights_only=True)\n    model.load_state_dict(state)\n    return model\n",
                "source is used as a file object"),
        Mistake(_LOAD_DOC + "    try:\n        state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=True)\n        model.load_state_dict(state)\n    except Exception as error:\n"
                "        print(\"could not load the checkpoint:\", type(error).__name__)\n    return model\n",
                "swallowed torch.load's error"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=model.device, weights_only=True)\n"
                "    model.load_state_dict(state)\n    return model\n", "an nn.Module has no .device"),
    ],
))
