"""Exercises of notebook 03, "Moving models and data between devices".

03.1 move an input to the model's device and dtype, 03.2 move a nested batch without touching the
caller's, 03.3 the order of a training step, 03.4 load a checkpoint saved on another device, safely.
The checkers use the `meta` device and checkpoints tagged with a CUDA device this machine lacks, so
every check behaves the same with or without a GPU.
"""
from __future__ import annotations

import io
import zipfile
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from .core import Exercise, Incorrect, Mistake, call, describe, register


def _first_param(model: nn.Module) -> torch.Tensor:
    return next(model.parameters())


# --- 03.1 follow the model --------------------------------------------------------------------

def _check_to_model(to_model):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    x_before = x.clone()
    model = nn.Linear(4, 3).to("meta", torch.bfloat16)  # a device other than the CPU, on any machine
    try:
        out = call(to_model, x, model, name="to_model", check_mutation=False)
    except Incorrect as exc:
        if "has no attribute 'device'" in str(exc):
            raise Incorrect("model.device raised AttributeError: likely mistake: an nn.Module has no .device "
                            "(its parameters could even live on several devices); ask one of its parameters: "
                            "next(model.parameters()).device") from None
        raise
    if not torch.equal(x, x_before) or x.device.type != "cpu":
        raise Incorrect("to_model changed x in place; return a new tensor and leave the caller's x as it was")
    if out is x or (isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == torch.float32):
        raise Incorrect("to_model returned x unchanged (on cpu, float32) although the model is on meta in "
                        "bfloat16: likely mistake: calling x.to(...) without assignment; for a tensor, .to() "
                        "returns a new tensor and leaves x where it was")
    if not isinstance(out, torch.Tensor):
        raise Incorrect(f"to_model should return a tensor, got {describe(out)}")
    if out.shape != x.shape:
        raise Incorrect(f"to_model changed the shape from {tuple(x.shape)} to {tuple(out.shape)}")
    if out.device != _first_param(model).device:
        raise Incorrect(f"the result is on {out.device}, the model on {_first_param(model).device}: move x to "
                        "the device of the model's parameters")
    if out.dtype != torch.bfloat16:
        raise Incorrect(f"the result is on the model's device but in {out.dtype}, the model in torch.bfloat16: "
                        "likely mistake: only the device was converted; ask the parameter for its dtype too")
    # A second model (CPU, float64): the answer must follow the model, not hard-code meta or bfloat16.
    model64 = nn.Linear(4, 3).double()
    out64 = call(to_model, x, model64, name="to_model", check_mutation=False)
    if not isinstance(out64, torch.Tensor) or out64.dtype != torch.float64 or out64.device.type != "cpu":
        raise Incorrect(f"for a float64 model on the CPU, to_model returned {describe(out64)}: read the device "
                        "and dtype from the model you are given instead of fixing them in the code")
    if not torch.equal(out64, x.double()):
        raise Incorrect("the values changed: converting should keep them (up to the new dtype's precision)")
    return "x now follows the model, whichever device and dtype that is"


