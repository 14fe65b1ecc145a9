"""`evaluate(model, loader, loss_fn)`: mean loss and accuracy over a loader, with one CPU-GPU sync at the end.

    figures = evaluate(model, val_loader, nn.functional.cross_entropy)   # {"loss": 0.31, "accuracy": 0.91}

The model runs in eval mode under `torch.no_grad()` (and is put back in the mode it was in); the sums stay on
the device until the end. `Trainer.evaluate` and its validation after every epoch are this function, with the
trainer's device, precision, `batch_fn` and, in a distributed run, a sum over ranks (each rank evaluates its share:
the same figures on every rank).

Importing this module touches no device.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .i18n import _
from .step import batch_len, forward, pair_on


@torch.no_grad()
def evaluate(model: nn.Module, loader, loss_fn, device=None, *, precision=None, batch_fn=None,
             all_sum=None) -> dict:
    """Mean loss (sample-weighted) and accuracy over `loader`. Accuracy (argmax of the outputs' dim 1 against the
    targets) is there when the model is a classifier: outputs of shape (n, classes) and integer targets of shape
    (n,); for any other model (a regression, outputs that are a tuple) it is None.
    `device`: where batches go (default: the model's); `precision`: its `autocast()` is entered around the forward
    pass; `batch_fn`: a loader batch as (inputs, targets); `all_sum`: sums a tensor over processes."""
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.float64)
    count, classifier = 0, True
    for batch in loader:
        inputs, targets = pair_on(batch, device, batch_fn)
        with precision.autocast() if precision is not None else contextlib.nullcontext():
            outputs = forward(model, inputs)
        n = batch_len(targets)
        if isinstance(outputs, torch.Tensor):
            outputs = outputs.float()  # the loss in float32, as in training (autocast leaves losses in float32)
        total_loss += loss_fn(outputs, targets) * n
        classifier = classifier and _classifies(outputs, targets)
        if classifier:
            correct += (outputs.argmax(1) == targets).sum()
        count += n
    model.train(was_training)
    sums = torch.stack([total_loss, correct, torch.tensor(float(count), dtype=torch.float64, device=device)])
    if all_sum is not None:
        sums = all_sum(sums)
    total_loss, correct, count = sums.tolist()  # CPU-GPU sync point here
    if count == 0:
        raise ValueError(_("the evaluation loader produced no batches"))
    return {"loss": total_loss / count, "accuracy": correct / count if classifier else None}


def _classifies(outputs, targets) -> bool:
    """Class scores (n, classes) and integer class labels (n,): what accuracy is defined for."""
    return (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor) and outputs.dim() == 2
            and targets.dim() == 1 and not targets.is_floating_point() and not targets.is_complex())
