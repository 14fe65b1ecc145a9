"""Small data-parallel programs for notebook 08, each showing one thing DDP does or one way a run breaks.

    torchrun --nproc-per-node 2 -m course_utils.examples.ddp_demos replicas --out r.json [--save-weights w.pt]
    torchrun --nproc-per-node 2 -m course_utils.examples.ddp_demos raise      # rank 1 raises at its third batch
    torchrun --nproc-per-node 2 -m course_utils.examples.ddp_demos hang       # a collective only rank 0 calls
    torchrun --nproc-per-node 2 -m course_utils.examples.ddp_demos mismatch   # the same, then another collective
    torchrun --nproc-per-node 2 -m course_utils.examples.ddp_demos diverge --out d.json  # exercise 08.4, for real

- `replicas`: a different seed on every rank before the model is built, then DistributedDataParallel: the
  parameters before and after its construction, after training steps on different data, and where each rank's
  BatchNorm running statistics start from at a forward. Then the `Trainer` trains a BatchNorm model
  (`build_bn_model`, batch 32 per rank) and rank 0 saves its weights (`--sync-batchnorm` converts the BatchNorm
  layers to SyncBatchNorm first; PyTorch supports that on GPUs only).
- `raise`, `hang`, `mismatch`: three bugs, for what torchrun and the process group report about them. The
  failures run on CPU processes (gloo) on any machine.
- `diverge`: every snippet of exercise 08.4 run on 2 ranks; rank 0 writes how far the replicas' weights drifted.
Rank 0 writes the figures (JSON) to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from course_utils import distributed
from course_utils.callbacks import Callback
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.i18n import _
from course_utils.trainer import Trainer


def build_bn_model() -> nn.Module:
    """A small digits classifier with a BatchNorm layer: its output depends on the batch it normalizes over."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def bn_trainer(batch_size: int, device=None, sync_batchnorm: bool = False, samples: int = 512) -> Trainer:
    """The BatchNorm model, SGD and synthetic digits: the same run in one process or in several."""
    data = synthetic_digits(samples, seed=0)
    torch.manual_seed(0)
    model = build_bn_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = TensorLoader.from_dataset(data, batch_size=batch_size, seed=0)
    return Trainer(model, optimizer, nn.CrossEntropyLoss(), loader, device=device, sync_batchnorm=sync_batchnorm)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in module.parameters()])