register(Exercise(
    id="03.1", title="Follow the model", answer="to_model",
    blank=("def to_model(x, model):\n"
           "    \"\"\"Return x on the same device and in the same dtype as model's parameters.\"\"\"\n"
           "    raise NotImplementedError  # your code here\n"),
    solution=("def to_model(x, model):\n"
              "    \"\"\"Return x on the same device and in the same dtype as model's parameters.\"\"\"\n"
              "    param = next(model.parameters())\n"
              "    return x.to(device=param.device, dtype=param.dtype)\n"),
    setup="import torch\nfrom torch import nn\n",
    checker=_check_to_model,
    hints=["A module has no .device attribute; its parameters do: next(model.parameters()).",
           "Tensor.to accepts both at once: x.to(device=..., dtype=...). It returns a new tensor: return it."],
    mistakes=[
        Mistake("def to_model(x, model):\n    return x.to(model.device)\n", "has no .device"),
        Mistake("def to_model(x, model):\n    x.to(next(model.parameters()).device)\n    return x\n",
                "without assignment"),
        Mistake("def to_model(x, model):\n    return x.to(next(model.parameters()).device)\n", "dtype too"),
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


def _leaves(batch: dict) -> list:
    return [batch["image"], batch["label"], batch["extra"][0], batch["pair"][0], batch["pair"][1],
            batch["boxes"][0], batch["boxes"][1], batch["meta"]["scale"]]


def _compare(moved, original, where: str, device: torch.device) -> None:
    """`moved` must mirror `original` with every tensor on `device`; raises Incorrect otherwise."""
    if isinstance(original, torch.Tensor):
        if not isinstance(moved, torch.Tensor):
            raise Incorrect(f"{where} should be a tensor, got {describe(moved)}")
        if moved.device != device:
            raise Incorrect(f"{where} is on {moved.device}, not on {device}: every tensor in the batch must be "
                            "moved, however deeply it is nested (recurse into lists, tuples and dicts)")
        if moved.shape != original.shape or moved.dtype != original.dtype:
            raise Incorrect(f"{where} changed from {tuple(original.shape)} {original.dtype} to "
                            f"{tuple(moved.shape)} {moved.dtype}: move it, don't convert it")
        return
    if isinstance(original, (list, tuple, dict)):
        if type(moved) is not type(original):
            if isinstance(original, OrderedDict):
                raise Incorrect(f"{where} was an OrderedDict and came back as {describe(moved)}: likely mistake: a "
                                "dict comprehension always builds a plain dict; build the same type, e.g. "
                                "type(batch)((key, ...) for key, value in batch.items())")
            raise Incorrect(f"{where} was a {type(original).__name__} and came back as {describe(moved)}: "
                            "keep each container's type (tuple stays tuple, list stays list)")
        if isinstance(original, dict):
            if set(moved) != set(original):
                raise Incorrect(f"{where} has keys {sorted(moved)}, expected {sorted(original)}")
            for key in original:
                _compare(moved[key], original[key], f"{where}[{key!r}]", device)
        else:
            if len(moved) != len(original):
                raise Incorrect(f"{where} has {len(moved)} items, expected {len(original)}")
            for i, (m, o) in enumerate(zip(moved, original)):
                _compare(m, o, f"{where}[{i}]", device)
        return
    if moved is not original and moved != original:
        raise Incorrect(f"{where} was {original!r} and came back as {describe(moved)}: values that are not "
                        "tensors should pass through unchanged")


def _check_move_batch(move_batch):
    batch = _sample_batch()
    leaves = _leaves(batch)
    before = leaves + [batch[key] for key in ("extra", "pair", "boxes", "meta")]
    target = torch.device("meta")  # every machine has it: the tensors really change device
    try:
        out = call(move_batch, batch, target, name="move_batch", check_mutation=False)
    except Incorrect as exc:
        what = str(exc).split(" raised ", 1)[-1]
        if "has no attribute 'to'" in str(exc):
            raise Incorrect(f"move_batch raised {what}: likely mistake: .to() was called on something that is not "
                            "a tensor; recurse into lists, tuples and dicts, and return anything else unchanged"
                            ) from None
        if "missing 1 required positional argument" in str(exc):
            raise Incorrect(f"move_batch raised {what}: likely mistake: batch['boxes'] is a namedtuple, whose "
                            "constructor takes the fields as separate arguments, not one iterable: for a "
                            "namedtuple write type(batch)(*items)") from None
        raise
    now = _leaves(batch) + [batch[key] for key in ("extra", "pair", "boxes", "meta")]
    if any(a is not b for a, b in zip(before, now)):
        raise Incorrect("move_batch changed the caller's batch in place (its dict or list now holds the moved "
                        "tensors); build new containers and leave the input as it was")
    if out is None:
        raise Incorrect("move_batch returned None: did you forget a `return`?")
    _compare(out, _sample_batch(), "batch", target)
    single = call(move_batch, torch.ones(3), target, name="move_batch", check_mutation=False)
    _compare(single, torch.ones(3), "a bare tensor", target)
    if call(move_batch, "text", target, name="move_batch", check_mutation=False) != "text":
        raise Incorrect("move_batch('text', device) should return 'text' unchanged")
    return "every tensor moved, the structure and the other values kept, the caller's batch untouched"


_MOVE_DOC = ("def move_batch(batch, device):\n"
             "    \"\"\"A copy of batch with every tensor moved to device; batch is a tensor or a list, tuple or\n"
             "    dict of batches (nested); anything else comes back unchanged.\"\"\"\n")

register(Exercise(
    id="03.2", title="Move a nested batch", answer="move_batch",
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
    hints=["Handle four cases: a tensor (move it), a list or tuple, a dict, anything else (return it as is).",
           "For the containers, call move_batch on each item: that handles any depth of nesting.",
           "type(batch)(... for item in batch) rebuilds a list as a list and a tuple as a tuple, and "
           "type(batch)((key, value) ...) a dict or an OrderedDict as what it was.",
           "A namedtuple is a tuple with `_fields`; its constructor takes one argument per field: "
           "type(batch)(*items)."],
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
    ],
))


# --- 03.3 the order of a training step --------------------------------------------------------

_STEPS = {
    "A": "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
    "B": "model = model.to(device)",
    "C": "x, y = x.to(device), y.to(device)",
    "D": "loss = loss_fn(model(x), y)",
    "E": "loss.backward()",
    "F": "optimizer.step()",
    "G": "optimizer.zero_grad()",
}


def _check_order(order):
    if isinstance(order, (list, tuple)) and all(isinstance(s, str) for s in order):
        order = "".join(order)
    if not isinstance(order, str):
        raise Incorrect(f"answer should be a string of the seven letters, like \"ABCDEFG\", got {describe(order)}")
    letters = order.replace(" ", "").replace(",", "").upper()
    if sorted(letters) != sorted(_STEPS):
        raise Incorrect(f"use each of the letters A to G exactly once (got {order!r})")
    pos = {letter: letters.index(letter) for letter in letters}
    if pos["A"] < pos["B"]:
        raise Incorrect("the optimizer is created before the model is moved: likely mistake: move the model before "
                        "creating the optimizer. The optimizer keeps references to the parameters; Module.to() "
                        "converts them in place today, but PyTorch's docs ask for this order because other ways of "
                        "moving (or loading) can leave the optimizer holding tensors the model no longer uses")
    if min(pos[s] for s in "CDEFG") < pos["A"]:
        raise Incorrect("a loop step comes before the setup: moving the model and creating the optimizer happen "
                        "once, before the loop")
    if pos["D"] < pos["C"]:
        raise Incorrect("the forward pass runs before the batch is moved: the inputs must be on the model's device "
                        "before the forward pass, or you get 'Expected all tensors to be on the same device'")
    if pos["F"] < pos["E"]:
        raise Incorrect("optimizer.step() comes before backward(): likely mistake: the step would use the gradients "
                        "of the previous batch (or none at all); step after backward")
    if pos["E"] < pos["D"]:
        raise Incorrect("backward() comes before the loss is computed")
    if pos["E"] < pos["G"] < pos["F"]:
        raise Incorrect("zero_grad() sits between backward() and step(): it erases the gradients just computed, so "
                        "the step does nothing; zero the gradients before backward (or after step)")
    return "setup once (model to the device, then the optimizer), then per batch: move, zero, forward, backward, step"


register(Exercise(
    id="03.3", title="The order of a training step", answer="order",
    blank="order = ...\n",
    solution="order = \"BACGDEF\"\n",
    checker=_check_order,
    hints=["Two lines happen once before the loop; which of them needs the other's result?",
           "Inside the loop: the data must meet the model on its device before forward; gradients must exist "
           "before step; zeroing must not wipe them in between."],
    mistakes=[
        Mistake("order = \"ABCGDEF\"\n", "before creating the optimizer"),
        Mistake("order = \"BAGDCEF\"\n", "before the forward pass"),
        Mistake("order = \"BACGDFE\"\n", "step after backward"),
        Mistake("order = \"BACDEGF\"\n", "erases the gradients"),
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
                    raise ValueError("no CPU storage found in this checkpoint")
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
    try:
        out = call(load_weights, io.BytesIO(elsewhere), model, name="load_weights", check_mutation=False)
    except Incorrect as exc:
        if "deserialize" in str(exc):
            raise Incorrect("torch.load failed on a checkpoint saved on a GPU this machine does not have: likely "
                            "mistake: no map_location; map the tensors to the model's device while loading") from None
        raise
    if out is not model:
        if isinstance(out, tuple) and hasattr(out, "missing_keys"):
            raise Incorrect("load_weights returned what load_state_dict returns (missing and unexpected keys): "
                            "return the model itself")
        raise Incorrect(f"load_weights should return the model it was given, got {describe(out)}")
    for name, p in model.named_parameters():
        if not torch.equal(p.detach().cpu(), saved.state_dict()[name]):
            raise Incorrect(f"after loading, {name} does not hold the saved values: call model.load_state_dict")
    # A booby-trapped file: unpickling it calls a function. Loading it must fail, not run that function.
    trap = io.BytesIO()
    torch.save({"weight": torch.zeros(2, 3), "bias": _Trap()}, trap)
    _payload_runs.clear()
    try:
        call(load_weights, io.BytesIO(trap.getvalue()), nn.Linear(3, 2), name="load_weights",
             check_mutation=False)
    except Incorrect:
        pass  # refusing the file is the right outcome
    if _payload_runs:
        raise Incorrect("loading a booby-trapped file ran the function hidden in it: likely mistake: "
                        "weights_only=False; unpickling can run any code, so load with weights_only=True "
                        "(the default since torch 2.6) and only tensors and plain containers come back")
    return "weights mapped onto the model's device, and code hidden in a file does not run"


_LOAD_DOC = ("def load_weights(source, model):\n"
             "    \"\"\"Load the state dict saved in source (a path or a file object) into model, wherever model\n"
             "    lives, without running code from the file; return model.\"\"\"\n")

register(Exercise(
    id="03.4", title="A checkpoint from another device", answer="load_weights",
    blank=_LOAD_DOC + "    raise NotImplementedError  # your code here\n",
    solution=_LOAD_DOC + (
        "    device = next(model.parameters()).device\n"
        "    state = torch.load(source, map_location=device, weights_only=True)\n"
        "    model.load_state_dict(state)\n"
        "    return model\n"),
    setup="import torch\n",
    checker=_check_load_weights,
    hints=["torch.load(source, map_location=...) decides where the tensors land, whatever device the file names.",
           "Map them to the device of the model's parameters; weights_only=True refuses anything but tensors "
           "and plain containers.",
           "model.load_state_dict(state) copies the values in; it returns the missing/unexpected keys, not the "
           "model."],
    mistakes=[
        Mistake(_LOAD_DOC + "    model.load_state_dict(torch.load(source, weights_only=True))\n    return model\n",
                "no map_location"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=False)\n    model.load_state_dict(state)\n    return model\n",
                "weights_only=False"),
        Mistake(_LOAD_DOC + "    state = torch.load(source, map_location=next(model.parameters()).device,"
                " weights_only=True)\n    return model.load_state_dict(state)\n",
                "return the model itself"),
    ],
))
