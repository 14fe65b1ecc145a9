"""Worker scripts for tests/test_distributed.py, launched with torchrun.

    torchrun --nproc-per-node 2 ddp_worker.py count OUT   # accumulate=2: count gradient all-reduces per step
    torchrun --nproc-per-node 2 ddp_worker.py fail        # rank 1 raises at its third batch
    torchrun --nproc-per-node 2 ddp_worker.py oom         # rank 1 alone runs out of memory (oom_recovery=True)
"""
import json
import sys

import torch
from torch import nn

from course_utils.callbacks import Callback
from course_utils.data import TensorLoader, synthetic_digits
from course_utils.trainer import Trainer


class BreakOnRank1(Callback):
    def on_batch_end(self, trainer, loss):
        if trainer.process.rank == 1 and trainer.batches_trained == 3:
            raise RuntimeError("rank 1 broke on purpose")


def linear_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def trainer(**kwargs):
    data = synthetic_digits(512, seed=0)
    model = linear_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return Trainer(model, opt, nn.CrossEntropyLoss(), TensorLoader.from_dataset(data, batch_size=16, seed=0),
                   device="cpu", **kwargs)


def main(mode, out=None):
    if mode == "count":
        t = trainer(accumulate=2)
        calls = []

        def counting_allreduce(state, bucket):  # DDP's default all-reduce, counted
            calls.append(1)
            tensor = bucket.buffer().div_(t.process.world_size)
            work = torch.distributed.all_reduce(tensor, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        t.train_model.register_comm_hook(None, counting_allreduce)
        t(1)
        if t.is_main:
            json.dump({"allreduce_calls": len(calls), "optimizer_steps": t.optimizer_steps,
                       "batches": t.batches_trained}, open(out, "w"))
    elif mode == "fail":
        trainer(callbacks=[BreakOnRank1()])(2)
    elif mode == "oom":  # rank 1 alone runs out of memory with oom_recovery on
        from course_utils.memory import SimulatedGPU

        t = trainer(oom_recovery=True)
        if t.process.rank == 1:
            probe = linear_model()  # a step's peak, measured on a copy (no Trainer: that would join DDP again)
            opt = torch.optim.SGD(probe.parameters(), lr=0.05)
            with SimulatedGPU("1GiB", model=probe, optimizer=opt) as sim:
                before = sim.memory_allocated()
                x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))  # a batch, as the loader makes it
                nn.functional.cross_entropy(probe(x), y).backward()
                opt.step()
                peak = sim.max_memory_allocated()
            budget = before + (peak - before) * 19 // 20  # the batch fits, the whole step does not
            with SimulatedGPU(budget, model=t.model, optimizer=t.optimizer):
                t(1)
        else:
            t(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
