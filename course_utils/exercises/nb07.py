"""Exercises of notebook 07, "Capstone: a Trainer".

07.1 one epoch of training with a single sync, 07.2 a minimal Trainer whose __call__(epochs) returns
the losses, 07.3 saving a checkpoint atomically, 07.4 the closing project: the CIFAR-shaped net to a
target accuracy within a memory budget.
"""
from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from ..i18n import N_, _
from ._sync import HostReads, on_device
from .core import AnswerTimeout, Exercise, Incorrect, Mistake, NotAttempted, as_float, call, describe, register
from .probe import hold, observe

# --- a tiny, fixed training problem the checkers run the learner's code on ---------------------------


def _problem(seed: int = 0, n: int = 48, batch: int = 16):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]
    return model, optimizer, nn.CrossEntropyLoss(), loader


def _reference_epoch(model, optimizer, loss_fn, loader, batch_losses: list | None = None) -> float:
    total, count = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        count += len(y)
        if batch_losses is not None:
            batch_losses.append(loss.item())
    return total / count


_EPOCH_SAMPLES = 40  # 07.1: batches of 16, 16 and 8


def _as_loss(value, label: str) -> float:
    if isinstance(value, torch.Tensor):
        raise Incorrect(_("{label} returned a tensor ({value}); return a Python float: "
                          "call .item() once, at the end of the epoch").format(label=label, value=describe(value)))
    if as_float(value) is None:
        raise Incorrect(_("{label} should return a float (the epoch's mean loss), got {value}").format(
            label=label, value=describe(value)))
    return as_float(value)


# --- 07.1 one epoch, one sync ----------------------------------------------------------------------

def _check_train_one_epoch(train_one_epoch):
    if not observe(lambda: callable(train_one_epoch)):
        raise Incorrect(_("train_one_epoch should be a function, got {value}").format(
            value=observe(lambda: describe(train_one_epoch))))
    model, opt, loss_fn, loader = _problem(n=_EPOCH_SAMPLES)  # batches of 16, 16 and 8: the last is smaller
    ref_model, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    batch_losses = []
    expected = _reference_epoch(ref_model, ref_opt, loss_fn, loader, batch_losses)
    n_samples, sizes = sum(len(y) for _, y in loader), [len(y) for _, y in loader]  # before the answer sees them

    def run():  # the epoch, its optimizer steps and its host reads, where the answer runs
        on_gpu = [(on_device(x), on_device(y)) for x, y in loader]  # batches "on the device": host reads are counted
        steps = []  # at each optimizer.step(), the gradients it was given (read after the epoch: no host read)
        step_hook = opt.register_step_pre_hook(lambda o, args, kwargs: steps.append(
            [p.grad.detach().clone() for group in o.param_groups for p in group["params"] if p.grad is not None]))
        try:
            with HostReads() as reads:
                out = call(train_one_epoch, model, opt, loss_fn, on_gpu, name="train_one_epoch",
                           check_mutation=False)
        finally:
            step_hook.remove()
        return out, [p.detach().clone() for p in model.parameters()], steps, dict(reads.counts)

    out, weights, steps, counts = observe(run)
    reads = HostReads()  # the counts as read where the answer ran, for their total and their description
    reads.counts.update(counts)
    got = _as_loss(out, "train_one_epoch")
    weights_equal = all(torch.allclose(p, q, atol=1e-6) for p, q in zip(weights, ref_model.parameters()))
    if all(torch.equal(p, q) for p, q in zip(weights, _problem(n=_EPOCH_SAMPLES)[0].parameters())):
        if steps and not any(bool(g.any()) for grads in steps for g in grads):
            raise Incorrect(_("the model's weights did not change: optimizer.step() ran {count} times, but every "
                              "time without gradients: likely mistake: zero_grad() between backward() and step() "
                              "wipes them; the order is zero_grad, forward and loss, backward, step").format(
                count=len(steps)))
        raise Incorrect(_("the model's weights did not change: likely mistake: optimizer.step() is never called"))
    if not weights_equal:
        raise Incorrect(_("the weights after your epoch differ from a correct loop's: likely mistake: "
                          "optimizer.zero_grad() is missing, so gradients pile up across steps"))
    if any(math.isclose(got, expected * k, rel_tol=1e-4) for k in (len(loader), n_samples)):
        raise Incorrect(_("returned {got:.4f}, a multiple of the mean loss {expected:.4f}: likely mistake: "
                          "the sum of the batch losses is returned instead of the mean over samples").format(
                              got=got, expected=expected))
    if math.isclose(got, sum(batch_losses) / len(batch_losses), rel_tol=1e-4):
        raise Incorrect(_("returned {got:.4f}, the mean of the batch losses; the mean over samples is "
                          "{expected:.4f}: likely mistake: a mean of means, dividing by the number of batches; with "
                          "batches of {sizes} samples the last one counts less: weight each batch loss by len(y) "
                          "and divide by the number of samples").format(got=got, expected=expected, sizes=sizes))
    for size in sorted(set(sizes)):
        if math.isclose(got, expected * n_samples / (size * len(loader)), rel_tol=1e-4):
            raise Incorrect(_("returned {got:.4f}, expected {expected:.4f}: likely mistake: every batch was counted "
                              "as {size} samples ({steps} x {size} = {counted}), but the batches hold {sizes}: "
                              "{samples} samples; count len(y) of each batch").format(
                got=got, expected=expected, size=size, steps=len(loader), counted=size * len(loader), sizes=sizes,
                samples=n_samples))
    if not math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-6):
        raise Incorrect(_("the weights are right but the returned loss is {got:.6f}, expected the epoch's mean "
                          "loss {expected:.6f} (batch losses weighted by batch size)").format(got=got, expected=expected))
    if reads.total >= len(loader):
        raise Incorrect(_("correct numbers, but {reads} host reads in one epoch of {steps} steps "
                          "({details}): likely mistake: the loss is brought to the host every step, which "
                          "on a GPU makes the CPU wait for every step. Sum the losses as tensors and call .item() "
                          "once at the end").format(reads=reads.total, steps=len(loader), details=reads.describe()))
    if reads.total > 1:
        raise Incorrect(_("correct numbers, but {reads} host reads in one epoch ({details}): one "
                          "is enough, the .item() of the mean at the end").format(reads=reads.total,
                                                                                 details=reads.describe()))
    return _("same weights and mean loss as a correct loop, with a single sync per epoch")


