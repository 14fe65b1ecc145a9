"""A training script for the fresh-process resume test (tests/test_trainer.py), one loader kind per run.

    python resume_worker.py KIND first CKPT     # trains, prints "batch N" lines; a real SIGINT stops it
    python resume_worker.py KIND finish CKPT    # an uninterrupted reference run, then a resume from CKPT;
                                                # prints "same" if both end bit-identical, else what differs
    python resume_worker.py edges-first DIR     # every loader kind x stop point x accumulate 1, 2 of
                                                # tests/edge_cases.py: one checkpoint each in DIR
    python resume_worker.py edges-finish DIR    # resumes each against an uninterrupted run; "all same" or why not
"""
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

from course_utils.callbacks import Callback
from course_utils.data import TensorLoader
from course_utils.trainer import Trainer

from edge_cases import Noisy  # a random augmentation in __getitem__ (tests/edge_cases.py)

EPOCHS = 3


class StatefulNoisy(Noisy):
    """The same augmentation from the dataset's own generator, which it saves (torchdata's Stateful protocol):
    StatefulDataLoader keeps each worker's dataset state, so the draws continue exactly after a resume."""

    generator = None

    def __getitem__(self, i):
        if self.generator is None:  # in each worker: seeded from the worker's seed
            self.generator = torch.Generator().manual_seed(torch.initial_seed())
        return self.x[i] + 0.1 * torch.randn(self.x[i].shape, generator=self.generator), self.y[i]

    def state_dict(self):
        return {"generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state):
        if state["generator"] is not None:
            self.generator = torch.Generator()
            self.generator.set_state(state["generator"])


def data(n=192):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def loader(kind):
    x, y = data()
    if kind == "tensor":
        return TensorLoader(x, y, batch_size=16, seed=3)
    if kind == "dataloader":  # a careful learner's DataLoader: its own generator, workers, augmentation
        return DataLoader(Noisy(x, y), batch_size=16, shuffle=True, num_workers=2,
                          generator=torch.Generator().manual_seed(5))
    if kind == "sampler":  # a sampler with its own generator, distinct from the loader's
        ds = Noisy(x, y)
        return DataLoader(ds, batch_size=16, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(7)))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(StatefulNoisy(x, y), batch_size=16, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(5))
    if kind == "list":
        return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(y), 16)]
    raise ValueError(kind)


def trainer(kind, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return Trainer(model, opt, nn.CrossEntropyLoss(), loader(kind), device="cpu", scheduler=sched, **kwargs)


class Slow(Callback):
    """Says where it is and gives the test time to press Ctrl-C."""

    def on_batch_end(self, trainer, loss):
        print(f"batch {trainer.batches_trained}", flush=True)
        time.sleep(0.05)


def main(kind, mode, path):
    if mode == "first":
        t = trainer(kind, checkpoint=path, callbacks=[Slow()])
        t(EPOCHS)
        print(f"stopped interrupted={t.interrupted} epoch={t.epoch} batches={t.batches_trained}", flush=True)
        return
    reference = trainer(kind)
    reference(EPOCHS)
    resumed = trainer(kind).load_checkpoint(path)
    assert resumed.batches_trained > 0, "the checkpoint holds no progress"
    resumed(EPOCHS - resumed.epoch)
    diffs = [name for (name, p), q in zip(reference.model.state_dict().items(), resumed.model.state_dict().values())
             if not torch.equal(p, q)]
    if resumed.history != reference.history:
        diffs.append(f"history {resumed.history} != {reference.history}")
    print("same" if not diffs else f"differ: {diffs}", flush=True)


def periodic(path):
    """A run with a checkpoint every 4 steps and resume=True, printing its batches (the test kills it); then an
    uninterrupted run in this process: prints "same" if both end bit-identical."""
    from course_utils.callbacks import Checkpoint

    t = trainer("tensor", callbacks=[Checkpoint(path, every_n_steps=4), Slow()], resume=True)
    t(EPOCHS - t.epoch)
    reference = trainer("tensor")
    reference(EPOCHS)
    same = all(torch.equal(a, b) for a, b in zip(t.model.state_dict().values(), reference.model.state_dict().values()))
    print("same" if same and t.history == reference.history else f"differ: {t.history} {reference.history}",
          flush=True)


def edges(mode, folder):
    import warnings
    from pathlib import Path

    import edge_cases as ec

    warnings.filterwarnings("ignore", message=".*set_vital.*")
    bad = []
    for kind in ec.KINDS:
        for accumulate in (1, 2):
            reference = None
            for at in ec.STOP_POINTS:
                path = Path(folder) / f"{kind}_{accumulate}_{at}.pt"
                if mode == "edges-first":
                    ec.trainer(kind, accumulate, [ec.stopper(at)], checkpoint=path)(ec.EPOCHS)
                    continue
                if reference is None:
                    reference = ec.trainer(kind, accumulate)
                    reference(ec.EPOCHS)
                resumed = ec.trainer(kind, accumulate).load_checkpoint(path)
                if resumed.batches_trained != ec.group_end(at, accumulate):
                    bad.append(f"{path.name}: {resumed.batches_trained} batches in the checkpoint")
                resumed(ec.EPOCHS - resumed.epoch)
                diffs = ec.same(resumed, reference)
                if diffs:
                    bad.append(f"{path.name}: {diffs}")
    if mode == "edges-finish":
        print("\n".join(bad) if bad else "all same", flush=True)


if __name__ == "__main__":
    if sys.argv[1].startswith("edges-"):
        edges(sys.argv[1], sys.argv[2])
    elif sys.argv[1] == "periodic":
        periodic(sys.argv[2])
    else:
        main(*sys.argv[1:4])
