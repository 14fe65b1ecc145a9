"""Train the course's digits model with the `Trainer`, in one process or data-parallel in several.

    python -m course_utils.examples.train_digits --epochs 2
    torchrun --nproc-per-node 2 -m course_utils.examples.train_digits --epochs 2   # 2 CPU processes (gloo)
    torchrun --nproc-per-node 4 -m course_utils.examples.train_digits --epochs 2   # 4 GPUs (NCCL)

The script is the same in both cases: the Trainer sees torchrun's environment, joins the process group, wraps the
model in DistributedDataParallel and gives each process its share of every epoch. `--batch-size` is per process
(PyTorch's convention): with N processes one optimizer step sees N x batch-size samples, so the same
`--batch-size` trains with an N times larger global batch (scale the learning rate or pass batch-size / N to keep
the single-process run's updates). Rank 0 prints and writes the checkpoint; every rank can resume from it.

When a process dies (notebook 08, "When a process dies"): with `--checkpoint run.pt --checkpoint-every 50 --resume`
the same command serves the first launch and every restart, so `torchrun --max-restarts 3 ...` recovers from a
killed rank by itself, losing at most the steps since the last save. `--kill-at-step K` makes a failure to practise
on: in the first attempt (torchrun's TORCHELASTIC_RESTART_COUNT is 0) the last rank SIGKILLs itself, with no
warning and nothing saved, right after optimizer step K, as the kernel's OOM killer or a lost node would end it.
"""
from __future__ import annotations

import argparse
import os
import re
import signal

import torch
from torch import nn

from course_utils.callbacks import Callback, Checkpoint
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.i18n import N_, _
from course_utils.models import SimpleCNN
from course_utils.trainer import Trainer


def build_model(kind: str) -> nn.Module:
    if kind == "cnn":
        return SimpleCNN()
    if kind == "linear":  # small and without BatchNorm or dropout: runs equal float for float
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    raise ValueError(_("unknown model {kind!r}").format(kind=kind))


class KillAtStep(Callback):
    """The last rank SIGKILLs itself after optimizer step `step`, in torchrun's first attempt only."""

    def __init__(self, step: int):
        self.step = step

    def on_batch_end(self, trainer, loss):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (first_attempt and trainer.at_step_boundary and trainer.optimizer_steps == self.step
                and trainer.process.rank == trainer.process.world_size - 1):
            print(_("rank {rank}: killed (SIGKILL) after step {step}").format(
                rank=trainer.process.rank, step=self.step), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


EPOCH_LINE = N_("epoch {epoch}: mean loss {loss:.6f}")


def printed_losses(text: str) -> list[float]:
    """The epochs' mean losses that `main` printed in `text`, in order, read in the language set (the lines are
    EPOCH_LINE, translated)."""
    template = re.escape(_(EPOCH_LINE)).replace(r"\{epoch\}", r"\d+").replace(r"\{loss:\.6f\}", r"([-\d.eE+]+|nan|inf)")
    return [float(m.group(1)) for m in re.finditer(template, text)]


def main(argv=None, callbacks=()) -> Trainer:
    """Parse `argv` (default: the command line), train, and return the Trainer; `callbacks` are added to its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic digits to train on")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--model", choices=("cnn", "linear"), default="cnn")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best available)")
    parser.add_argument("--checkpoint", default=None, help="save the full state here after every epoch")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="also save every N optimizer steps")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint if it exists, else start fresh (the same command restarts)")
    parser.add_argument("--kill-at-step", type=int, default=None,
                        help="the last rank SIGKILLs itself after this step, in the first attempt (a failure to try)")
    parser.add_argument("--save-weights", default=None, help="write the final weights here (rank 0)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = synthetic_digits(args.samples, seed=args.seed)
    torch.manual_seed(args.seed)  # the same initial weights in every process
    model = build_model(args.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = TensorLoader.from_dataset(data, batch_size=args.batch_size, seed=args.seed)
    callbacks = list(callbacks) + ([] if args.kill_at_step is None else [KillAtStep(args.kill_at_step)])
    if args.checkpoint is not None:
        callbacks.append(Checkpoint(args.checkpoint, every_n_steps=args.checkpoint_every))
    elif args.checkpoint_every is not None or args.resume:
        parser.error("--checkpoint-every and --resume need --checkpoint")
    trainer = Trainer(model, optimizer, nn.CrossEntropyLoss(), loader, device=args.device,
                      accumulate=args.accumulate, callbacks=callbacks, resume=args.resume)
    world = trainer.process.world_size
    if trainer.is_main:
        # Notebook 08 and the tests look for "2 process(es)" and "global batch 64" in this line (in the language
        # set: the Chinese notebook's own literals are translated to match), and read the losses with printed_losses.
        print(_("{world} process(es) on {device}; global batch {global_batch}; {steps} steps an epoch per "
                "process").format(world=world, device=trainer.device,
                                  global_batch=world * args.batch_size * args.accumulate,
                                  steps=len(trainer.train_loader)), flush=True)
    losses = trainer(args.epochs - trainer.epoch)
    if trainer.is_main:
        for epoch, loss in enumerate(trainer.history, 1):
            print(_(EPOCH_LINE).format(epoch=epoch, loss=loss), flush=True)
        if args.save_weights:
            torch.save(trainer.model.state_dict(), args.save_weights)
    del losses
    return trainer


if __name__ == "__main__":
    main()