_EPOCH_HEAD = "def train_one_epoch(model, optimizer, loss_fn, loader):\n"
_EPOCH_SOLUTION = _EPOCH_HEAD + (
    "    total, count = torch.zeros(()), 0\n"
    "    for x, y in loader:\n"
    "        optimizer.zero_grad()\n"
    "        loss = loss_fn(model(x), y)\n"
    "        loss.backward()\n"
    "        optimizer.step()\n"
    "        total += loss.detach() * len(y)  # stays a tensor: no sync\n"
    "        count += len(y)\n"
    "    return (total / count).item()  # one sync per epoch\n")

register(Exercise(
    id="07.1", title=N_("One epoch, one sync"), answer="train_one_epoch",
    blank=_EPOCH_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_EPOCH_SOLUTION,
    setup="import torch\n",
    checker=_check_train_one_epoch,
    inside=N_("host reads, counted while the answer ran"),
    hints=[N_("The four lines of a step: zero_grad, forward + loss, backward, step."),
           N_("Keep a running total as a tensor: `total += loss.detach() * len(y)`; call `.item()` once at the end."),
           N_("The mean over samples is total / number of samples, not total / number of batches (the last batch "
              "may be smaller).")],
    mistakes=[
        Mistake(_EPOCH_SOLUTION.replace("        optimizer.zero_grad()\n", ""), "zero_grad() is missing"),
        Mistake(_EPOCH_SOLUTION.replace("    return (total / count).item()", "    return total.item()"),
                "the sum of the batch losses"),
        Mistake(_EPOCH_HEAD + "    total, count = 0.0, 0\n    for x, y in loader:\n        optimizer.zero_grad()\n"
                "        loss = loss_fn(model(x), y)\n        loss.backward()\n        optimizer.step()\n"
                "        total += loss.item() * len(y)\n        count += len(y)\n    return total / count\n",
                ".item() x3"),
        Mistake(_EPOCH_SOLUTION.replace("        optimizer.step()\n", ""), "optimizer.step() is never called"),
        Mistake(_EPOCH_SOLUTION.replace("        total += loss.detach() * len(y)  # stays a tensor: no sync\n",
                                        "        total += float(loss) * len(y)\n"), "float() x3"),
        Mistake(_EPOCH_SOLUTION.replace("        count += len(y)\n",
                                        "        count += len(y)\n        print(f\"batch loss {loss:.4f}\")\n"),
                "formatting (an f-string) x3"),
        Mistake(_EPOCH_SOLUTION.replace("        total += loss.detach() * len(y)  # stays a tensor: no sync\n",
                                        "        total += loss.detach().cpu() * len(y)\n"), ".cpu() x3"),
        Mistake(_EPOCH_SOLUTION.replace("        total += loss.detach() * len(y)  # stays a tensor: no sync\n",
                                        "        if not torch.isfinite(loss):\n"
                                        "            raise FloatingPointError(\"the loss is not finite\")\n"
                                        "        total += loss.detach() * len(y)\n"), "bool() (an if) x3"),
        Mistake(_EPOCH_SOLUTION.replace("    return (total / count).item()  # one sync per epoch\n",
                                        "    print(\"epoch loss\", total / count)\n    return (total / count).item()\n"),
                "one is enough"),
        Mistake(_EPOCH_SOLUTION.replace("        total += loss.detach() * len(y)  # stays a tensor: no sync\n",
                                        "        total += loss.detach()\n").replace(
            "        count += len(y)\n", "        count += 1\n"), "a mean of means"),
        Mistake(_EPOCH_SOLUTION.replace("        count += len(y)\n", "").replace(
            "    return (total / count).item()  # one sync per epoch\n",
            "    return (total / (len(loader) * len(y))).item()\n"), "every batch was counted as 8 samples"),
        Mistake(_EPOCH_SOLUTION.replace("        optimizer.zero_grad()\n", "").replace(
            "        loss.backward()\n", "        loss.backward()\n        optimizer.zero_grad()\n"),
                "every time without gradients"),
    ],
))


