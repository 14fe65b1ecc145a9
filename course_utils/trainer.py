"""`Trainer`: a training run as a callable object.

    trainer = Trainer(model, optimizer, loss_fn, train_loader)
    history = trainer(3)          # train 3 epochs, get the 3 mean losses back as floats

Design: `__call__` owns the epoch loop; `train_step` owns one optimisation step; everything else
(progress bars, live plots, checkpoints, early stopping) hangs off `Callback` hooks, so extending the
trainer means adding a callback, not editing the loop.
"""
from __future__ import annotations

import torch
from torch import nn

from .device import get_device


class Callback:
    """Override the hooks you need. `loss` in on_step_end is a detached 0-d tensor on the device:
    keep a reference if you like, but calling `.item()` on it every step would force a CPU-GPU sync."""

    def on_train_start(self, trainer: "Trainer") -> None: ...
    def on_epoch_start(self, trainer: "Trainer", epoch: int) -> None: ...
    def on_step_end(self, trainer: "Trainer", step: int, loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: dict) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...


def move_batch(batch, device: torch.device, non_blocking: bool = True):
    """Move a batch (tensor, or tuple/list/dict of them) to `device`. Tensors already there are not copied."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: move_batch(v, device, non_blocking) for k, v in batch.items()}
    return batch


class Trainer:
    """Train `model` with `optimizer` on `train_loader` batches of (inputs, targets).

    `history = trainer(epochs)` runs `epochs` more epochs and returns their mean losses (floats).
    `trainer.history` keeps every epoch's mean loss across calls; `trainer.epoch` counts epochs done.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, train_loader,
                 device=None, callbacks=()):
        self.device = get_device(device) if not isinstance(device, torch.device) else device
        self.model = model.to(self.device)  # modules move in place; parameters keep their identity
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.train_loader = train_loader
        self.callbacks = list(callbacks)
        self.history: list[float] = []
        self.epoch = 0
        self.global_step = 0

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimisation step; returns the batch's mean loss, detached, still on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def train_epoch(self) -> float:
        self.model.train()
        total = torch.zeros((), device=self.device)  # running sum stays on the device: no per-step sync
        count = 0
        for inputs, targets in self.train_loader:
            inputs, targets = move_batch((inputs, targets), self.device)
            loss = self.train_step(inputs, targets)
            total += loss * len(targets)
            count += len(targets)
            self.global_step += 1
            self._emit("on_step_end", self.global_step, loss)
        if count == 0:
            raise ValueError("train_loader produced no batches")
        return (total / count).item()  # the one CPU-GPU sync point of the epoch

    def __call__(self, epochs: int = 1) -> list[float]:
        if not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be a non-negative int, got {epochs!r}")
        losses = []
        self._emit("on_train_start")
        for _ in range(epochs):
            self._emit("on_epoch_start", self.epoch)
            mean_loss = self.train_epoch()
            self.history.append(mean_loss)
            losses.append(mean_loss)
            self._emit("on_epoch_end", self.epoch, {"loss": mean_loss})
            self.epoch += 1
        self._emit("on_train_end")
        return losses

    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        """Mean loss and accuracy over `loader`, in eval mode; one sync at the end."""
        was_training = self.model.training
        self.model.eval()
        total_loss = torch.zeros((), device=self.device)
        correct = torch.zeros((), device=self.device, dtype=torch.long)
        count = 0
        for inputs, targets in loader:
            inputs, targets = move_batch((inputs, targets), self.device)
            logits = self.model(inputs)
            total_loss += self.loss_fn(logits, targets) * len(targets)
            correct += (logits.argmax(1) == targets).sum()
            count += len(targets)
        self.model.train(was_training)
        if count == 0:
            raise ValueError("the evaluation loader produced no batches")
        return {"loss": (total_loss / count).item(), "accuracy": correct.item() / count}
