"""Loaders, models and stop callbacks shared by the stop-point tests (tests/test_trainer_edges.py) and their
fresh-process worker (tests/resume_worker.py): every loader kind the Trainer accepts, built the same way each time.

An epoch is 5 batches (72 samples in batches of 16: the last one has 8), so with accumulate=2 the groups are
2, 2 and 1: a stop can land on the first, a middle or the last batch of an epoch, inside or at the end of a group.
"""
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from course_utils.callbacks import Callback, LRScheduler, StopTraining  # noqa: F401
from course_utils.data import TensorLoader
from course_utils.trainer import Trainer

SAMPLES, BATCH = 72, 16
BATCHES = 5                      # per epoch
EPOCHS = 2
STOP_POINTS = range(1, BATCHES + 2)  # after batch 1..5 of epoch 1, and after the first batch of epoch 2
KINDS = ["tensor", "dataloader", "dataloader_generator", "dataloader_workers", "dataloader_persistent", "sampler",
         "numpy_augment", "stateful", "stateful_workers", "stateful_sampler", "list"]


class NumpyNoisy(Dataset):
    """A random augmentation drawn from numpy's global generator, as many augmentation libraries do."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        import numpy as np
        return self.x[i] + float(np.random.normal(0, 0.1)), self.y[i]


class Noisy(Dataset):
    """A random augmentation in __getitem__: drawn from the global generator (or the workers' own)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn_like(self.x[i]), self.y[i]


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, 1, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def loader(kind):
    x, y = data()
    gen = torch.Generator().manual_seed(5)
    if kind == "tensor":
        return TensorLoader(x, y, batch_size=BATCH, seed=3)
    if kind == "dataloader":  # the global generator decides the order and the noise
        return DataLoader(Noisy(x, y), batch_size=BATCH, shuffle=True)
    if kind == "dataloader_generator":
        return DataLoader(Noisy(x, y), batch_size=BATCH, shuffle=True, generator=gen)
    if kind == "dataloader_workers":
        return DataLoader(Noisy(x, y), batch_size=BATCH, shuffle=True, num_workers=2, generator=gen)
    if kind == "dataloader_persistent":  # workers started once, at the first epoch (order only: no noise)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, num_workers=2, generator=gen,
                          persistent_workers=True)
    if kind == "numpy_augment":
        return DataLoader(NumpyNoisy(x, y), batch_size=BATCH, shuffle=True)
    if kind == "sampler":  # a sampler with a generator of its own
        ds = Noisy(x, y)
        return DataLoader(ds, batch_size=BATCH, sampler=RandomSampler(ds, generator=gen))
    if kind in ("stateful", "stateful_workers"):
        from torchdata.stateful_dataloader import StatefulDataLoader
        workers = 2 if kind == "stateful_workers" else 0
        dataset = Noisy(x, y) if workers == 0 else TensorDataset(x, y)  # workers' draws are not saved
        return StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, generator=gen)
    if kind == "stateful_sampler":  # no generator of its own: what torchrun's DistributedSampler gives it
        from torch.utils.data import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader
        dataset = Noisy(x, y)
        return StatefulDataLoader(dataset, batch_size=BATCH,
                                  sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=5))
    if kind == "list":
        return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, SAMPLES, BATCH)]
    raise ValueError(kind)


def trainer(kind, accumulate=1, callbacks=(), **kwargs):
    import random

    import numpy as np

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return Trainer(model, opt, nn.CrossEntropyLoss(), loader(kind), device="cpu", accumulate=accumulate,
                   scheduler=sched, callbacks=list(callbacks), **kwargs)


class StopAt(Callback):
    """Stops training once, from hook `hook`, when `batches_trained` reaches `at` ("start": before batch at+1).
    `how`: "raise" StopTraining, or "signal": a real SIGINT to this process (what Ctrl-C sends)."""

    def __init__(self, at, hook="on_batch_end", how="raise"):
        self.at, self.hook, self.how, self.fired = at, hook, how, False

    def _maybe(self, trainer, *args):
        if self.fired or trainer.batches_trained < self.at:  # inside a step the count moves a group at a time
            return
        self.fired = True
        if self.how == "signal":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            raise StopTraining("stop point")


# StopAt's hooks are set per instance; the Trainer looks hooks up on the class. One class per hook:
def stop_class(hook):
    def method(self, trainer, *args):
        self._maybe(trainer, *args)
    return type(f"StopAt_{hook}", (StopAt,), {hook: method})


def stopper(at, hook="on_batch_end", how="raise"):
    return stop_class(hook)(at, hook, how)


def group_end(at: int, accumulate: int) -> int:
    """Batches trained when a stop asked for after batch `at` takes effect: at the end of its group."""
    epoch, i = divmod(at - 1, BATCHES)
    return epoch * BATCHES + min(-(-(i + 1) // accumulate) * accumulate, BATCHES)


def same(a, b) -> list[str]:
    """What differs between two trainers: weights, optimizer state, loss history, counters (empty if nothing)."""
    diffs = [k for (k, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values())
             if not torch.equal(p, q)]
    if a.history != b.history:
        diffs.append(f"history {a.history} != {b.history}")
    if (a.batches_trained, a.optimizer_steps, a.epoch) != (b.batches_trained, b.optimizer_steps, b.epoch):
        diffs.append(f"counters {(a.batches_trained, a.optimizer_steps, a.epoch)} != "
                     f"{(b.batches_trained, b.optimizer_steps, b.epoch)}")
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    if any(not torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa):
        diffs.append("optimizer state")
    return diffs