# --- 07.2 a minimal Trainer -----------------------------------------------------------------------

def _check_mini_trainer(MiniTrainer):
    if not observe(lambda: isinstance(MiniTrainer, type)):
        raise Incorrect(_("MiniTrainer should be a class, got {value}").format(
            value=observe(lambda: describe(MiniTrainer))))
    model, opt, loss_fn, loader = _problem(seed=1)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    expected = [_reference_epoch(ref_model, ref_opt, loss_fn, loader) for _ in range(3)]
    # model, opt and loader are handed to the answer: only the trainer's results are read, through observe()
    trainer = hold(lambda: call(MiniTrainer, model, opt, loss_fn, loader, name="MiniTrainer", check_mutation=False))
    if not observe(lambda: callable(trainer)):
        raise Incorrect(_("a MiniTrainer instance is not callable: likely mistake: the training loop is in a method "
                          "with another name; define `__call__(self, epochs)`"))
    first = observe(lambda: call(trainer, 2, name="trainer"))
    if not isinstance(first, list):
        raise Incorrect(_("trainer(2) should return a list of 2 losses, got {value}: likely mistake: "
                          "returning only the last epoch's loss").format(value=describe(first)))
    if len(first) != 2:
        raise Incorrect(_("trainer(2) returned {count} losses, expected one per epoch (2)").format(count=len(first)))
    losses = [_as_loss(v, _("each epoch")) for v in first]
    if not all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(losses, expected[:2])):
        raise Incorrect(_("trainer(2) returned {got}, expected {expected} (the mean loss of each epoch)").format(
            got=[round(v, 5) for v in losses], expected=[round(v, 5) for v in expected[:2]]))
    second = observe(lambda: call(trainer, 1, name="trainer"))
    if isinstance(second, list) and len(second) == 3 and second[:2] == losses:
        raise Incorrect(_("trainer(1) after trainer(2) returned 3 losses, the whole history: likely mistake: "
                          "__call__ returns self.history; return only this call's losses (and add them to "
                          "self.history)"))
    if not isinstance(second, list) or len(second) != 1:
        raise Incorrect(_("trainer(1) should return a list with one loss, got {value}").format(value=describe(second)))
    if not math.isclose(_as_loss(second[0], "trainer(1)"), expected[2], rel_tol=1e-4, abs_tol=1e-6):
        raise Incorrect(_("the third epoch's loss is wrong: does a second call continue training the same model?"))
    history = observe(lambda: getattr(trainer, "history", None))
    if isinstance(history, list) and history and all(isinstance(h, list) for h in history):
        raise Incorrect(_("after trainer(2) and trainer(1), trainer.history is {value}, a list of lists: likely "
                          "mistake: self.history.append(losses) adds the whole list as one item; extend it "
                          "(self.history += losses) so that it holds one loss per epoch").format(
            value=describe(history)))
    if not isinstance(history, list) or len(history) != 3:
        raise Incorrect(_("after trainer(2) and trainer(1), trainer.history should hold all 3 losses, got "
                          "{value}: likely mistake: history is reset inside __call__").format(value=describe(history)))
    return _("history = trainer(epochs): a training run as a callable object")


