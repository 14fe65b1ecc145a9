"""Train the course's digits model with the `Trainer`, in one process or data-parallel in several.

    python -m course_utils.examples.train_digits --epochs 2
    torchrun --nproc-per-node 2 -m course_utils.examples.train_digits --epochs 2   # 2 CPU processes (gloo)
    torchrun --nproc-per-node 4 -m course_utils.examples.train_digits --epochs 2   # 4 GPUs (NCCL)

The script is the same in both cases: the Trainer sees torchrun's environment, joins the process group, wraps the
model in DistributedDataParallel and gives each process its share of every epoch. `--batch-size` is per process
(PyTorch's convention): with N processes one optimizer step sees N x batch-size samples, so the same
`--batch-size` trains with an N times larger global batch (scale the learning rate or pass batch-size / N to keep
the single-process run's updates). Rank 0 prints and writes the checkpoint; every rank can resume from it.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

from course_utils.data import TensorLoader, synthetic_digits
from course_utils.i18n import _
from course_utils.models import SimpleCNN
from course_utils.trainer import Trainer


def build_model(kind: str) -> nn.Module:
    if kind == "cnn":
        return SimpleCNN()
    if kind == "linear":  # small and without BatchNorm or dropout: runs equal float for float
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    raise ValueError(f"unknown model {kind!r}")


def main(argv=None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic digits to train on")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--model", choices=("cnn", "linear"), default="cnn")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    parser.add_argument("--checkpoint", default=None, help="save the full state here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--save-weights", default=None, help="write the final weights here (rank 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = synthetic_digits(args.samples, seed=args.seed)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = TensorLoader.from_dataset(data, batch_size=args.batch_size, seed=args.seed)
    trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), loader, device=args.device,
                      accumulate=args.accumulate, checkpoint=args.checkpoint)
    if args.resume:
        trainer.load_checkpoint(args.checkpoint)
    world = trainer.process.world_size
    if trainer.is_main:
        # Notebook 08 and the tests look for "2 process(es)", "global batch 64" and lines "epoch N: ... LOSS" (the loss
        # last): the Chinese catalog keeps those words.
        print(_("{world} process(es) on {device}; global batch {global_batch}; {steps} steps an epoch per "
                "process").format(world=world, device=trainer.device,
                                  global_batch=world * args.batch_size * args.accumulate,
                                  steps=len(trainer.train_loader)), flush=True)
    losses = trainer(args.epochs - trainer.epoch)
    if trainer.is_main:
        for epoch, loss in enumerate(trainer.history, 1):
            print(_("epoch {epoch}: mean loss {loss:.6f}").format(epoch=epoch, loss=loss), flush=True)
        if args.save_weights:
            torch.save(trainer.model.state_dict(), args.save_weights)
    del losses
    return trainer


if __name__ == "__main__":
    main()
