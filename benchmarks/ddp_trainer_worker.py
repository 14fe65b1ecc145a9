"""Run by benchmarks/bench_ddp.py under torchrun: the course Trainer against a hand-written DDP loop, per step.

Both train the same overhead-bound model (nn.Linear 32 -> 10, batch 8 per process: the step is mostly Python and
communication, so any per-step cost of the Trainer shows) on the same shard of the same data, one epoch per
round, in an order that alternates every round; a barrier starts each timed epoch on both ranks together. Rank 0
writes the epoch times as JSON to the path given.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_trainer_worker.py OUT.json [ROUNDS] [STEPS]
"""
import json
import math
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course_utils.data import TensorLoader
from course_utils.trainer import Trainer


def main(out, rounds=9, steps=400):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(steps * 16, 32, generator=g), torch.randint(0, 10, (steps * 16,), generator=g)
    loader = TensorLoader(x, y, batch_size=8, shuffle=False)

    torch.manual_seed(0)
    course_model = nn.Linear(32, 10)
    trainer = Trainer(course_model, torch.optim.SGD(course_model.parameters(), lr=0.05, momentum=0.9),
                      nn.CrossEntropyLoss(), loader, device="cpu")
    process = trainer.process
    torch.manual_seed(0)
    hand_model = DistributedDataParallel(nn.Linear(32, 10))
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    shard = loader.shard(process.rank, process.world_size)

    def hand():
        hand_model.train()
        losses, sizes = [], []
        for xb, yb in shard:
            hand_opt.zero_grad(set_to_none=True)
            loss = loss_fn(hand_model(xb), yb)
            loss.backward()
            hand_opt.step()
            losses.append(loss.detach())  # on the device until the epoch's end, as the Trainer keeps them
            sizes.append(len(yb))
        total = math.fsum(v * n for v, n in zip(torch.stack(losses).tolist(), sizes))  # one read, added exactly
        sums = torch.tensor([total, float(sum(sizes))], dtype=torch.float64)
        dist.all_reduce(sums)  # the epoch's global mean, as the Trainer reports it
        return (sums[0] / sums[1]).item()

    def course():
        return trainer(1)[0]

    times = {"hand": [], "course": []}
    losses = {"hand": [], "course": []}
    for r in range(rounds + 1):  # round 0 warms up, untimed
        order = ["hand", "course"] if r % 2 == 0 else ["course", "hand"]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = hand() if name == "hand" else course()
            seconds = time.perf_counter() - t0
            if r > 0:
                times[name].append(seconds)
                losses[name].append(loss)
    same = torch.equal(hand_model.module.weight, course_model.weight)
    if process.rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "losses": losses, "steps": len(shard), "weights_equal": same,
                       "world_size": process.world_size}, f)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:4]))