_MINI_HEAD = ("class MiniTrainer:\n"
              "    def __init__(self, model, optimizer, loss_fn, loader):\n"
              "        self.model, self.optimizer, self.loss_fn, self.loader = model, optimizer, loss_fn, loader\n"
              "        self.history = []\n\n")
_MINI_SOLUTION = _MINI_HEAD + (
    "    def __call__(self, epochs):\n"
    "        losses = [train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader)\n"
    "                  for _ in range(epochs)]\n"
    "        self.history += losses\n"
    "        return losses\n")

register(Exercise(
    id="07.2", title=N_("A Trainer you call"), answer="MiniTrainer",
    blank=_MINI_HEAD + "    def __call__(self, epochs):\n        raise NotImplementedError  # your code here\n",
    solution=_MINI_SOLUTION,
    setup="import torch\n" + _EPOCH_SOLUTION,
    checker=_check_mini_trainer,
    hints=[N_("Reuse your train_one_epoch from exercise 07.1, once per epoch."),
           N_("Return the list of this call's losses, and also append them to self.history.")],
    mistakes=[
        Mistake(_MINI_HEAD.replace("        self.history = []\n", "") + (
            "    def __call__(self, epochs):\n        self.history = []\n        for _ in range(epochs):\n"
            "            self.history.append(train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader))\n"
            "        return self.history\n"), "history is reset inside __call__"),
        Mistake(_MINI_HEAD + "    def __call__(self, epochs):\n        for _ in range(epochs):\n"
                "            loss = train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader)\n"
                "        return loss\n", "returning only the last epoch's loss"),
        Mistake(_MINI_HEAD + "    def fit(self, epochs):\n"
                "        return [train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader)\n"
                "                for _ in range(epochs)]\n", "with another name"),
        Mistake(_MINI_HEAD + "    def __call__(self, epochs):\n        for _ in range(epochs):\n"
                "            loss = train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader)\n"
                "            self.history.append(loss)\n"
                "        return self.history\n", "__call__ returns self.history"),
        Mistake(_MINI_HEAD + "    def __call__(self, epochs):\n"
                "        losses = [train_one_epoch(self.model, self.optimizer, self.loss_fn, self.loader)\n"
                "                  for _ in range(epochs)]\n"
                "        self.history.append(losses)\n        return losses\n", "a list of lists"),
    ],
))


# --- 07.3 atomic checkpoint -----------------------------------------------------------------------

class _Crash(Exception):
    pass


def _target(f):
    """The file torch.save is writing: a path as given, or the name of an open file (None if it has none)."""
    if isinstance(f, (str, os.PathLike)):
        return f
    name = getattr(f, "name", None)
    return name if isinstance(name, (str, os.PathLike)) else None


def _where(targets: list) -> list:
    """In the learner's process, where the files are: for each place torch.save wrote, None (an open file without a
    name) or (its folder as given, its full path with links resolved), as strings."""
    return [None if t is None else (str(Path(t).parent), str(Path(t).resolve())) for t in targets]


def _load(path: Path) -> tuple[bool, Any]:
    """In the learner's process: (True, torch.load(path, weights_only=True)) or (False, the error's name)."""
    try:
        return True, torch.load(path, weights_only=True)
    except Exception as exc:
        return False, type(exc).__name__


def _scratch_folder() -> str:
    """A new private folder for the check's files, made where the answer runs. Its name is the same from one check
    to the next in a process (so is the feedback that names it); a random one where that name is taken."""
    folder = os.path.join(tempfile.gettempdir(), f"course-check-{os.getpid()}")
    try:
        os.mkdir(folder, 0o700)  # as tempfile.mkdtemp makes its folders: only a new one will do
    except FileExistsError:
        return tempfile.mkdtemp()
    return folder