def replicas(args, device_type: str) -> dict:
    process = distributed.setup(device_type)
    device = distributed.device_for(process, device_type)
    torch.manual_seed(process.rank)  # a different seed on every rank: different initial weights
    model = build_bn_model().to(device)
    before = _flat(model)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    after = _flat(model)
    # Training steps on different data on each rank: the gradients are averaged, so the updates are the same.
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + process.rank)
    for _i in range(3):
        x = (torch.randn(16, 1, 28, 28, generator=g) + process.rank).to(device)  # rank 1's inputs are shifted
        y = torch.randint(0, 10, (16,), generator=g).to(device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    trained = _flat(model)
    bn = model[2]
    stats_after_training = bn.running_mean.detach().cpu().clone()
    # One more forward: DDP first broadcasts rank 0's buffers, then BatchNorm updates them with this rank's batch.
    rank0_before = distributed.gather_objects(stats_after_training, process)[0]
    seen = {}
    handle = bn.register_forward_pre_hook(lambda mod, inp: seen.update(mean=inp[0].detach().mean(0).cpu()))
    x = (torch.randn(16, 1, 28, 28, generator=g) + process.rank).to(device)
    ddp(x)
    handle.remove()
    m = bn.momentum
    from_rank0 = (1 - m) * rank0_before + m * seen["mean"]
    from_own = (1 - m) * stats_after_training + m * seen["mean"]
    running = bn.running_mean.detach().cpu()
    mine = {"rank": process.rank, "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
            "rendezvous": [k for k in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(k)], "before": before.tolist()[:3], "after": after.tolist()[:3],
            "before_sum": before.double().sum().item(), "after_sum": after.double().sum().item(),
            "trained_sum": trained.double().sum().item(),
            "running_mean_after_training": stats_after_training.tolist()[:3],
            "forward_started_from_rank0": (running - from_rank0).abs().max().item(),
            "forward_started_from_own": (running - from_own).abs().max().item()}
    result = {"world_size": process.world_size, "backend": process.backend,
              "forward_sync_buffers": ddp.forward_sync_buffers}
    del ddp, optimizer
    result["ranks"] = distributed.gather_objects(mine, process)
    # The Trainer on the BatchNorm model: batch 32 per rank.
    trainer = bn_trainer(batch_size=32, device=device_type, sync_batchnorm=args.sync_batchnorm)
    trainer(1)
    state = {k: v.cpu() for k, v in trainer.model.state_dict().items()}
    stats = distributed.gather_objects(state["2.running_mean"], process)
    result["trainer"] = {"sync_batchnorm": args.sync_batchnorm,
                         "running_mean_rank_difference": (stats[0] - stats[1]).abs().max().item(),
                         "bn_class": type(trainer.model[2]).__name__, "history": trainer.history}
    if process.is_main and args.save_weights:
        torch.save(state, args.save_weights)
    return result


# Kept in English in both editions, so not in the catalog: notebook 08 (its Chinese edition too) asserts this text.
BAD_BATCH_MESSAGE = "rank 1: batch 3 has labels outside 0..9"


class BadBatchOnRank1(Callback):
    """Rank 1 meets a broken batch at its third step (what a corrupt file or a NaN check would raise)."""

    def on_batch_end(self, trainer, loss):
        if trainer.process.rank == 1 and trainer.batches_trained == 3:
            raise ValueError(BAD_BATCH_MESSAGE)  # English: notebook 08 compares it


def fail_on_rank1(device_type: str) -> None:
    data = synthetic_digits(512, seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    Trainer(model, optimizer, nn.CrossEntropyLoss(), TensorLoader.from_dataset(data, batch_size=16, seed=0),
            device=device_type, callbacks=[BadBatchOnRank1()])(2)


def skip_a_collective(then: str) -> None:
    """The classic: a collective inside `if rank == 0:` (here the global class counts, printed by rank 0)."""
    process = distributed.setup("cpu")
    labels = synthetic_digits(64, seed=process.rank).labels
    counts = torch.bincount(labels, minlength=10).float()
    if process.is_main:
        counts = distributed.all_sum(counts, process)  # BUG: only rank 0 calls this all-reduce
        print(_("class counts: {counts}").format(counts=counts.tolist()), flush=True)
    if then == "barrier":
        distributed.barrier(process)  # every rank: wait for the others before leaving
    else:
        sums = distributed.all_sum(torch.tensor([float(len(labels)), 0.0]), process)  # every rank: the epoch's sums
        print(_("rank {rank}: samples {samples:.0f}").format(rank=process.rank, samples=sums[0].item()), flush=True)


# --- exercise 08.4: each snippet, run for real ------------------------------------------------------

SNIPPETS = "ABCDEFG"


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


def _run_snippet(letter: str, process) -> float:
    """Train 2 epochs of 4 steps as snippet `letter` describes; return the largest weight difference between
    rank 0 and the other ranks at the end."""
    rank, world = process.rank, process.world_size
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 20, generator=g), torch.randint(0, 4, (64,), generator=g))
    torch.manual_seed(rank if letter in "BC" else 0)
    model = _Net()
    net = model if letter == "C" else DistributedDataParallel(model)
    if letter == "F":
        torch.manual_seed(1000 + rank)  # different dropout masks on every rank
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    for epoch in range(2):
        if letter != "D":
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            if letter == "C":  # gradients averaged by hand
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            if letter == "E":
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            if letter == "G" and rank == 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
            optimizer.step()
        if letter != "A" or rank == 0:
            scheduler.step()
    weights = [w for w in distributed.gather_objects(_flat(model), process)]
    return max((w - weights[0]).abs().max().item() for w in weights[1:])


def diverge() -> dict:
    process = distributed.setup("cpu")
    return {"world_size": process.world_size, "drift": {letter: _run_snippet(letter, process) for letter in SNIPPETS}}


@record  # on failure, torchrun's summary shows this rank's traceback
def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("replicas", "raise", "hang", "mismatch", "diverge"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-weights", default=None)
    parser.add_argument("--sync-batchnorm", action="store_true")
    args = parser.parse_args(argv)
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = None
    if args.mode == "replicas":
        result = replicas(args, device_type)
    elif args.mode == "raise":
        fail_on_rank1("cpu")
    elif args.mode in ("hang", "mismatch"):
        skip_a_collective("barrier" if args.mode == "hang" else "all_reduce")
    elif args.mode == "diverge":
        result = diverge()
    if result is not None and args.out and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
