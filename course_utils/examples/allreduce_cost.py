"""What data parallelism costs, measured: all-reduce time against tensor size, and a DDP step against a local one.

    torchrun --nproc-per-node 2 -m course_utils.examples.allreduce_cost --out cost.json

Every rank, in the same order:
1. `dist.all_reduce` of float32 tensors of growing size (warm-up, then the median of `--repeats` calls, each
   ended by a barrier so the ranks start together); the bus bandwidth is 2 (N-1)/N x bytes / time, the figure
   NCCL's own tests report (a ring all-reduce moves each byte 2 (N-1)/N times).
2. One training step of the course's SimpleCNN (batch `--batch-size` per rank): through DistributedDataParallel
   (gradients all-reduced in buckets during backward) and the same step on the bare model (no communication), in
   alternating rounds; the difference is what the gradient exchange costs per step, here.
Rank 0 writes the figures (JSON) to `--out` and prints them. Without torchrun it measures the local step only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils import distributed
from course_utils.amp import MixedPrecision
from course_utils.models import SimpleCNN, count_parameters
from course_utils.step import TrainStep
from course_utils.timing import synchronize


def allreduce_seconds(numel: int, repeats: int, device: torch.device) -> float:
    t = torch.randn(numel, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        synchronize(device)  # CPU-GPU sync point here: NCCL's all-reduce is queued like a kernel
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_seconds(step: TrainStep, x, y, steps: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    synchronize(device)
    return (time.perf_counter() - start) / steps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000,4000000", help="float32 elements")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    process = distributed.setup()  # NCCL when there is a GPU for every process, else gloo on the CPU
    if process is not None:
        device_type = "cuda" if process.backend == "nccl" else "cpu"
    else:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    device = distributed.device_for(process, device_type) if process else torch.device(device_type)
    result = {"world_size": process.world_size if process else 1, "backend": process.backend if process else None,
              "device": str(device), "allreduce": [], "step": {}}
    if process is not None:
        for numel in (int(float(s)) for s in args.sizes.split(",")):
            seconds = allreduce_seconds(numel, args.repeats, device)
            n = process.world_size
            result["allreduce"].append({"numel": numel, "bytes": 4 * numel, "seconds": seconds,
                                        "bus_gb_per_s": 2 * (n - 1) / n * 4 * numel / seconds / 1e9})

    torch.manual_seed(0)
    model = SimpleCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    precision = MixedPrecision(device, enabled=False)
    local = TrainStep(model, optimizer, F.cross_entropy, precision)
    steps = {"local": local}
    if process is not None:
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        steps["ddp"] = TrainStep(ddp, optimizer, F.cross_entropy, precision)
    g = torch.Generator().manual_seed(process.rank if process else 0)
    x = torch.randn(args.batch_size, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    samples = {name: [] for name in steps}
    for name, step in steps.items():  # warm-up
        step_seconds(step, x, y, 2, device)
    for _ in range(args.rounds):
        for name, step in steps.items():
            if process is not None:
                dist.barrier()
            samples[name].append(step_seconds(step, x, y, args.steps, device))
    result["step"] = {"model": "SimpleCNN", "parameters": count_parameters(model),
                      "gradient_bytes": 4 * count_parameters(model), "batch_per_rank": args.batch_size,
                      **{f"{name}_seconds": statistics.median(v) for name, v in samples.items()}}
    if process is None or process.is_main:
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