def _check_save_atomically(save_atomically):
    if not observe(lambda: callable(save_atomically)):
        raise Incorrect(_("save_atomically should be a function, got {value}").format(
            value=observe(lambda: describe(save_atomically))))
    real_save = torch.save  # used only where the answer runs (inside observe)
    # the files live where the answer runs: every look at them is an observation, and so is the clean-up
    folder = observe(_scratch_folder)
    try:
        path = Path(folder) / "ckpt.pt"

        def save():
            targets = []  # where torch.save wrote

            def recording_save(obj, f, *args, **kwargs):
                targets.append(_target(f))
                return real_save(obj, f, *args, **kwargs)

            with mock.patch.object(torch, "save", recording_save):
                call(save_atomically, {"w": torch.arange(3.0)}, path, name="save_atomically", check_mutation=False)
            return path.exists(), _where(targets), str(path.resolve())

        exists, written, resolved = observe(save)
        if not exists:
            raise Incorrect(_("nothing was written at `path`"))
        outside = [given for given, full in filter(None, written) if Path(full).parent != Path(resolved).parent]
        if outside:
            raise Incorrect(_("the temporary file was written to {where}, outside the folder of `path` ({folder}): "
                              "likely mistake: a temporary file in the system's temporary folder; os.replace is "
                              "atomic only within one file system, and across two it fails (or a move falls back to "
                              "a copy, which is not atomic): write the temporary file next to `path`").format(
                where=outside[0], folder=path.parent))
        loaded_ok, loaded = observe(lambda: _load(path))
        if not loaded_ok:
            raise Incorrect(_("the file at `path` cannot be loaded with torch.load: {error}").format(error=loaded))
        if not (isinstance(loaded, dict) and torch.equal(loaded.get("w", torch.zeros(0)), torch.arange(3.0))):
            raise Incorrect(_("torch.load(path) gave {value}, not the object that was saved").format(
                value=describe(loaded)))
        files = observe(lambda: sorted(os.listdir(folder)))
        if files != ["ckpt.pt"]:
            raise Incorrect(_("the folder holds {files} after a successful save: likely "
                              "mistake: the temporary file is copied instead of renamed (os.replace)").format(
                                  files=files))

        def crash():
            crashed_into = []

            def crashing_save(obj, f, *args, **kwargs):  # the disk fills up half-way through the write
                crashed_into.append(_target(f))
                if hasattr(f, "write"):
                    f.write(b"PK\x03\x04 half a checkpoint")
                else:
                    Path(f).write_bytes(b"PK\x03\x04 half a checkpoint")
                raise _Crash(_("disk full"))

            raised = False
            with mock.patch.object(torch, "save", crashing_save):
                try:
                    save_atomically({"w": torch.ones(3)}, path)
                except _Crash:
                    raised = True
                except (AnswerTimeout, KeyboardInterrupt):
                    raise
                except NotImplementedError:
                    raise NotAttempted() from None
                except Exception as exc:
                    raise Incorrect(_("when the write fails, save_atomically raised {error}: {message}; let "
                                      "the original error through").format(error=type(exc).__name__,
                                                                           message=exc)) from None
            return raised, _where(crashed_into), str(path.resolve())

        raised, crashed_into, resolved = observe(crash)
        after_ok, after = observe(lambda: _load(path))
        if not after_ok:
            wrote_path = any(t is not None and t[1] == resolved for t in crashed_into)
            if crashed_into and all(t is not None for t in crashed_into) and not wrote_path:
                raise Incorrect(_("a write that failed half-way destroyed the previous checkpoint: torch.save wrote "
                                  "to a temporary file, but that half-written file was then moved onto `path`: "
                                  "likely mistake: os.replace runs even when torch.save failed (in a finally); "
                                  "replace only after torch.save has returned"))
            raise Incorrect(_("a write that failed half-way destroyed the previous checkpoint: likely mistake: "
                              "writing straight to `path`; write a temporary file in the same folder, then "
                              "os.replace it onto `path`"))
        if not torch.equal(after["w"], torch.arange(3.0)):
            raise Incorrect(_("after a failed write the checkpoint holds something else than the previous save"))
        left = sorted(set(observe(lambda: os.listdir(folder))) - {"ckpt.pt"})
        if left:
            raise Incorrect(_("a failed write left {files} behind: likely mistake: the temporary file is not "
                              "removed when saving fails (try/except, then os.remove)").format(files=left))
        if not raised:
            raise Incorrect(_("when torch.save failed (a full disk), save_atomically returned as if the checkpoint "
                              "had been saved: likely mistake: the error was caught and not raised again, so the "
                              "caller goes on without a checkpoint; clean up, then `raise`"))
    finally:
        observe(lambda: shutil.rmtree(folder, ignore_errors=True))
    assert observe(lambda: torch.save is real_save)
    return _("a crash mid-write leaves the previous checkpoint intact and no litter behind")


_SAVE_HEAD = "def save_atomically(obj, path):\n"
_SAVE_SOLUTION = _SAVE_HEAD + (
    "    path = Path(path)\n"
    "    tmp = path.with_name(path.name + \".tmp\")\n"
    "    try:\n"
    "        torch.save(obj, tmp)\n"
    "        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never half of one\n"
    "    except BaseException:\n"
    "        if tmp.exists():\n"
    "            tmp.unlink()\n"
    "        raise\n")

