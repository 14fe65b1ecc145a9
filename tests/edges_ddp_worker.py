"""The Trainer's distributed promises, run by tests/test_trainer_edges_ddp.py under `torchrun --nproc-per-node 2`.

    torchrun ... edges_ddp_worker.py first DIR    # per loader kind: a run stopped by rank 1 alone mid-epoch 2
                                                  # (checkpoint DIR/KIND.pt) and one whose stop lands after
                                                  # epoch 1's last batch (DIR/KIND_end.pt); the ranks' shares;
                                                  # a stop in on_epoch_end on rank 1;
                                                  # a nan loss on rank 1; a stop with the vote's interval
                                                  # adapting to slow steps. Rank 0 writes DIR/first.json.
    torchrun ... edges_ddp_worker.py finish DIR   # per kind: an uninterrupted run and resumes of both checkpoints
                                                  # in this new group; rank 0 writes DIR/finish.json

Every rank is seeded differently after the Trainer is built (dropout masks and random augmentations differ per
rank), so a resume is only exact if every rank gets its own random state back.
"""
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
import warnings

from torch.utils.data import DataLoader

from course_utils import distributed
from course_utils.callbacks import Callback, Checkpoint, StopTraining
from course_utils.data import TensorLoader
from course_utils.trainer import NonFiniteLossError, Trainer

from edge_cases import Noisy  # a random augmentation in __getitem__ (tests/edge_cases.py)

KINDS = ["tensor", "dataloader", "stateful"]
STOPS = {"": 27, "_end": 20}  # rank 1 asks after batch 27 (lands mid-epoch 2), or after 20 (lands after epoch 1's
#                               last batch, the 24th: the vote posted there is read at the epoch's end)
EPOCHS = 3


def trainer(kind, loss_fn=None, **kwargs):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(192, 1, 8, 8, generator=g), torch.randint(0, 10, (192,), generator=g)
    if kind == "tensor":  # 24 batches an epoch per rank
        loader = TensorLoader(x, y, batch_size=4, seed=1)
    elif kind == "dataloader":
        loader = DataLoader(Noisy(x, y), batch_size=4, shuffle=True)
    else:  # torchdata's, shuffled with a generator seeded differently on each rank (the Trainer warns)
        from torchdata.stateful_dataloader import StatefulDataLoader
        seed = 7 + int(os.environ["RANK"])
        loader = StatefulDataLoader(Noisy(x, y), batch_size=4, shuffle=True,
                                    generator=torch.Generator().manual_seed(seed))
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    t = Trainer(model, opt, loss_fn or nn.CrossEntropyLoss(), loader, device="cpu", **kwargs)
    torch.manual_seed(100 + t.process.rank)  # ranks draw different dropout masks and noise from here on
    return t


class Rank1Stops(Callback):
    """Rank 1 alone raises StopTraining: after its batch `at` (hook "batch") or at the end of epoch 1."""

    def __init__(self, at=None):
        self.at = at

    def on_batch_end(self, trainer, loss):
        if self.at is not None and trainer.process.rank == 1 and trainer.batches_trained == self.at:
            raise StopTraining(f"rank 1 asked at batch {self.at}")

    def on_epoch_end(self, trainer, logs):
        if self.at is None and trainer.process.rank == 1 and trainer.epoch == 1:
            raise StopTraining("rank 1 asked at an epoch end")


class Rank1Preempted(Callback):
    """Rank 1 alone gets a SIGTERM (a scheduler preempting one node) after its batch `at`."""

    def __init__(self, at):
        self.at = at

    def on_batch_end(self, trainer, loss):
        if trainer.process.rank == 1 and trainer.batches_trained == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


class Slow(Callback):
    """Steps of about 10 ms, so that the vote's interval has something to adapt to."""

    def on_batch_end(self, trainer, loss):
        time.sleep(0.01)


class NanOnRank1(nn.Module):
    def __init__(self, rank, at):
        super().__init__()
        self.rank, self.at, self.calls = rank, at, 0

    def forward(self, logits, y):
        self.calls += 1
        loss = nn.functional.cross_entropy(logits, y)
        return loss * math.nan if self.rank == 1 and self.calls == self.at else loss


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()])


def main(mode, folder):
    folder = Path(folder)
    out = {}
    for kind in KINDS:
        if mode == "first":
            for suffix, at in STOPS.items():
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    t = trainer(kind, callbacks=[Rank1Stops(at=at)], checkpoint=folder / f"{kind}{suffix}.pt")
                t(EPOCHS)
                out[kind + suffix] = distributed.gather_objects(
                    {"batches": t.batches_trained, "reason": t.stop_reason, "batch_in_epoch": t.batch_in_epoch,
                     "epoch": t.epoch, "seeds_warned": any("seeded differently" in str(w.message) for w in caught)},
                    t.process)
            sampler = getattr(t.train_loader, "sampler", None)  # the DistributedSampler the Trainer built
            out[kind + "_share"] = distributed.gather_objects(list(sampler) if sampler is not None else None,
                                                              t.process)
        else:
            reference = trainer(kind)
            reference(EPOCHS)
            for suffix in STOPS:
                resumed = trainer(kind)
                resumed.load_checkpoint(folder / f"{kind}{suffix}.pt")
                resumed(EPOCHS - resumed.epoch)
                out[kind + suffix] = distributed.gather_objects(
                    {"weights_equal": torch.equal(flat(reference.model), flat(resumed.model)),
                     "history_equal": reference.history == resumed.history,
                     "history": resumed.history, "reference": reference.history}, resumed.process)
    if mode == "first":
        t = trainer("tensor", callbacks=[Rank1Stops()])
        t(EPOCHS)
        out["epoch_end"] = distributed.gather_objects({"epoch": t.epoch, "reason": t.stop_reason}, t.process)
        rank = distributed.Process.from_environment().rank
        # without a save, and with a save after every step (the save is the first to read the bad loss, and names
        # it too)
        for key, callbacks in (("nan", []), ("nan_saving", [Checkpoint(folder / "nan.pt", every_n_steps=1)])):
            t = trainer("tensor", loss_fn=NanOnRank1(rank, 9), callbacks=callbacks)
            try:
                t(EPOCHS)
                message = None
            except NonFiniteLossError as exc:
                message = str(exc)
            out[key] = distributed.gather_objects(message, t.process)
        # the vote's interval adapted to the step time (the test runs set COURSE_STOP_VOTE_SECONDS=0 for the fixed
        # cadence above): the same interval on both ranks, so a stop asked by rank 1 still stops both together
        os.environ[distributed.ENV_VOTE_SECONDS] = "0.5"
        t = trainer("tensor", callbacks=[Slow(), Rank1Stops(at=60)])
        t(EPOCHS)
        out["adaptive"] = distributed.gather_objects({"every": t._vote.every, "batches": t.batches_trained,
                                                      "reason": t.stop_reason}, t.process)
    if mode == "first":
        # a SIGTERM that reaches rank 1 only: every rank stops at the same step, saves, and exits with 143
        t = trainer("tensor", callbacks=[Rank1Preempted(at=27)], checkpoint=folder / "preempted.pt")
        try:
            t(EPOCHS)
            code = None
        except SystemExit as exc:
            code = exc.code
        # leaving, a rank ignores the SIGTERM torchrun sends once another rank has left (else: -15, not 143)
        out["preempted"] = distributed.gather_objects(
            {"code": code, "batches": t.batches_trained,
             "sigterm_ignored": signal.getsignal(signal.SIGTERM) == signal.SIG_IGN}, t.process)
    if distributed.Process.from_environment().rank == 0:
        (folder / f"{mode}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