register(Exercise(
    id="07.3", title=N_("A checkpoint that is never half-written"), answer="save_atomically",
    blank=_SAVE_HEAD + "    raise NotImplementedError  # your code here\n",
    solution=_SAVE_SOLUTION,
    setup="import os\nimport shutil\nfrom pathlib import Path\n\nimport torch\n",
    checker=_check_save_atomically,
    inside=N_("the files in the checkpoint's folder, and where torch.save wrote, seen while the answer ran"),
    hints=[N_("Write to a temporary file next to `path` (same folder, so the rename stays on one disk)."),
           N_("`os.replace(tmp, path)` swaps the new file in atomically; if saving fails, delete the temporary file "
              "and re-raise.")],
    mistakes=[
        Mistake(_SAVE_HEAD + "    torch.save(obj, path)\n", "writing straight to `path`"),
        Mistake(_SAVE_HEAD + "    tmp = Path(str(path) + '.tmp')\n    torch.save(obj, tmp)\n    os.replace(tmp, path)\n",
                "not removed when saving fails"),
        Mistake(_SAVE_HEAD + "    tmp = Path(str(path) + '.tmp')\n    torch.save(obj, tmp)\n"
                "    shutil.copy(tmp, path)\n", "copied instead of renamed"),
        Mistake(_SAVE_HEAD + "    path = Path(path)\n    tmp = path.with_name(path.name + \".tmp\")\n    try:\n"
                "        torch.save(obj, tmp)\n        os.replace(tmp, path)\n    except Exception:\n"
                "        if tmp.exists():\n            tmp.unlink()\n"
                "        return False  # not saved this time: training goes on\n", "not raised again"),
        Mistake(_SAVE_HEAD + "    import tempfile\n    fd, tmp = tempfile.mkstemp(suffix=\".pt\")  # a fresh name\n"
                "    os.close(fd)\n    try:\n        torch.save(obj, tmp)\n        os.replace(tmp, path)\n"
                "    except BaseException:\n        os.remove(tmp)\n        raise\n", "outside the folder of `path`"),
        Mistake(_SAVE_HEAD + "    path = Path(path)\n    tmp = path.with_name(path.name + \".tmp\")\n    try:\n"
                "        torch.save(obj, tmp)\n    finally:\n"
                "        os.replace(tmp, path)  # never leave the tmp behind\n",
                "os.replace runs even when torch.save failed"),
    ],
))


# --- 07.4 the closing project ---------------------------------------------------------------------

PROJECT_BUDGET = 24 * 2**20   # the simulated GPU memory the project must fit in
PROJECT_ACCURACY = 0.60       # on held-out synthetic CIFAR-shaped images


def _steady_state_peak(model: nn.Module, optimizer: torch.optim.Optimizer, batch_size: int) -> tuple[int, int]:
    """(peak of a first step with a fresh optimizer, peak of a step with the optimizer's state in place), in bytes,
    measured on a SimulatedGPU for float32 steps of copies of `model` at `batch_size` (cross-entropy loss)."""
    from ..data import synthetic_cifar
    from ..memory import SimulatedGPU

    device = next(model.parameters()).device
    batch = synthetic_cifar(batch_size, seed=7)
    peaks = []
    for fresh in (True, False):
        copied, opt = copy.deepcopy((model, optimizer))  # together: the copied optimizer holds the copied parameters
        if fresh:
            opt = type(optimizer)(copied.parameters(), **optimizer.defaults)
        with torch.random.fork_rng(devices=[]), SimulatedGPU("1TiB", model=copied, optimizer=opt) as gpu:
            for step in range(1 if fresh else 2):
                gpu.reset_peak_memory_stats()
                x, y = batch.images.to(device), batch.labels.to(device)
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(copied(x), y).backward()
                opt.step()
            peaks.append(gpu.max_memory_allocated())
    return peaks[0], peaks[1]


def _check_project(answer):
    from ..data import synthetic_cifar
    from ..memory import SimulatedGPU, format_bytes

    size = observe(lambda: len(answer) if isinstance(answer, tuple) else None)
    if size == 2:
        raise Incorrect(_("expected (model, optimizer, batch_size, gpu), got a pair: the checker needs your optimizer "
                          "and batch size too, to measure a step with the optimizer's state in place itself"))
    if size != 4:
        raise Incorrect(_("expected the tuple (model, optimizer, batch_size, gpu), got {value}").format(
            value=observe(lambda: describe(answer))))
    model, optimizer, gpu = hold(lambda: answer[0]), hold(lambda: answer[1]), hold(lambda: answer[3])
    if not observe(lambda: isinstance(model, nn.Module)):
        raise Incorrect(_("the first item should be your trained nn.Module, got {value}").format(
            value=observe(lambda: describe(model))))
    if not observe(lambda: isinstance(optimizer, torch.optim.Optimizer)):
        raise Incorrect(_("the second item should be the optimizer that trained the model, got {value}").format(
            value=observe(lambda: describe(optimizer))))
    batch_size = observe(lambda: answer[2])  # plain data: an int stays an int
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise Incorrect(_("the third item should be the batch size you trained with (an int), got {value}").format(
            value=describe(batch_size)))
    if not observe(lambda: isinstance(gpu, SimulatedGPU)):
        raise Incorrect(_("the fourth item should be the SimulatedGPU you measured the training steps in, got "
                          "{value}").format(value=observe(lambda: describe(gpu))))

    def holds_model_params():
        model_params = {id(p) for p in model.parameters()}
        opt_params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return bool(model_params) and opt_params <= model_params

    if not observe(holds_model_params):
        raise Incorrect(_("the optimizer does not hold this model's parameters: likely mistake: it was built for "
                          "another instance (a second CifarCNN()); build the optimizer from model.parameters()"))
    budget = observe(lambda: gpu.budget)
    if budget > PROJECT_BUDGET:
        raise Incorrect(_("your SimulatedGPU has a budget of {budget}; the project allows "
                          "{allowed}: likely mistake: a bigger budget than allowed").format(
                              budget=format_bytes(budget), allowed=format_bytes(PROJECT_BUDGET)))
    peak = observe(lambda: gpu.max_memory_allocated())
    if peak == 0:
        raise Incorrect(_("the SimulatedGPU recorded no memory use: run your training steps inside `with gpu:`"))
    # the answer's model lives where the answer ran: its steps are measured there
    first, steady = observe(lambda: _steady_state_peak(model, optimizer, batch_size))
    if first > PROJECT_BUDGET:  # not a matter of which step was measured: no step fits at this batch size
        raise Incorrect(_("at batch {batch_size}, even the first step needs {first}, more than the {budget} budget "
                          "(a step with the optimizer's state in place needs {steady}): likely mistake: the batch "
                          "size you return is not the one your SimulatedGPU measured. Return the batch size you "
                          "trained and measured with, and make it small enough").format(
                              batch_size=batch_size, first=format_bytes(first), budget=format_bytes(PROJECT_BUDGET),
                              steady=format_bytes(steady)))
    if steady > PROJECT_BUDGET:
        raise Incorrect(_("at batch {batch_size}, a step with the optimizer's state in place needs "
                          "{steady}, more than the {budget} budget (the first "
                          "step needs {first}): likely mistake: only the first step was measured, before "
                          "the optimizer's state existed; with Adam the second step is the larger. Use a smaller "
                          "batch").format(batch_size=batch_size, steady=format_bytes(steady),
                                          budget=format_bytes(PROJECT_BUDGET), first=format_bytes(first)))
    if peak < 0.97 * steady:
        raise Incorrect(_("your SimulatedGPU recorded a peak of {peak}, but a step at batch {batch_size} "
                          "with the optimizer's state in place needs {steady}: likely mistake: only the "
                          "first step was measured, before the optimizer's state existed (or a smaller batch than the "
                          "one you trained with). Measure at least two steps inside the SimulatedGPU").format(
                              peak=format_bytes(peak), batch_size=batch_size, steady=format_bytes(steady)))
    test = synthetic_cifar(2000, seed=123)

    def predict():  # the learner's model, on held-out images, where it lives
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        with torch.no_grad():
            try:
                logits = model(test.images.to(device))
            except Exception as exc:
                raise Incorrect(_("running your model on 3x32x32 images raised {error}: {message}").format(
                    error=type(exc).__name__, message=exc)) from None
        model.train(was_training)
        return logits

    logits = observe(predict)
    if not isinstance(logits, torch.Tensor) or logits.shape != (2000, 10):
        raise Incorrect(_("the model should output 10 logits per image, got {value}").format(value=describe(logits)))
    accuracy = (logits.argmax(1).cpu() == test.labels).float().mean().item()
    if accuracy < PROJECT_ACCURACY:
        raise Incorrect(_("held-out accuracy {accuracy:.1%} is below the target {target:.0%}: likely "
                          "mistake: too few epochs or samples, or a learning rate far off (Adam at 1e-3 is a good "
                          "start)").format(accuracy=accuracy, target=PROJECT_ACCURACY))
    return _("held-out accuracy {accuracy:.1%}; a steady-state step at batch {batch_size} needs "
             "{steady} (the first {first}) of the {budget} budget").format(
                 accuracy=accuracy, batch_size=batch_size, steady=format_bytes(steady), first=format_bytes(first),
                 budget=format_bytes(budget))


_PROJECT_SETUP = ("import torch\nfrom torch import nn\n\nfrom course_utils import Trainer\n"
                  "from course_utils.data import TensorLoader, synthetic_cifar\n"
                  "from course_utils.memory import SimulatedGPU\nfrom course_utils.models import CifarCNN\n")
_PROJECT_HEAD = ("torch.manual_seed(0)\n"
                 "model = CifarCNN()\n"
                 "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n")


def _measured(batch_size: int, steps: int, budget: str = "24MiB") -> str:
    """Learner code: `steps` training steps at `batch_size` inside a SimulatedGPU (the training run itself left
    out: every one of these answers is rejected before the accuracy is checked)."""
    return (f"batch_size = {batch_size}\n"
            "loader = TensorLoader.from_dataset(synthetic_cifar(256, seed=0), batch_size=batch_size)\n"
            f"with SimulatedGPU(\"{budget}\", model=model, optimizer=optimizer) as gpu:\n"
            f"    for step, (inputs, targets) in zip(range({steps}), loader):\n"
            "        optimizer.zero_grad(set_to_none=True)\n"
            "        nn.functional.cross_entropy(model(inputs), targets).backward()\n"
            "        optimizer.step()\n")


register(Exercise(
    id="07.4", title=N_("Project: accuracy within a memory budget"), answer="project",
    blank="project = ...",
    solution=(
        _PROJECT_HEAD
        + "batch_size = 32\n"
        "loader = TensorLoader.from_dataset(synthetic_cifar(4000, seed=0), batch_size=batch_size)\n"
        "# The first step creates Adam's state (two tensors per parameter), so the second step is the larger:\n"
        "# measure two, and every later step needs what the second needed.\n"
        "with SimulatedGPU(\"24MiB\", model=model, optimizer=optimizer) as gpu:\n"
        "    for step, (inputs, targets) in zip(range(2), loader):\n"
        "        optimizer.zero_grad(set_to_none=True)\n"
        "        nn.functional.cross_entropy(model(inputs), targets).backward()\n"
        "        optimizer.step()\n"
        "trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), loader, device=\"cpu\")\n"
        "trainer(2)\n"
        "project = (model, optimizer, batch_size, gpu)"),
    setup=_PROJECT_SETUP,
    checker=_check_project,
    inside=N_("the memory simulated GPUs counted in the answer's training and in steps of its model"),
    timeout=60,
    hints=[N_("Train `CifarCNN` with Adam, and run two training steps inside `with SimulatedGPU(\"24MiB\", "
              "model=model, optimizer=optimizer) as gpu:`. The first step creates Adam's state, so the second is the "
              "larger, and every later step needs the same as the second: if two steps fit, the run fits."),
           N_("4000 synthetic images, batches of 32 and 2 epochs of Adam at lr 1e-3 usually reach the target; "
              "if not, train another epoch (call the trainer again). If the second step does not fit the budget, use "
              "a smaller batch.")],
    mistakes=[
        Mistake(_PROJECT_HEAD + _measured(40, 1) + "project = (model, optimizer, batch_size, gpu)\n",
                "with Adam the second step is the larger"),
        Mistake(_PROJECT_HEAD + _measured(32, 1) + "project = (model, optimizer, batch_size, gpu)\n",
                "only the first step was measured"),
        Mistake(_PROJECT_HEAD + _measured(32, 2) + "batch_size = 256  # trained with a bigger batch than measured\n"
                "project = (model, optimizer, batch_size, gpu)\n", "even the first step needs"),
        Mistake(_PROJECT_HEAD + _measured(32, 2) + "project = (model, gpu)\n", "got a pair"),
        Mistake(_PROJECT_HEAD + _measured(32, 2, budget="1GiB") + "project = (model, optimizer, batch_size, gpu)\n",
                "a bigger budget than allowed"),
        Mistake(_PROJECT_HEAD + _measured(32, 2) + "project = (model, optimizer, batch_size, SimulatedGPU('24MiB'))\n",
                "recorded no memory use"),
        Mistake(_PROJECT_HEAD + _measured(32, 2) + "project = (model, optimizer, batch_size, gpu)\n",
                "below the target"),
        Mistake(_PROJECT_HEAD + "optimizer = torch.optim.Adam(CifarCNN().parameters(), lr=1e-3)\n" + _measured(32, 2)
                + "project = (model, optimizer, batch_size, gpu)\n", "another instance"),
    ],
))
